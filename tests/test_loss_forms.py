"""Loss forms read by their data flow, not their last op (rewrite/loss.py): every composition of means and
sums over any axes of per-token losses [batch, seq, 1] trains exactly as one device does, or is refused at
minimize naming the op at fault; fetched values of those forms come back as one device computes them."""
from __future__ import annotations

import contextlib
import re

import pytest

import staticpipe
from models.network import Network, fresh_names
from pipeline_util import assert_same_training, train_twins
from staticpipe._paddle import np, paddle
from staticpipe.ir import var_names

pytestmark = pytest.mark.timeout(300)
SEQ, M = 3, 4

# name -> (the loss of per-token cross entropies ce [B, SEQ, 1] and a batch-free term reg, how it reduces)
FORMS = {
    "sum of the batch mean": (lambda ce, reg: paddle.sum(paddle.mean(ce, axis=0)), "mean"),
    "mean of the whole sum": (lambda ce, reg: paddle.mean(paddle.sum(ce)), "sum"),
    "mean of the batch sum": (lambda ce, reg: paddle.mean(paddle.sum(ce, axis=0)), "sum"),
    "mean": (lambda ce, reg: paddle.mean(ce), "mean"),
    "sum": (lambda ce, reg: paddle.sum(ce), "sum"),
    "sum over the batch of per-sample means": (lambda ce, reg: paddle.sum(paddle.mean(ce, axis=[1, 2])), "sum"),
    "mean over the batch of per-sample sums": (lambda ce, reg: paddle.mean(paddle.sum(ce, axis=[1, 2])), "mean"),
    "mean of sums over tokens": (lambda ce, reg: paddle.mean(paddle.sum(ce, axis=1)), "mean"),
    "sum of token means, scaled": (lambda ce, reg: paddle.sum(paddle.mean(ce, axis=1)) / 4.0, "sum"),
    "sum over tokens of the batch mean": (lambda ce, reg: paddle.sum(paddle.mean(paddle.mean(ce, axis=-1), axis=0)),
                                          "mean"),
    "batch sum, then mean over tokens": (lambda ce, reg: paddle.sum(paddle.mean(paddle.sum(ce, axis=0), axis=0)),
                                         "sum"),
    "mean over a transposed batch axis": (
        lambda ce, reg: paddle.sum(paddle.mean(paddle.transpose(ce, [1, 0, 2]), axis=1)), "mean"),
    "sum over a transposed batch axis": (
        lambda ce, reg: paddle.mean(paddle.sum(paddle.transpose(ce, [1, 0, 2]), axis=1)), "sum"),
    "mean of the flattened tokens": (lambda ce, reg: paddle.mean(paddle.reshape(ce, [-1])), "mean"),
    "sum of the flattened tokens, doubled": (lambda ce, reg: paddle.sum(paddle.reshape(ce, [-1, 1]) * 2.0), "sum"),
    "token means kept as a dim, summed": (
        lambda ce, reg: paddle.sum(paddle.mean(paddle.squeeze(ce, -1), axis=1, keepdim=True)), "sum"),
    "per-token weights": (lambda ce, reg: paddle.sum(ce * paddle.exp(-paddle.square(ce))), "sum"),
    "tokens weighted by a size from the shape": (
        lambda ce, reg: paddle.sum(ce * paddle.cast(paddle.shape(ce)[1], "float32")), "sum"),
    "mean of the worst token of each sample": (lambda ce, reg: paddle.mean(paddle.max(ce, axis=1)), "mean"),
    "means combined, with a regulariser": (
        lambda ce, reg: 3.0 * paddle.mean(ce) - 0.5 * paddle.sum(paddle.mean(ce, axis=0)) + 0.01 * reg, "mean"),
}

