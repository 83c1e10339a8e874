"""Whether Paddle's bfloat16 on this CPU computes what float32 does: one fc trained a step as
``decorate_bf16`` trains it, at a few batch sizes, against the same step in float64 (numpy).

Why: a bfloat16 kernel that runs is not one that computes right. Measured (Paddle 2.6.2 and 3.3.1, legacy
IR, one device, Intel and AMD): oneDNN's bfloat16 ``elementwise_add_grad`` -- an fc's bias gradient, a sum
over the batch -- sums over the features instead when the batch equals the layer's width (batch 4 on a
4-wide fc, batch 32 on a 32-wide one: 93 % and 130 % off on the probe's data), and at batch 1 raises "could
not create a primitive descriptor for a reduction primitive descriptor". The probe's layers are 4 and 32
wide, so batches 4 and 32 meet that case.

Every input is a multiple of 1/8 in [-1, 1] (exact in bfloat16), so the exact results differ from
float32's only by bfloat16 rounding the outputs (relative 2^-8 at most per rounding): ``TOLERANCE`` (2^-6,
four roundings) passes right kernels (measured: 0.2 % at most) and fails wrong ones by a wide margin.
"""
from __future__ import annotations

from dataclasses import dataclass

from .._paddle import core, np, paddle
from ..ir import free_scope

BATCHES = (1, 4, 32)
WIDTHS = (4, 32)  # the fcs' widths: batches 4 and 32 meet a width, where Paddle's bias gradient goes wrong
IN = 8
TOLERANCE = 2.0 ** -6  # relative (norm-wise) error against float32: bfloat16's precision, 2^-8, four times


@dataclass(frozen=True)
class Measured:
    """One quantity at one batch size: its relative error against float32, or what raised instead."""

    quantity: str
    batch: int
    error: float | None = None
    raised: str = ""

    @property
    def right(self) -> bool:
        return self.error is not None and self.error <= TOLERANCE

    def __str__(self) -> str:
        if self.error is None:
            return f"{self.quantity} at batch {self.batch} raised {self.raised!r}"
        return f"{self.quantity} at batch {self.batch}: {self.error:.1%} off float32"


def _exact(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-8, 9, shape).astype(np.float32) / 8


def measure() -> list[Measured]:
    """Every quantity at every batch of ``BATCHES``: the fc outputs, the input gradient, each fc's weight
    and bias gradients, each batch in a legacy-IR program of its own, as ``decorate_bf16`` builds and runs
    it (a program whose step raised once raises at every batch after)."""
    found: list[Measured] = []
    for batch in BATCHES:
        found += _step(batch, np.random.default_rng(batch))
    return found


def _step(batch: int, rng: np.random.Generator) -> list[Measured]:
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard("staticpipe_bf16_numbers"):
        x = paddle.static.data("x", [batch, IN], "float32")
        x.stop_gradient = False
        outs, loss = [], None
        for width in WIDTHS:
            out = paddle.static.nn.fc(x, width, weight_attr=paddle.ParamAttr(f"w{width}"),
                                      bias_attr=paddle.ParamAttr(f"b{width}"))
            term = paddle.sum(out * paddle.static.data(f"g{width}", [batch, width], "float32"))
            outs.append(out)
            loss = term if loss is None else loss + term
        paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.SGD(0.0)).minimize(loss)
    names = ["x@GRAD"] + [f"{p}{w}@GRAD" for w in WIDTHS for p in ("w", "b")]
    params = {f"{p}{w}": _exact(rng, (IN, w) if p == "w" else (w,)) for w in WIDTHS for p in ("w", "b")}
    feed = {"x": _exact(rng, (batch, IN))} | {f"g{w}": _exact(rng, (batch, w)) for w in WIDTHS}
    scope, place = core.Scope(), core.CPUPlace()
    exe = paddle.static.Executor(place)
    try:
        exe.run(startup, scope=scope)
        for name, value in params.items():
            scope.find_var(name).get_tensor().set(value, place)
        got = exe.run(main, feed=feed, fetch_list=outs + names, scope=scope)
    except Exception as exc:  # noqa: BLE001 -- a kernel that raises computes nothing: the step fails
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return [Measured("the step", batch, raised=lines[-1][:200] if lines else type(exc).__name__)]
    finally:
        free_scope(scope)
    return _compare(batch, feed, params, [_float(np.asarray(v)) for v in got])


def _float(value: np.ndarray) -> np.ndarray:
    """A fetched value in float64; bfloat16 comes as its uint16 bit patterns."""
    if value.dtype == np.uint16:
        value = (value.astype(np.uint32) << 16).view(np.float32)
    return value.astype(np.float64)


def _compare(batch: int, feed: dict, params: dict, got: list[np.ndarray]) -> list[Measured]:
    x = feed["x"].astype(np.float64)
    want = [x @ params[f"w{w}"] + params[f"b{w}"] for w in WIDTHS]
    want.append(sum(feed[f"g{w}"] @ params[f"w{w}"].T for w in WIDTHS))
    for w in WIDTHS:
        want += [x.T @ feed[f"g{w}"], feed[f"g{w}"].sum(0)]
    what = ([f"fc output [{batch}, {w}]" for w in WIDTHS] + [f"input gradient [{batch}, {IN}]"]
            + [q for w in WIDTHS for q in (f"weight gradient [{IN}, {w}]", f"bias gradient [{w}]")])
    return [Measured(q, batch, float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)))
            for q, g, r in zip(what, got, want)]
