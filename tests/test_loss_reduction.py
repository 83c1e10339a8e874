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
    def head(y, logits, main):
        if loss_name == "sum reduction":
            return paddle.nn.functional.cross_entropy(logits, y, reduction="sum")
        ce = paddle.nn.functional.cross_entropy(logits, y, reduction="none")
        reg = paddle.sum(paddle.square(main.global_block().all_parameters()[-1]))  # a batch-free term
        return LOSSES[loss_name](ce, reg)
    main, startup, loss = two_stages(head, pipelined, paddle.optimizer.Momentum(0.05, momentum=0.9), **pipeline)
    return main, startup, loss


def two_stages(head, pipelined: bool, optimizer, **pipeline):
    """x -> fc + tanh on gpu:0 -> fc (logits) on gpu:1, where ``head(y, logits, main)`` makes the loss
    (or a dict of values with the loss under "loss"); minimized, pipelined or on one device."""
    guard = staticpipe.device_guard if pipelined else (lambda device: contextlib.nullcontext())
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 3
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        with guard("gpu:0"):
            x = paddle.static.data("x", [-1, 6], "float32")
            h = paddle.static.nn.fc(x, 8, activation="tanh")
        with guard("gpu:1"):
            y = paddle.static.data("y", [-1, 1], "int64")
            made = head(y, paddle.static.nn.fc(h, 3), main)
        if not paddle.framework.in_pir_mode():
            made_for_test[id(main)] = main.clone(for_test=True)  # taken before minimize, for evaluate
        opt = staticpipe.PipelineOptimizer(optimizer, num_microbatches=M, **pipeline) if pipelined else optimizer
        opt.minimize(made["loss"] if isinstance(made, dict) else made)
    return main, startup, made


made_for_test: dict[int, object] = {}  # id(main) -> its evaluation clone


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
metrics, _, _ = t.metrics_pipelined(list(np.load(os.path.join({out!r}, "metrics_initial.npz")).values()), dp_degree=2)
if metrics[0] is not None:
    np.savez(os.path.join({out!r}, f"metrics_{{rank}}.npz"), *metrics[:-1])
