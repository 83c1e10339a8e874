"""Masked losses (docs/migrating.md, "Masked losses: when the pipeline equals the full batch"): a tiny
masked LM (embedding -> fc on gpu:0, fc -> per-token softmax_with_cross_entropy on gpu:1) trained one SGD
step on 4 micro-batches, against two one-device references: the whole global batch at once (the full
batch), and the mean of the micro-batches' gradients (Paddle's pipeline, and Paddle's gradient merge with
avg=True). The masked token counts of the micro-batches are equal or differ."""
from __future__ import annotations

import contextlib
import re

import pytest

import staticpipe
from staticpipe import fleet
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(120)
VOCAB, HIDDEN, SEQ, M, MICRO = 11, 8, 5, 4, 2
BATCH, LR = M * MICRO, 0.5
EQUAL, UNEQUAL = (5, 5, 5, 5), (1, 3, 7, 10)  # masked tokens per micro-batch (of MICRO x SEQ = 10)

FORMS = {  # name -> the loss of per-token losses ce [B, SEQ, 1] and the fed mask (or weights) [B, SEQ, 1]
    "ratio": lambda ce, mask: paddle.sum(ce * mask) / paddle.sum(mask),  # the masked LM loss
    "mean": lambda ce, mask: paddle.mean(ce * mask),
    "weighted sum": lambda ce, weight: paddle.sum(ce * weight),  # weight: the mask over the global batch's count
}


def build(form: str, how: str = "one device", **options):
    """(main, startup, loss) of ``form``, minimized with SGD: ``how`` is "one device" (Paddle, unguarded),
    "staticpipe" (``staticpipe.PipelineOptimizer(num_microbatches=M, **options)``), "fleet"
    (``staticpipe.fleet`` with strategy.pipeline, accumulate_steps M) or "merge" (one device, Paddle's
    ``GradientMergeOptimizer(k_steps=M, avg=True)``)."""
    pipelined = how in ("staticpipe", "fleet")
    on = staticpipe.device_guard if pipelined else (lambda device: contextlib.nullcontext())
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 7
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with on("gpu:0"):
            tokens = paddle.static.data("tokens", [-1, SEQ], "int64")
            h = paddle.nn.Embedding(VOCAB, HIDDEN)(tokens)
            h = paddle.static.nn.fc(h, HIDDEN, num_flatten_dims=2, activation="tanh")
        with on("gpu:1"):
            labels = paddle.static.data("labels", [-1, SEQ, 1], "int64")
            mask = paddle.static.data("mask", [-1, SEQ, 1], "float32")
            logits = paddle.static.nn.fc(h, VOCAB, num_flatten_dims=2)
            ce = paddle.nn.functional.softmax_with_cross_entropy(logits, labels)
            loss = FORMS[form](ce, mask)
        sgd = paddle.optimizer.SGD(LR)
        if how == "staticpipe":
            staticpipe.PipelineOptimizer(sgd, num_microbatches=M, **options).minimize(loss)
        elif how == "fleet":
            fleet.init(is_collective=True)
            strategy = fleet.DistributedStrategy()
            strategy.pipeline = True
            strategy.pipeline_configs = {"accumulate_steps": M, "micro_batch_size": MICRO}
            fleet.distributed_optimizer(sgd, strategy).minimize(loss)
        elif how == "merge":
            paddle.incubate.optimizer.GradientMergeOptimizer(sgd, k_steps=M, avg=True).minimize(loss)
        else:
            sgd.minimize(loss)
    return main, startup, loss


