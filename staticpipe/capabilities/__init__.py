"""What this machine's CPU can run: bfloat16 kernels, known before a step runs.

Why a probe and not the CPU flags: Paddle runs bfloat16 on CPU through oneDNN, which needs AVX-512 (or
AMX) -- but whether a bf16 matmul really runs also depends on Paddle's build and on ``ONEDNN_MAX_CPU_ISA``,
which caps oneDNN below what the CPU has. One tiny bf16 matmul through Paddle, run once per process (and
IR) in a scope of its own, sees all three. Without it, a bf16 stage on an AVX2-only CPU died in its first
forward with oneDNN's "could not create a primitive descriptor for a matmul primitive".

A kernel that runs is not one that computes right: where the matmul runs, ``bf16_numbers`` trains an fc a
step in bfloat16 at batches 1, 4 and 32 against float32 (Paddle 2.6.2 and 3.3.1 get an fc's bias gradient
wrong on Intel and AMD CPUs alike). Three answers: no kernel, runs but is wrong here (with the figures),
runs and is right. A wrong one is refused as a missing one is, unless ``STATICPIPE_ALLOW_WRONG_BF16=1``.

``require_bf16`` is what ``minimize`` (before the program changes) and the runtime (before a stage's
first run, when only the executor's device map says where it runs) call; ``describe`` is the line CI
prints first, so a red run on another machine can be read.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from .._paddle import core, np, paddle
from ..ir import free_scope
from ..pir_ir import is_pir_program, pir_mode
from . import bf16_numbers

WRONG_BF16_ENV = "STATICPIPE_ALLOW_WRONG_BF16"  # 1: train bfloat16 on a CPU whose Paddle computes it wrong
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # what decides the CPU's bf16 and GEMM speed


@dataclass(frozen=True)
class Bf16Support:
    """Whether CPU stages can run bfloat16 here; ``reason`` is the probe's error when they cannot;
    ``backward_crashes``: the forward runs, but Paddle's bfloat16 matmul backward kills the process;
    ``wrong``: they run, but these quantities come out wrong (``bf16_numbers``, in words; "" when right)."""

    ok: bool
    reason: str = ""
    backward_crashes: bool = False
    wrong: str = ""

    @property
    def right(self) -> bool:
        """bfloat16 runs here and computes what float32 does, within bfloat16's precision."""
        return self.ok and not self.wrong


_probed: dict[bool, Bf16Support] = {}  # IR (True: PIR) -> the probe's answer; the kernels differ by IR


def cpu_bf16() -> Bf16Support:
    """The answer for this process and the IR static programs are built in now, probed on first use."""
    with _static_mode():
        pir = pir_mode()
        if pir not in _probed:
            _probed[pir] = _probe(pir)
    return _probed[pir]


@contextlib.contextmanager
def _static_mode() -> Iterator[None]:
    """Static mode for the probe, also when asked from dygraph (a command line, a check before a script
    enabled static mode), which is then restored."""
    dynamic = paddle.in_dynamic_mode()
    if dynamic:
        paddle.enable_static()
    try:
        yield
    finally:
        if dynamic:
            paddle.disable_static()


