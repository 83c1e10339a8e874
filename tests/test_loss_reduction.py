"""A loss that sums the batch trains as one device does: the micro-batches' gradients and losses are added,
not averaged (rewrite/loss.py); a loss that is neither a batch mean nor a batch sum is refused at minimize;
``loss_reduction="mean"`` keeps Paddle's averaging whatever the loss."""
from __future__ import annotations

import contextlib

import pytest

import staticpipe
from pipeline_util import launch_script
from staticpipe._paddle import PADDLE_MAJOR, np, paddle

pytestmark = pytest.mark.timeout(120)
M, BATCH = 4, 16

LOSSES = {  # name -> the loss of per-sample cross entropies ``ce`` [B, 1] and a batch-free term ``reg``
    "mean": lambda ce, reg: paddle.mean(ce),
    "sum": lambda ce, reg: paddle.sum(ce),
    "half sum": lambda ce, reg: paddle.sum(ce) * 0.5,
    "sum reduction": None,  # cross_entropy(..., reduction="sum")
    "mean plus regulariser": lambda ce, reg: paddle.mean(ce) + 0.01 * reg,
    "sum over the batch of means": lambda ce, reg: paddle.sum(paddle.mean(ce, axis=1)),
}


def network(loss_name: str, pipelined: bool, **pipeline):
    guard = staticpipe.device_guard if pipelined else (lambda device: contextlib.nullcontext())
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 3
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        with guard("gpu:0"):
            x = paddle.static.data("x", [-1, 6], "float32")
            h = paddle.static.nn.fc(x, 8, activation="tanh")
        with guard("gpu:1"):
            y = paddle.static.data("y", [-1, 1], "int64")
            logits = paddle.static.nn.fc(h, 3)
            if loss_name == "sum reduction":
                loss = paddle.nn.functional.cross_entropy(logits, y, reduction="sum")
            else:
                ce = paddle.nn.functional.cross_entropy(logits, y, reduction="none")
                reg = paddle.sum(paddle.square(main.global_block().all_parameters()[-1]))  # a batch-free term
                loss = LOSSES[loss_name](ce, reg)
        opt = paddle.optimizer.Momentum(0.05, momentum=0.9)
        if pipelined:
            opt = staticpipe.PipelineOptimizer(opt, num_microbatches=M, **pipeline)
        opt.minimize(loss)
    return main, startup, loss


def batches(steps=3):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((BATCH, 6)).astype(np.float32),
             "y": rng.integers(0, 3, (BATCH, 1)).astype(np.int64)} for _ in range(steps)]


def reference(loss_name: str):
    """One device (Paddle's executor): (parameter names, initial values, losses, final values)."""
    ref_main, ref_startup, ref_loss = network(loss_name, False)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(ref_startup, scope=scope)
    names = [p.name for p in ref_main.global_block().all_parameters()]
    initial = [np.array(scope.find_var(n).get_tensor()) for n in names]
    losses = [float(exe.run(ref_main, feed=batch, fetch_list=[ref_loss], scope=scope)[0]) for batch in batches()]
    return names, initial, losses, {n: np.array(scope.find_var(n).get_tensor()) for n in names}


def pipelined(loss_name: str, initial: list, **pipeline):
    """The pipeline from ``initial`` (by parameter position: PIR's fc names go on counting in a second
    program, unique_name.guard resets none): (losses, final values by position, plan)."""
    main, startup, loss = network(loss_name, True, **pipeline)
    mine = [p.name for p in main.global_block().all_parameters()]
    pipe = staticpipe.Executor()
    pipe.run(startup)
    pipe.set_state_dict(main, dict(zip(mine, initial)))
    losses = []
    for batch in batches():
        [value] = pipe.run(main, feed=batch, fetch_list=[loss])
        losses.append(np.nan if value is None else float(value))  # None: another process's stage has it
    state = pipe.state_dict(main)
    pipe.close()
    return losses, [state.get(m) for m in mine], staticpipe.plan_of(main)