def batch(counts, seed: int = 0, weights: bool = False) -> dict:
    """A global batch of M micro-batches of MICRO samples, micro-batch k with counts[k] masked tokens in
    it; ``weights``: the mask divided by the global batch's masked token count."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((M, MICRO * SEQ), np.float32)
    for k, count in enumerate(counts):
        mask[k, rng.permutation(MICRO * SEQ)[:count]] = 1
    mask = mask.reshape(BATCH, SEQ, 1)
    return {"tokens": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64),
            "labels": rng.integers(0, VOCAB, (BATCH, SEQ, 1)).astype(np.int64),
            "mask": mask / mask.sum() if weights else mask}


def micro_batches(feed: dict) -> list[dict]:
    return [{k: v[i * MICRO:(i + 1) * MICRO] for k, v in feed.items()} for i in range(M)]


def initial_state() -> list[np.ndarray]:
    """The one-device program's initial parameters, in program order (PIR's names go on counting from one
    program to the next: parameters are matched by position)."""
    main, startup, _ = build("ratio")
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(startup, scope=scope)
    return [np.array(scope.find_var(p.name).get_tensor()) for p in main.global_block().all_parameters()]


def one_device(form: str, feeds: list[dict], initial: list, how: str = "one device",
               losses: list | None = None) -> list[np.ndarray]:
    """The parameters after running the one-device program of ``form`` on each of ``feeds`` from ``initial``
    (the fetched losses appended to ``losses``)."""
    main, startup, loss = build(form, how)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(startup, scope=scope)
    names = [p.name for p in main.global_block().all_parameters()]
    for name, value in zip(names, initial):
        scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
    for feed in feeds:
        [value] = exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
        if losses is not None:
            losses.append(float(value))
    return [np.array(scope.find_var(n).get_tensor()) for n in names]


def full_batch(form: str, feed: dict, initial: list, losses: list | None = None) -> list[np.ndarray]:
    """(a) One device, one SGD step on the whole global batch."""
    return one_device(form, [feed], initial, losses=losses)


def micro_batch_mean(form: str, feed: dict, initial: list) -> list[np.ndarray]:
    """(b) One device, one SGD step on the mean of the micro-batches' gradients (each micro-batch's step
    from ``initial``, the steps averaged: SGD's update is linear in the gradient)."""
    steps = [one_device(form, [micro], initial) for micro in micro_batches(feed)]
    return [p + np.mean([s[i] - p for s in steps], axis=0) for i, p in enumerate(initial)]


def pipelined(form: str, how: str, feed: dict, initial: list, **options) -> tuple[list[np.ndarray], str, float]:
    """(c) "fleet" or (d) "staticpipe": the parameters after one pipelined step, the plan's loss reduction
    and the fetched loss."""
    main, startup, loss = build(form, how, **options)
    mine = [p.name for p in main.global_block().all_parameters()]
    exe = staticpipe.Executor()
    try:
        exe.run(startup)
        exe.set_state_dict(main, dict(zip(mine, initial)))
        [value] = exe.run(main, feed=feed, fetch_list=[loss])
        state = exe.state_dict(main)
    finally:
        exe.close()
    return [state[n] for n in mine], staticpipe.plan_of(main).loss_reduction, float(value)


def difference(got: list, want: list, initial: list) -> tuple[float, float]:
    """(max abs difference of the parameters, that over the largest update of ``want``)."""
    diff = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    update = max(float(np.max(np.abs(w - p))) for w, p in zip(want, initial))
    return diff, diff / update


def assert_same(got: list, want: list, initial: list) -> None:
    _, rel = difference(got, want, initial)
    assert rel < 1e-5, rel


def assert_differs(got: list, want: list, initial: list) -> None:
    """By more than half the update (docs/migrating.md; measured: 116% of it)."""
    _, rel = difference(got, want, initial)
    assert rel > 0.5, rel


RATIO_REFUSED = (r"^the loss is neither a batch mean nor a batch sum: op '{op}' \(.*\) makes it so, both of its "
                 r"operands depend on the batch\. .*or pass loss_reduction='mean' to average the micro-batches' "
                 r"gradients whatever the loss \(Paddle's pipeline does; ")


@pytest.fixture(scope="module")
def initial():
    return {}


def start(initial, program_ir) -> list[np.ndarray]:
    if program_ir not in initial:
        initial[program_ir] = initial_state()
    return initial[program_ir]


def test_the_references_differ_only_where_the_counts_do_and_the_mean_is_paddles_gradient_merge(initial, program_ir):
    """(a) equals (b) for equal counts (and for the mean form always), not for different counts; (b) is what
    Paddle's gradient merge with avg=True trains (legacy IR: Paddle builds it there)."""
    p0 = start(initial, program_ir)
    for counts in (EQUAL, UNEQUAL):
        feed = batch(counts)
        assert_same(micro_batch_mean("mean", feed, p0), full_batch("mean", feed, p0), p0)
        (assert_same if counts == EQUAL else assert_differs)(
            micro_batch_mean("ratio", feed, p0), full_batch("ratio", feed, p0), p0)
        if program_ir == "legacy":
            merged = one_device("ratio", micro_batches(feed), p0, how="merge")
            assert_same(merged, micro_batch_mean("ratio", feed, p0), p0)