# name -> (the loss, the op at fault on the legacy IR and on PIR, the reason given)
REFUSED = {
    "a batch sum plus a regulariser": (lambda ce, reg: paddle.sum(ce) + reg, ("elementwise_add", "add"),
                                       "it adds terms of kinds ['constant', 'sum']"),
    "centred per-token losses": (lambda ce, reg: paddle.mean(ce - paddle.mean(ce)), ("elementwise_sub", "subtract"),
                                 "it adds per-sample values to a value of the whole batch"),
    "a weighted mean": (lambda ce, reg: paddle.sum(ce * paddle.exp(-ce)) / paddle.sum(paddle.exp(-ce)),
                        ("elementwise_div", "divide"), "both of its operands depend on the batch"),
    "the worst sample": (lambda ce, reg: paddle.max(paddle.mean(ce, axis=1)), ("reduce_max", "max"),
                         "it takes the batch's maximum"),
    "the worst token of the batch mean": (lambda ce, reg: paddle.max(paddle.mean(ce, axis=0)), ("reduce_max", "max"),
                                          "it takes the max of a batch mean"),
    "a batch sum plus one": (lambda ce, reg: paddle.scale(paddle.sum(ce), 2.0, 1.0), ("scale", "scale"),
                             "it adds a constant to a batch sum"),
    "a sum over the micro-batch's size": (
        lambda ce, reg: paddle.sum(ce) / paddle.cast(paddle.shape(ce)[0], "float32"), ("elementwise_div", "divide"),
        "it combines a value of the whole batch with one computed from the shape of the batch's values"),
    "losses times their mean": (lambda ce, reg: paddle.sum(ce * paddle.mean(ce)), ("elementwise_mul", "multiply"),
                                "it multiplies per-sample values by a value of the whole batch"),
}