def train(loss_name: str, **pipeline):
    """(one device's losses and parameters, the pipeline's), from the same start on the same batches."""
    names, initial, ref_losses, ref = reference(loss_name)
    losses, final, plan = pipelined(loss_name, initial, **pipeline)
    return (ref_losses, ref), (losses, dict(zip(names, final))), plan


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
@pytest.mark.parametrize("schedule", ["1F1B", "ZB-H1"])
def test_every_batch_reduction_trains_and_fetches_like_one_device(loss_name, schedule):
    (ref_losses, ref), (losses, got), plan = train(loss_name, schedule=schedule)
    assert plan.loss_reduction == ("mean" if "mean" in loss_name.split()[0] else "sum")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_paddles_averaging_on_request_equals_one_device_at_a_1_over_m_learning_rate():
    """loss_reduction="mean" (Paddle's pipeline): a sum's micro-batches averaged, a sum's loss the mean of
    the micro-batch sums, so a step is one device's at lr / M."""
    (_, _), (losses, got), plan = train("sum", loss_reduction="mean")
    assert plan.loss_reduction == "mean"
    (ref_losses, ref), _, _ = train("sum")
    np.testing.assert_allclose(losses[0], ref_losses[0] / M, rtol=1e-5)
    assert not all(np.allclose(got[n], ref[n], rtol=1e-4) for n in ref)


@pytest.mark.parametrize("make,op", [
    (lambda ce, reg: paddle.max(ce), "reduce_max"),
    (lambda ce, reg: paddle.square(paddle.mean(ce)), "square"),
    (lambda ce, reg: paddle.sum(ce) + reg, "elementwise_add"),
])
def test_a_loss_that_is_neither_a_mean_nor_a_sum_is_refused_naming_its_op(monkeypatch, make, op):
    monkeypatch.setitem(LOSSES, "odd", make)
    with pytest.raises(ValueError, match=rf"^the loss is neither a batch mean nor a batch sum: op '{op}' \("):
        network("odd", True)
    with pytest.raises(ValueError, match=r"pass loss_reduction='mean' to average the micro-batches' gradients"):
        network("odd", True)
    network("odd", True, loss_reduction="mean")  # Paddle's averaging, on request


@pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")
def test_a_sum_reduced_pir_loss_trains_like_one_device():
    with paddle.pir_utils.IrGuard():
        (ref_losses, ref), (losses, got), plan = train("sum")
    assert plan.loss_reduction == "sum"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


LAUNCHED = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import faulthandler; faulthandler.enable()
import numpy as np
from staticpipe._paddle import paddle
paddle.enable_static()
import test_loss_reduction as t
initial = list(np.load(os.path.join({out!r}, "initial.npz")).values())
losses, final, _ = t.pipelined("sum", initial, dp_degree=2)
rank = os.environ["PADDLE_TRAINER_ID"]
np.savez(os.path.join({out!r}, f"got_{{rank}}.npz"), *[v for v in final if v is not None])
np.save(os.path.join({out!r}, f"mine_{{rank}}.npy"), np.array([v is not None for v in final]))
np.save(os.path.join({out!r}, f"losses_{{rank}}.npy"), np.array(losses))
"""


def test_a_sum_reduced_loss_adds_the_replicas_gradients_and_losses(tmp_path):
    """2 replicas x 2 stages (4 processes): the global batch's sum, as on one device (computed here, once)."""
    names, initial, ref_losses, ref = reference("sum")
    np.savez(tmp_path / "initial.npz", *initial)
    launch_script(tmp_path, LAUNCHED, 4)
    got = [None] * len(names)
    for rank in (0, 1):  # replica 0's two stages hold every parameter between them
        mine = np.load(tmp_path / f"mine_{rank}.npy")
        values = iter(np.load(tmp_path / f"got_{rank}.npz").values())
        for k in np.flatnonzero(mine):
            got[k] = next(values)
    for name, value in zip(names, got):
        np.testing.assert_allclose(value, ref[name], rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(np.load(tmp_path / "losses_1.npy"), ref_losses, rtol=1e-5)  # replica 0's last stage
