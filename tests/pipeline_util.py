"""Shared by the runtime tests: train a pipelined network and its unguarded twin side by side."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import staticpipe
from staticpipe._paddle import np, paddle


@dataclass
class Twin:
    ref_losses: list[float]
    pipe_losses: list[float]
    ref_params: dict[str, np.ndarray]
    pipe_params: dict[str, np.ndarray]


def minimize(net, optimizer, pipeline: dict | None):
    """Apply ``optimizer`` (wrapped in a PipelineOptimizer when ``pipeline`` gives its options); fresh
    unique names, so that twins built in one process name their optimizer state alike."""
    with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
        if pipeline is not None:
            optimizer = staticpipe.PipelineOptimizer(optimizer, **pipeline)
        optimizer.minimize(net.loss)
    return optimizer


def train_twins(builder: Callable, make_opt: Callable, steps: int = 3, batch_size: int = 16,
                same_batch: bool = False, **pipeline) -> Twin:
    """Train ``builder(guarded=False)`` on one device and ``builder()`` as a pipeline from the same
    initial parameters on the same batches (one batch per step, or the same one every step); return both
    runs' losses and final parameters."""
    ref, pipe = builder(guarded=False), builder()
    minimize(ref, make_opt(), None)
    minimize(pipe, make_opt(), pipeline)
    ref_exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    ref_exe.run(ref.startup, scope=scope)
    names = [p.name for p in ref.main.all_parameters()]
    exe = staticpipe.Executor()
    exe.run(pipe.startup)
    exe.set_state_dict(pipe.main, {n: np.array(scope.find_var(n).get_tensor()) for n in names})
    ref_losses, pipe_losses = [], []
    for step in range(steps):
        batch = ref.random_batch(batch_size, seed=0 if same_batch else step)
        ref_losses.append(float(ref_exe.run(ref.main, feed=batch, fetch_list=[ref.loss], scope=scope)[0]))
        pipe_losses.append(float(exe.run(pipe.main, feed=batch, fetch_list=[pipe.loss])[0]))
        for program in (ref.main, pipe.main):  # learning-rate schedules advance once per global step
            if hasattr(program, "lr_scheduler"):
                program.lr_scheduler.step()
    state = exe.state_dict(pipe.main)
    exe.close()
    return Twin(ref_losses, pipe_losses, {n: np.array(scope.find_var(n).get_tensor()) for n in names},
                {n: state[n] for n in names})


def assert_same_training(twin: Twin, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(twin.pipe_losses, twin.ref_losses, rtol=rtol)
    assert twin.pipe_params.keys() == twin.ref_params.keys()
    for name, ref in twin.ref_params.items():
        np.testing.assert_allclose(twin.pipe_params[name], ref, rtol=rtol, atol=atol, err_msg=name)


def assert_adam_family_training(twin: Twin, lr: float, steps: int) -> None:
    """Adam divides each update by sqrt(v) + eps. Where a coordinate's gradient is as small as the
    float32 rounding of summing micro-batches (~1e-8, the size of eps; a key projection's bias has an
    exactly-zero true gradient: 128 of the test GPT's 53,440 coordinates), the two runs' rounding noise
    becomes updates of up to lr. So at most 0.5 % of coordinates may differ, by at most lr per step;
    every loss matches to rtol 1e-5."""
    np.testing.assert_allclose(twin.pipe_losses, twin.ref_losses, rtol=1e-5)
    off = total = 0
    for name, ref in twin.ref_params.items():
        got = twin.pipe_params[name]
        off += int((~np.isclose(got, ref, rtol=1e-5, atol=1e-6)).sum())
        total += ref.size
        assert np.max(np.abs(got - ref)) <= steps * lr, name
    assert off <= total // 200, f"{off} of {total} coordinates differ"