def _probe(pir: bool) -> Bf16Support:
    """Run ``x @ x.T`` in bfloat16 on ``CPUPlace`` as a bf16 program's matmuls run: on the legacy IR the
    oneDNN ``mul`` that ``decorate_bf16`` marks (``use_mkldnn``, ``mkldnn_data_type``), on PIR Paddle's
    ``matmul``, which PIR lowers to oneDNN's for bfloat16."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard("staticpipe_bf16_probe"):
        x = paddle.static.data("x", [2, 4], "float32")
        xb = paddle.cast(x, "bfloat16")
        if pir:
            product = paddle.matmul(xb, xb, transpose_y=True)
        else:
            product = main.global_block().create_var(name="product", dtype=xb.dtype, shape=[2, 2])
            main.global_block().append_op(
                type="mul", inputs={"X": [xb], "Y": [paddle.transpose(xb, [1, 0])]}, outputs={"Out": [product]},
                attrs={"x_num_col_dims": 1, "y_num_col_dims": 1, "use_mkldnn": True, "mkldnn_data_type": "bfloat16"})
        out = paddle.cast(product, "float32")
    scope = core.Scope()
    try:
        got, = paddle.static.Executor(core.CPUPlace()).run(main, feed={"x": np.ones((2, 4), np.float32)},
                                                            fetch_list=[out], scope=scope)
    except Exception as exc:  # noqa: BLE001 -- oneDNN's refusal is the answer, in its own words
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return Bf16Support(False, lines[-1] if lines else type(exc).__name__)
    finally:
        free_scope(scope)
    if not np.array_equal(np.asarray(got), np.full((2, 2), 4.0, np.float32)):
        return Bf16Support(False, f"a bfloat16 matmul of ones computed {np.asarray(got).tolist()}, not 4s")
    return _probe_pir_backward() if pir else _probe_numbers()


def _probe_numbers() -> Bf16Support:
    """The matmul runs: do a step's outputs and gradients match float32's (``bf16_numbers``)? Legacy IR only,
    where ``decorate_bf16`` builds bfloat16 programs; on PIR the backward probe decides."""
    wrong = [m for m in bf16_numbers.measure() if not m.right]
    return Bf16Support(True, wrong="; ".join(map(str, wrong)))


# One training step of a bfloat16 matmul in a PIR program, on one CPU device, with no staticpipe in it.
_PIR_BACKWARD = """
import numpy as np, paddle
paddle.enable_static()
main, startup = paddle.static.Program(), paddle.static.Program()
with paddle.static.program_guard(main, startup):
    x = paddle.static.data("x", [2, 4], "float32")
    w = paddle.static.create_parameter([4, 4], "float32")
    loss = paddle.mean(paddle.cast(paddle.matmul(paddle.cast(x, "bfloat16"), paddle.cast(w, "bfloat16")), "float32"))
    paddle.optimizer.SGD(0.1).minimize(loss)
