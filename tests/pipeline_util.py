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
