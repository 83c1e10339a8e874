"""The contract every model builder returns, and the one helper that builds all of them.

Why one helper: the parts that make a model usable for pipeline tests — the fresh programs, the name
and seed discipline that lets a guarded build match its unguarded reference parameter for parameter,
the stage guards, the feeds, the loss and the accuracy — are the same for every model. Builders only
describe their layers as a list of blocks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Sequence

from staticpipe import device_guard, split_point  # first: importing staticpipe settles Paddle's IR flag
import numpy as np
import paddle

Variable = paddle.static.Variable
Block = Callable[[Variable], Variable]
"""One layer group: takes the previous activation and returns the next; creates its own parameters."""

_READER_CHUNK = 256  # samples drawn per numpy call by sample_reader; bounds its memory


def stage_of(layer_index: int, num_layers: int, num_stages: int) -> int:
    """The stage of layer ``layer_index`` when ``num_layers`` layers form ``num_stages`` contiguous groups.

    Group sizes differ by at most one and the larger groups come first (10 layers over 3 stages: 4, 3, 3),
    so the first stage, which also waits longest in a pipeline's warm-up, is never the lighter one.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be between 1 and the number of layers ({num_layers}), got {num_stages}")
    if not 0 <= layer_index < num_layers:
        raise ValueError(f"layer_index must be in [0, {num_layers}), got {layer_index}")
    base, extra = divmod(num_layers, num_stages)
    big = extra * (base + 1)  # layers held by the first `extra` stages, one more each
    if layer_index < big:
        return layer_index // (base + 1)
    return extra + (layer_index - big) // base