"""


def test_a_sum_reduced_loss_adds_the_replicas_gradients_and_losses(tmp_path):
    """2 replicas x 2 stages (4 processes): the global batch's sum, as on one device (computed here, once);
    fetched metrics too (the replicas' sums added, means averaged, maxima and minima taken)."""
    names, initial, ref_losses, ref = reference("sum")
    np.savez(tmp_path / "initial.npz", *initial)
    metrics_initial, whole, _ = metrics_reference()
    np.savez(tmp_path / "metrics_initial.npz", *metrics_initial)
    launch_script(tmp_path, LAUNCHED, 4)
    for rank in (1, 3):  # the replicas' last stages: the global batch's sum, mean, max and min, on each
        for name, value, want in zip(METRICS, np.load(tmp_path / f"metrics_{rank}.npz").values(), whole):
            np.testing.assert_allclose(value, want, rtol=1e-5, err_msg=f"rank {rank}, {name}")
    got = [None] * len(names)
    for rank in (0, 1):  # replica 0's two stages hold every parameter between them
        mine = np.load(tmp_path / f"mine_{rank}.npy")
        values = iter(np.load(tmp_path / f"got_{rank}.npz").values())
        for k in np.flatnonzero(mine):
            got[k] = next(values)
    for name, value in zip(names, got):
        np.testing.assert_allclose(value, ref[name], rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(np.load(tmp_path / "losses_1.npy"), ref_losses, rtol=1e-5)  # replica 0's last stage


METRICS = ["correct", "accuracy", "accuracy op", "top", "low", "squared"]


def metrics_network(pipelined: bool, **pipeline):
    """The two-stage network with metrics of every kind on its last stage: (main, startup, values by name)."""
    def head(y, logits, main):
        ce = paddle.nn.functional.cross_entropy(logits, y, reduction="none")
        hits = paddle.cast(paddle.equal(paddle.argmax(logits, axis=1, keepdim=True), y), "float32")
        return {"loss": paddle.mean(ce), "correct": paddle.sum(hits), "accuracy": paddle.mean(hits),
                "accuracy op": paddle.static.accuracy(paddle.nn.functional.softmax(logits), y),
                "top": paddle.max(logits), "low": paddle.min(ce), "squared": paddle.mean(ce) * paddle.mean(ce), "ce": ce}
    return two_stages(head, pipelined, paddle.optimizer.SGD(0.1), **pipeline)


def metrics_reference():
    """One device on the first batch: (initial parameters, the metrics, the per-sample losses)."""
    main, startup, ref = metrics_network(False)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(startup, scope=scope)
    initial = [np.array(scope.find_var(p.name).get_tensor()) for p in main.global_block().all_parameters()]
    *whole, ce = exe.run(main, feed=batches(1)[0], fetch_list=[ref[n] for n in METRICS + ["ce"]], scope=scope)
    return initial, whole, ce


def metrics_pipelined(initial: list, **pipeline):
    """The pipeline's metrics on the first batch (None where another process has them), and its plan."""
    main, startup, mine = metrics_network(True, **pipeline)
    pipe = staticpipe.Executor()
    pipe.run(startup)
    pipe.set_state_dict(main, {p.name: v for p, v in zip(main.global_block().all_parameters(), initial)
                               if p.name in pipe.state_dict(main)})
    got = pipe.run(main, feed=batches(1)[0], fetch_list=[mine[n] for n in METRICS])
    pipe.close()
    return got, staticpipe.plan_of(main), mine


@pytest.mark.parametrize("ir", ["legacy"] + (["pir"] if PADDLE_MAJOR >= 3 else []))
def test_fetched_metrics_combine_by_what_they_are(ir):
    """A fetched value without the batch as dim 0 is put together by its reduction, as one device computes it
    on the whole batch: a batch sum added, a mean averaged, a max or min taken; anything else (the square of
    a mean) comes back as the list of its micro-batches' values, each as one device computes it there."""
    with paddle.pir_utils.IrGuard() if ir == "pir" else contextlib.nullcontext():
        initial, whole, ce = metrics_reference()
        got, plan, mine = metrics_pipelined(initial)
        if ir == "legacy":  # PIR values are named by the plan's view
            assert {n: plan.reductions[mine[n].name] for n in METRICS} == {
                "correct": "sum", "accuracy": "mean", "accuracy op": "mean", "top": "max", "low": "min",
                "squared": "each"}
    for name, value, want in zip(METRICS[:-1], got, whole):
        np.testing.assert_allclose(value, want, rtol=1e-5, err_msg=name)
    assert isinstance(got[-1], list) and len(got[-1]) == M
    for value, part in zip(got[-1], np.split(ce, M)):  # the square of each micro-batch's mean
        np.testing.assert_allclose(value, np.mean(part) ** 2, rtol=1e-5)


def test_evaluate_combines_an_epochs_metrics_by_what_they_are():
    """``Executor.evaluate`` over an epoch of batches of two sizes: sums added, means weighted by batch size,
    maxima and minima taken, as one device computes them on the whole epoch at once."""
    initial, _, _ = metrics_reference()
    main, startup, mine = metrics_network(True)
    evaluation = made_for_test[id(main)]
    pipe = staticpipe.Executor()
    pipe.run(startup)
    pipe.set_state_dict(main, {p.name: v for p, v in zip(main.global_block().all_parameters(), initial)})
    rng = np.random.default_rng(7)
    epoch = [{"x": rng.standard_normal((rows, 6)).astype(np.float32), "y": rng.integers(0, 3, (rows, 1))}
             for rows in (16, 16, 8)]

    class Epoch:
        def epoch(self):
            return iter(epoch)

    names = ["correct", "accuracy", "top", "low"]
    got = pipe.evaluate(evaluation, Epoch(), [evaluation.global_block().var(mine[n].name) for n in names],
                        num_microbatches=M, like=main)
    ref_main, ref_startup, ref = metrics_network(False)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(ref_startup, scope=scope)
    for p, value in zip(ref_main.global_block().all_parameters(), initial):
        scope.var(p.name).get_tensor().set(value, paddle.CPUPlace())
    whole = {k: np.concatenate([b[k] for b in epoch]) for k in ("x", "y")}
    want = exe.run(made_for_test[id(ref_main)], feed=whole, fetch_list=[ref[n].name for n in names], scope=scope)
    for name, value, expected in zip(names, got, want):
        np.testing.assert_allclose(value, expected, rtol=1e-5, err_msg=name)
    pipe.close()