exe = paddle.static.Executor(paddle.CPUPlace())
exe.run(startup)
exe.run(main, feed={"x": np.ones((2, 4), np.float32)}, fetch_list=[loss])
"""


def _probe_pir_backward() -> Bf16Support:
    """Train one step of ``_PIR_BACKWARD`` in a process of its own. Why apart: Paddle 3.3.1's oneDNN
    ``MatmulGradKernel<bfloat16>`` on PIR dies with SIGSEGV on CPUs whose forward bfloat16 matmul runs
    (measured: also under ``paddle.amp.auto_cast`` O1 and O2, single device, no staticpipe), which no
    exception handler survives: a pipeline step would die the same way mid-step."""
    try:
        done = subprocess.run([sys.executable, "-c", _PIR_BACKWARD], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return Bf16Support(False, "a bfloat16 matmul backward on PIR did not finish in 300 s", True)
    if done.returncode == 0:
        return Bf16Support(True)
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
    last = [line.strip() for line in (done.stderr or "").splitlines() if "Error" in line or "Kernel<" in line]
    return Bf16Support(False, f"one training step of a bfloat16 matmul on PIR ended the process ({how})"
                       + (f": {last[-1][:200]}" if last else ""), True)


# ops whose bfloat16 kernels on CPU are oneDNN's (what the probe runs); a cast or an add of bfloat16
# values has plain CPU kernels and runs anywhere
ONEDNN_BF16_OPS = frozenset({"mul", "matmul", "matmul_v2", "fc", "conv2d", "depthwise_conv2d", "conv2d_transpose",
                             "pd_op.matmul", "pd_op.conv2d", "pd_op.depthwise_conv2d", "pd_op.conv2d_transpose"})


def bf16_kernel_op(program: Any) -> tuple[Any, str] | None:
    """The first op of ``program`` that runs a bfloat16 kernel only oneDNN has, and it in words; or None: an op
    ``decorate_bf16`` marked (``mkldnn_data_type`` "bfloat16"), or a matmul or convolution that reads a
    bfloat16 value."""
    block = program.global_block()
    for op in block.ops:
        if is_pir_program(program):
            if op.name() in ONEDNN_BF16_OPS and any(_is_bf16(v.dtype) for v in op.operands_source()):
                return op, f"op {op.name()!r} on bfloat16 values"
            continue
        if op.has_attr("mkldnn_data_type") and op.attr("mkldnn_data_type") == "bfloat16":
            return op, f"op {op.type!r}, which decorate_bf16 runs in bfloat16"
        if op.type in ONEDNN_BF16_OPS:
            low = [n for n in op.input_arg_names if _is_bf16(getattr(block._find_var_recursive(n), "dtype", None))]
            if low:
                return op, f"op {op.type!r} on the bfloat16 value {low[0]!r}"
    return None


def _is_bf16(dtype: Any) -> bool:
    return dtype == core.VarDesc.VarType.BF16 or str(dtype).endswith("bfloat16")


def require_bf16(device: str, place: Any, what: str) -> None:
    """Refuse bfloat16 work ``what`` on pipeline device ``device`` when ``place`` is the CPU and its
    probe says no, or that Paddle computes bfloat16 wrong here (unless ``STATICPIPE_ALLOW_WRONG_BF16=1``): a
    ``ValueError`` naming the device, what is missing or wrong, and what to do instead."""
    if not isinstance(place, core.CPUPlace) and not (isinstance(place, core.Place) and place.is_cpu_place()):
        return
    support = cpu_bf16()
    if support.right or (support.ok and wrong_bf16_allowed()):
        return
    if support.ok:
        raise ValueError(
            f"device {device!r} runs on the CPU, where Paddle runs {what} but computes it wrong: on this CPU "
            f"({cpu_model()}) Paddle {paddle.__version__}'s bfloat16 step is off float32 by more than bfloat16's "
            f"precision ({bf16_numbers.TOLERANCE:.2%}): {support.wrong}. Train in float32, or put this stage on a "
            f"GPU, or set {WRONG_BF16_ENV}=1 to train with Paddle's numbers as they are")
    if support.backward_crashes:
        raise ValueError(
            f"device {device!r} runs on the CPU, which cannot train {what} here: Paddle's PIR bfloat16 matmul "
            f"backward kills the process on this CPU ({cpu_model()}), probe: {support.reason!r}. Train in float32, "
            "build the program in the legacy IR for bfloat16 on CPU (staticpipe.use_legacy_ir() before building, "
            "or STATICPIPE_LEGACY_IR=1; README \"PIR programs\"), or put this stage on a GPU")
    raise ValueError(
        f"device {device!r} runs on the CPU, which cannot run {what} here: Paddle's oneDNN has no bfloat16 matmul "
        f"on this CPU ({cpu_model()}; flags: {', '.join(cpu_flags()) or 'none of ' + ', '.join(FLAGS)}"
        f"{'; ONEDNN_MAX_CPU_ISA=' + os.environ['ONEDNN_MAX_CPU_ISA'] if os.environ.get('ONEDNN_MAX_CPU_ISA') else ''}"
        f"), probe: {support.reason!r}. bfloat16 on CPU needs AVX-512 or AMX. Train in float32, or with float16 "
        "loss scaling (paddle.static.amp.decorate(optimizer), O1: the scaling runs, in float32 on CPU), or put "
        "this stage on a GPU")


def wrong_bf16_allowed() -> bool:
    """``STATICPIPE_ALLOW_WRONG_BF16`` set to 1 (or true, yes, on): bfloat16 that runs wrong is trained."""
    return os.environ.get(WRONG_BF16_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def cpu_model() -> str:
    return _cpuinfo().get("model name", "unknown CPU")


def cpu_flags() -> list[str]:
    """Of ``FLAGS``, those this CPU reports (Linux's /proc/cpuinfo; none elsewhere)."""
    have = set(_cpuinfo().get("flags", "").split())
    return [f for f in FLAGS if f in have]


def _cpuinfo() -> dict[str, str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def describe() -> str:
    """One line: the CPU, its cores, the flags that matter, oneDNN's cap, and whether bf16 runs here."""
    support = cpu_bf16()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    with _static_mode():
        ir = "PIR" if pir_mode() else "legacy IR"
    flags = " ".join(cpu_flags()) or "none of " + " ".join(FLAGS)
    return (f"CPU: {cpu_model()}, {os.cpu_count()} cores, flags: {flags}"
            f"{f', ONEDNN_MAX_CPU_ISA={cap}' if cap else ''}; Paddle {paddle.__version__} "
            f"({ir}): bfloat16 on CPU "
            + _verdict(support))


def _verdict(support: Bf16Support) -> str:
    if not support.ok:
        return f"does not run ({support.reason})"
    if not support.wrong:
        return "runs"
    allowed = f", trained as {WRONG_BF16_ENV}=1 allows" if wrong_bf16_allowed() else ""
    return f"runs but is wrong here ({support.wrong}{allowed})"