@dataclass
class Network:
    """A built forward network: programs, feeds, loss and the devices of its stages.

    Synthetic data: a feed named in ``value_ranges`` draws integers uniform in ``[low, high)``, cast to
    its dtype (token ids, embedding ids, 0/1 click labels stored as floats); any other integer feed is a
    class label uniform below the width of ``outputs["logits"]``; any other float feed is standard normal.
    """

    main: paddle.static.Program
    startup: paddle.static.Program
    feeds: list
    loss: Variable
    outputs: dict
    devices: list
    value_ranges: dict = field(default_factory=dict)  # feed name -> (low, high) of its integer values

    def random_batch(self, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
        """A batch of synthetic data for ``feeds``: normal floats, integers as the class docstring says.

        The first ``batch_size`` samples of ``sample_reader(n, seed)`` are exactly this batch, so a
        DataLoader-fed run and a feed-dict run can be compared.
        """
        return self._draw(self._rngs(seed), batch_size)

    def sample_reader(self, num_samples: int, seed: int = 0) -> Callable[[], Iterator[tuple]]:
        """A per-sample generator factory for ``DataLoader.set_sample_generator``; every call replays
        the same ``num_samples`` samples, drawn in chunks so memory does not grow with ``num_samples``."""

        def reader() -> Iterator[tuple]:
            rngs = self._rngs(seed)
            for start in range(0, num_samples, _READER_CHUNK):
                chunk = self._draw(rngs, min(_READER_CHUNK, num_samples - start))
                yield from zip(*chunk.values())

        return reader

    def _rngs(self, seed: int) -> list[np.random.Generator]:
        # One stream per feed: chunked draws then equal one large draw, whatever the chunk size.
        return [np.random.default_rng([seed, i]) for i in range(len(self.feeds))]

    def _draw(self, rngs: list[np.random.Generator], n: int) -> dict[str, np.ndarray]:
        batch = {}
        for var, rng in zip(self.feeds, rngs):
            shape = (n, *var.shape[1:])
            dtype = np.dtype(paddle.base.data_feeder.convert_dtype(var.dtype))
            if var.name in self.value_ranges:
                low, high = self.value_ranges[var.name]
                batch[var.name] = rng.integers(low, high, size=shape, dtype=np.int64).astype(dtype, copy=False)
            elif np.issubdtype(dtype, np.integer):
                batch[var.name] = rng.integers(0, self.outputs["logits"].shape[-1], size=shape, dtype=dtype)
            else:
                batch[var.name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
        return batch


@contextlib.contextmanager
def fresh_names() -> Iterator[None]:
    """Parameter and layer names counted from 0 for this build, on either IR, so that every build of a
    model names its parameters alike (a guarded build and its reference, a legacy and a PIR build).

    Why more than ``unique_name.guard()``: building a PIR program, Paddle's layer helpers (``static.nn.fc``,
    ``static.create_parameter``) take names from the *legacy* default program's own generator, which no
    guard resets: a second build named its layers fc_5, fc_6, ... where the first had fc_0, fc_1."""
    if not paddle.framework.in_pir_mode():  # a legacy program names its layers from a generator of its own
        with paddle.utils.unique_name.guard():
            yield
        return
    legacy = paddle.base.framework.default_main_program()
    before, legacy._name_generator = legacy._name_generator, paddle.base.unique_name.UniqueNameGenerator()
    try:
        with paddle.utils.unique_name.guard():
            yield
    finally:
        legacy._name_generator = before


def _on_device(device: str, guarded: bool) -> ContextManager:
    """``device_guard(device)`` when ``guarded``, else nothing: the unguarded reference has no devices."""
    return device_guard(device) if guarded else contextlib.nullcontext()


def _on_stage(stage: int, guarded: bool) -> ContextManager:
    return _on_device(f"gpu:{stage}", guarded)


def _distinct_init_seeds(startup: paddle.static.Program, seed: int) -> None:
    """Give each random initializer op its own seed derived from ``seed``.

    Why: Paddle seeds every initializer with ``startup.random_seed`` itself, so all parameters of one
    shape would start equal (every hidden layer of an MLP the same matrix). Seeds follow op order, which
    is parameter creation order, so a guarded build and its unguarded reference still agree.
    """
    ops = [op for op in startup.global_block().ops if op.has_attr("seed")]
    seeds = np.random.default_rng(seed).integers(1, 2**31 - 1, size=len(ops))
    for op, op_seed in zip(ops, seeds):
        if hasattr(op, "_set_attr"):
            op._set_attr("seed", int(op_seed))
        else:  # a PIR op
            op.set_int_attr("seed", int(op_seed))


def build_classifier(
    blocks: Sequence[Block],
    input_shape: Sequence[int],
    num_stages: int,
    guarded: bool = True,
    seed: int = 1,
    input_name: str = "image",
    stage_devices: Sequence[str] | None = None,
) -> Network:
    """Chain ``blocks`` into a classifier and close it with a cross-entropy loss and an accuracy.

    Block i runs on stage ``stage_of(i, len(blocks), num_stages)``; the input is created on stage 0
    and the label, loss and accuracy on the last stage. With ``guarded=False`` the same ops and
    parameters are built with no device guard at all. ``stage_devices`` names each stage's device
    (default "gpu:k" for stage k); a device may come back, e.g. ["gpu:0", "gpu:1", "gpu:0", "gpu:1"]
    for an interleaved schedule's chunks.
    """
    stages = [stage_of(i, len(blocks), num_stages) for i in range(len(blocks))]
    devices = list(stage_devices) if stage_devices is not None else [f"gpu:{k}" for k in range(num_stages)]
    if len(devices) != num_stages:
        raise ValueError(f"stage_devices names {len(devices)} devices for num_stages={num_stages}")
    paddle.enable_static()  # builders may be the first static-mode code a caller runs
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = seed
    with paddle.static.program_guard(main, startup), fresh_names():
        with _on_device(devices[0], guarded):
            x = features = paddle.static.data(input_name, [None, *input_shape], "float32")
        for k, (block, stage) in enumerate(zip(blocks, stages)):
            if guarded and k and stage != stages[k - 1]:
                split_point()  # two stages may share a device (ZB-V's V layout)
            with _on_device(devices[stage], guarded):
                x = block(x)
        with _on_device(devices[-1], guarded):
            label = paddle.static.data("label", [None, 1], "int64")
            loss = paddle.mean(paddle.nn.functional.cross_entropy(x, label, reduction="none"))
            # After the loss, so the loss's ops are the same with or without this output.
            accuracy = paddle.static.accuracy(x, label)
    _distinct_init_seeds(startup, seed)
    return Network(
        main=main,
        startup=startup,
        feeds=[features, label],
        loss=loss,
        outputs={"logits": x, "accuracy": accuracy},
        devices=devices if guarded else [],
    )