COUNTS = pytest.mark.parametrize("counts", [EQUAL, UNEQUAL], ids=["equal counts", "different counts"])


@COUNTS
def test_fleet_averages_the_micro_batches_as_paddles_pipeline_does(initial, program_ir, counts):
    """(c) staticpipe.fleet: Paddle's pipeline, the micro-batches' gradients averaged; the full batch's step
    only where the counts are equal."""
    p0, feed = start(initial, program_ir), batch(counts)
    got, reduction, _ = pipelined("ratio", "fleet", feed, p0)
    assert reduction == "mean"
    assert_same(got, micro_batch_mean("ratio", feed, p0), p0)
    (assert_same if counts == EQUAL else assert_differs)(got, full_batch("ratio", feed, p0), p0)


def test_staticpipe_refuses_the_ratio_naming_the_division_and_has_no_sum_option(program_ir):
    """(d) staticpipe.PipelineOptimizer: the ratio refused at minimize, whatever the counts (the form is read,
    not the data); loss_reduction takes "auto" and "mean" only."""
    op = "divide" if program_ir == "pir" else "elementwise_div"
    with pytest.raises(ValueError, match=RATIO_REFUSED.format(op=op)):
        build("ratio", "staticpipe")
    with pytest.raises(ValueError, match=re.escape("loss_reduction must be one of ['auto', 'mean'], got 'sum'")):
        build("weighted sum", "staticpipe", loss_reduction="sum")


@COUNTS
def test_staticpipe_averages_the_ratio_on_request_as_fleet_does(initial, program_ir, counts):
    """(d) with loss_reduction="mean": Paddle's averaging, the full batch's step only where the counts are equal."""
    p0, feed = start(initial, program_ir), batch(counts)
    got, reduction, _ = pipelined("ratio", "staticpipe", feed, p0, loss_reduction="mean")
    assert reduction == "mean"
    assert_same(got, micro_batch_mean("ratio", feed, p0), p0)
    (assert_same if counts == EQUAL else assert_differs)(got, full_batch("ratio", feed, p0), p0)


@COUNTS
@pytest.mark.parametrize("how", ["staticpipe", "fleet"])
def test_the_mean_over_every_token_is_the_full_batchs_whatever_the_counts(initial, program_ir, how, counts):
    """mean(ce * mask): a batch mean, the full batch's step under either."""
    p0, feed = start(initial, program_ir), batch(counts)
    got, reduction, _ = pipelined("mean", how, feed, p0)
    assert reduction == "mean"
    assert_same(got, full_batch("mean", feed, p0), p0)


@COUNTS
def test_weights_over_the_global_count_give_the_full_batch_of_the_ratio(initial, program_ir, counts):
    """sum(ce * weight), weight = mask / N (N: the global batch's masked tokens, fed): on one device the
    ratio's loss and step; staticpipe reads a batch sum and adds the micro-batches: the ratio's full-batch
    step and loss; fleet averages them: 1/M of the step, unless the weights are M times as large."""
    p0, feed = start(initial, program_ir), batch(counts)
    weighted = batch(counts, weights=True)
    ratio_loss, weighted_loss = [], []
    want = full_batch("ratio", feed, p0, losses=ratio_loss)
    assert_same(full_batch("weighted sum", weighted, p0, losses=weighted_loss), want, p0)
    np.testing.assert_allclose(weighted_loss, ratio_loss, rtol=1e-6)
    got, reduction, loss = pipelined("weighted sum", "staticpipe", weighted, p0)
    assert reduction == "sum"
    assert_same(got, want, p0)
    np.testing.assert_allclose(loss, ratio_loss[0], rtol=1e-5)
    got, reduction, _ = pipelined("weighted sum", "fleet", weighted, p0)
    assert reduction == "mean"
    assert_same([p + (g - p) * M for g, p in zip(got, p0)], want, p0)  # 1/M of the full batch's update
    got, _, loss = pipelined("weighted sum", "fleet", {**weighted, "mask": weighted["mask"] * M}, p0)
    assert_same(got, want, p0)
    np.testing.assert_allclose(loss, ratio_loss[0], rtol=1e-5)