def per_token_net(make_loss, guarded: bool = True, metrics=None) -> Network:
    """Tokens [B, SEQ, 6] -> fc + tanh on gpu:0 -> fc logits [B, SEQ, 3] and per-token cross entropies on
    gpu:1, the loss ``make_loss(ce, reg)`` (reg: the squared norm of the last weight); ``metrics``: name ->
    a value of ``ce`` to fetch beside it (in ``outputs``)."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 5

    def on(device):
        return staticpipe.device_guard(device) if guarded else contextlib.nullcontext()

    with paddle.static.program_guard(main, startup), fresh_names():
        with on("gpu:0"):
            x = paddle.static.data("x", [None, SEQ, 6], "float32")
            h = paddle.static.nn.fc(x, 8, num_flatten_dims=2, activation="tanh")
        with on("gpu:1"):
            y = paddle.static.data("y", [None, SEQ, 1], "int64")
            logits = paddle.static.nn.fc(h, 3, num_flatten_dims=2)
            ce = paddle.nn.functional.cross_entropy(logits, y, reduction="none")
            reg = paddle.sum(paddle.square(main.global_block().all_parameters()[-1]))
            loss = make_loss(ce, reg)
            outputs = {"logits": logits, **{n: f(ce) for n, f in (metrics or {}).items()}}
    return Network(main, startup, [x, y], loss, outputs, ["gpu:0", "gpu:1"] if guarded else [])


@pytest.mark.parametrize("schedule", ["1F1B", "ZB-H1"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_loss_form_trains_like_one_device(program_ir, form, schedule):
    make, kind = FORMS[form]
    twin = train_twins(lambda guarded=True: per_token_net(make, guarded), lambda: paddle.optimizer.SGD(0.2),
                       steps=2, batch_size=8, num_microbatches=M, schedule=schedule)
    assert twin.plan.loss_reduction == kind
    assert_same_training(twin)


@pytest.mark.parametrize("form", sorted(REFUSED))
def test_a_loss_form_that_is_neither_is_refused_at_minimize_naming_the_op(program_ir, form):
    make, ops, reason = REFUSED[form]
    net = per_token_net(make)
    op = ops[program_ir == "pir"]
    with pytest.raises(ValueError, match=rf"^the loss is neither a batch mean nor a batch sum: op '{op}' \(.*"
                                         rf"\) makes it so, {re.escape(reason)}.*loss_reduction='mean'"):
        with paddle.static.program_guard(net.main, net.startup):
            staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=M).minimize(net.loss)


METRICS = {  # name -> (a value of ce fetched beside a mean loss, how the micro-batches' values combine)
    "sum of the batch mean": (lambda ce: paddle.sum(paddle.mean(ce, axis=0)), "mean"),
    "mean of the whole sum": (lambda ce: paddle.mean(paddle.sum(ce)), "sum"),
    "mean of the batch sum": (lambda ce: paddle.mean(paddle.sum(ce, axis=0)), "sum"),
    "per-token batch mean": (lambda ce: paddle.mean(ce, axis=0), "mean"),
    "per-token batch sum": (lambda ce: paddle.sum(ce, axis=0), "sum"),
    "worst sample's mean": (lambda ce: paddle.max(paddle.mean(ce, axis=[1, 2])), "max"),
    "the batch mean squared": (lambda ce: paddle.square(paddle.mean(ce)), "each"),
}


def test_fetched_values_of_every_form_come_back_as_one_device_computes_them(program_ir):
    metrics = {n: f for n, (f, _) in METRICS.items()}
    built = {guarded: per_token_net(lambda ce, reg: paddle.mean(ce), guarded, metrics) for guarded in (False, True)}
    ref, pipe = built[False], built[True]
    with paddle.static.program_guard(pipe.main, pipe.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=M).minimize(pipe.loss)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        exe.run(ref.startup)
        batch = ref.random_batch(8)
        want = exe.run(ref.main, feed=batch, fetch_list=[ref.outputs[n] for n in METRICS])
    names = [p.name for p in ref.main.global_block().all_parameters()]
    runner = staticpipe.Executor()
    runner.run(pipe.startup)
    runner.set_state_dict(pipe.main, {n: np.array(scope.find_var(n).get_tensor()) for n in names})
    got = runner.run(pipe.main, feed=batch, fetch_list=[pipe.outputs[n] for n in METRICS])
    plan = staticpipe.plan_of(pipe.main)
    runner.close()
    fetched = var_names([pipe.outputs[n] for n in METRICS], pipe.main)
    assert {n: plan.reduction(v) for n, v in zip(METRICS, fetched)} == {n: kind for n, (_, kind) in METRICS.items()}
    for name, value, expected in zip(METRICS, got, want):
        if METRICS[name][1] == "each":  # per micro-batch, as Paddle's pipeline hands out every fetched value
            assert isinstance(value, list) and len(value) == M, name
            continue
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("option", [{"ignore_index": 0}, {"weight": True}])
def test_cross_entropys_ratio_is_refused_naming_where_it_begins_and_the_loss(program_ir, option):
    """cross_entropy's mean with weight or ignore_index divides a sum by a count of the batch: refused, naming
    the first op at fault and the op that makes the loss; Paddle's averaging (loss_reduction="mean") takes it."""
    def build():
        net = per_token_net(lambda ce, reg: ce)  # its loss left aside: cross_entropy's own mean is the loss
        with paddle.static.program_guard(net.main, net.startup), staticpipe.device_guard("gpu:1"):
            kw = {"weight": paddle.full([3], 2.0)} if "weight" in option else option
            loss = paddle.nn.functional.cross_entropy(net.outputs["logits"], net.feeds[1], **kw)
        return net, loss

    net, loss = build()
    divide = "elementwise_div" if program_ir == "legacy" else "divide"
    with pytest.raises(ValueError, match=rf"^the loss is neither a batch mean nor a batch sum: op 'equal' \(.*\) makes "
                                         rf"it so, it is not a mean or a sum over the batch \(the loss, made by op "
                                         rf"'{divide}' -> .*, depends on it\)\..*trains a ratio such as cross_entropy's"):
        with paddle.static.program_guard(net.main, net.startup):
            staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=M).minimize(loss)
    net, loss = build()
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=M, loss_reduction="mean").minimize(loss)
    assert staticpipe.plan_of(net.main).loss_reduction == "mean"
