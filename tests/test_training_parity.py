"""Training features survive the rewrite: optimizers, schedules, regularization, clipping, tied weights.

Every case trains the pipelined program and its single-device twin from the same initial parameters on
the same batches and compares parameters and losses after several steps (rtol 1e-5; atol 1e-6 for
values near zero, where float32 summation order alone moves the last digits).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from functools import partial

import pytest

import staticpipe
from models import build_mlp
from models.network import fresh_names
from pipeline_util import (assert_adam_family_training, assert_clipping_matters, assert_same_training,
                           gradient_merge_twins, learning_rate_var, minimize, op_vars, parameter_names,
                           parameter_owners, train_twins)
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(300)
P, LR = paddle.optimizer, paddle.optimizer.lr
MLP3 = partial(build_mlp, num_stages=3)

EXACT = {
    "momentum+L2Decay": lambda: P.Momentum(0.1, momentum=0.9, weight_decay=paddle.regularizer.L2Decay(1e-3)),
    "sgd+L2Decay": lambda: P.SGD(0.1, weight_decay=paddle.regularizer.L2Decay(1e-2)),
    "sgd+ClipGradByValue": lambda: P.SGD(0.1, grad_clip=paddle.nn.ClipGradByValue(0.01)),
    "sgd+ClipGradByNorm": lambda: P.SGD(0.1, grad_clip=paddle.nn.ClipGradByNorm(0.01)),
    "momentum+ClipGradByGlobalNorm": lambda: P.Momentum(0.1, momentum=0.9,
                                                        grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05)),
    "PiecewiseDecay": lambda: P.Momentum(LR.PiecewiseDecay([1, 2], [0.1, 0.05, 0.01]), momentum=0.9),
    "CosineAnnealingDecay": lambda: P.SGD(LR.CosineAnnealingDecay(0.1, T_max=4)),
    "LinearWarmup+Cosine": lambda: P.SGD(LR.LinearWarmup(LR.CosineAnnealingDecay(0.1, T_max=4), 2, 0.0, 0.1)),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_training_equals_single_device(name, program_ir):
    if program_ir == "pir" and "ClipGradByValue" in name:
        pytest.skip("Paddle 3.3.1's ClipGradByValue raises NotImplementedError on a PIR program (one device too)")
    assert_same_training(train_twins(MLP3, EXACT[name], steps=4, num_microbatches=4))


@pytest.mark.parametrize("make", [lambda: P.Adam(0.01), lambda: P.AdamW(0.01, weight_decay=0.01),
                                  lambda: P.Lamb(0.01)], ids=["adam", "adamw", "lamb"])
def test_adam_family_equals_single_device_up_to_its_own_rounding_noise(make):
    """Every tensor matches to rtol 1e-5, except coordinates where the single-device reference, trained
    again with another order of its float32 sums, moves by a comparable amount (pipeline_util)."""
    assert_adam_family_training(train_twins(MLP3, make, steps=3, num_microbatches=4, noise=True))


def test_state_dict_holds_optimizer_states_on_the_parameter_stage():
    net = MLP3()
    minimize(net, P.Adam(0.01), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(8))
    state = exe.state_dict(net.main)
    plan = staticpipe.plan_of(net.main)
    for stage in plan.stages:
        for param in stage.parameters:
            moments = [k for k in state if k.startswith(param + "_moment")]
            assert len(moments) == 2, param
            for k in moments:
                assert exe.scope_of(stage.device).find_var(k) is not None
                assert all(exe.scope_of(o.device).find_var(k) is None for o in plan.stages if o is not stage)


def test_learning_rate_is_the_same_on_every_stage_and_advances_per_step_or_epoch():
    net = MLP3()
    sched = LR.PiecewiseDecay([2, 4], [0.1, 0.01, 0.001])
    minimize(net, P.SGD(sched), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)

    def loader(samples):
        ld = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
        return ld.set_sample_generator(net.sample_reader(samples), batch_size=4)  # micro-batches of 4

    def rates():
        return {d: float(np.array(exe.scope_of(d).find_var(learning_rate_var(net.main)).get_tensor()).item())
                for d in staticpipe.plan_of(net.main).devices}

    exe.train_from_dataset(net.main, loader(24), lr_step="step")  # 3 steps at epochs 0, 1, 2
    assert sched.last_epoch == 3 and set(rates().values()) == {np.float32(0.01)}
    exe.train_from_dataset(net.main, loader(16), lr_step="epoch")  # 2 steps at epoch 3, then one step
    assert sched.last_epoch == 4 and set(rates().values()) == {np.float32(0.01)}
    exe.run(net.main, feed=net.random_batch(8))
    assert set(rates().values()) == {np.float32(0.001)}
    with pytest.raises(ValueError, match="lr_step must be None, 'step' or 'epoch', got 'batch'"):
        exe.train_from_dataset(net.main, loader(8), lr_step="batch")


# ------------------------------------------------------------------------------------ tied weights

@dataclass
class TiedLM:
    main: paddle.static.Program
    startup: paddle.static.Program
    loss: paddle.static.Variable
    vocab: int
    seq: int

    def random_batch(self, batch_size, seed=0):
        rng = np.random.default_rng(seed)
        return {"ids": rng.integers(0, self.vocab, (batch_size, self.seq)).astype("int64"),
                "next": rng.integers(0, self.vocab, (batch_size, self.seq, 1)).astype("int64")}


def tied_lm(num_stages=2, guarded=True, vocab=40, dim=16, seq=4, head=False, devices=None):
    """A language-model toy: the input embedding table is reused, transposed, as the output projection.
    Its last stage owns no parameter unless ``head`` gives it a layer before the projection. ``devices``:
    each stage's device (default gpu:k for stage k; ["gpu:0", "gpu:1", "gpu:0", "gpu:1"]: interleaved)."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 7
    devices = devices or [f"gpu:{k}" for k in range(num_stages)]

    def on(stage):
        return staticpipe.device_guard(devices[stage]) if guarded else paddle.static.device_guard(None)

    with paddle.static.program_guard(main, startup), fresh_names():
        with on(0):
            ids = paddle.static.data("ids", [None, seq], "int64")
            table = paddle.static.create_parameter([vocab, dim], "float32", name="embedding")
            h = paddle.tanh(paddle.static.nn.fc(paddle.nn.functional.embedding(ids, table), dim,
                                                num_flatten_dims=2))
        for stage in range(1, num_stages - 1):
            with on(stage):
                h = paddle.tanh(paddle.static.nn.fc(h, dim, num_flatten_dims=2))
        with on(num_stages - 1):
            nxt = paddle.static.data("next", [None, seq, 1], "int64")
            if head:
                h = paddle.tanh(paddle.static.nn.fc(h, dim, num_flatten_dims=2))
            logits = paddle.matmul(h, table, transpose_y=True)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, nxt, reduction="none"))
    return TiedLM(main, startup, loss, vocab, seq)


TIED_LAYOUTS = {"2": (2, None, "1F1B"), "3": (3, None, "1F1B"),
                "interleaved": (4, ["gpu:0", "gpu:1", "gpu:0", "gpu:1"], "interleaved")}


@pytest.mark.parametrize("layout", sorted(TIED_LAYOUTS))
@pytest.mark.parametrize("make, clipped", [
    (lambda: P.Momentum(0.1, momentum=0.9), False),
    (lambda: P.SGD(0.5, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1)), True),
    (lambda: P.AdamW(0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1)), True)],
    ids=["momentum", "sgd+global-norm", "adamw+global-norm"])
def test_tied_embedding_trains_like_single_device(layout, make, clipped, program_ir):
    """The owner (the first reader) updates the tied table from its own gradient plus the last stage's
    partial (sent once per step) and sends the new value back; a global-norm clip sees the whole gradient."""
    stages, devices, schedule = TIED_LAYOUTS[layout]
    twin = train_twins(partial(tied_lm, num_stages=stages, devices=devices), make, steps=4, batch_size=8,
                       num_microbatches=4, schedule=schedule)
    assert_same_training(twin)
    assert twin.plan.shared == {"embedding": (0, stages - 1)}
    kinds = sorted(ex.why.split(" of ")[0] for ex in twin.plan.exchanges)
    owners = sum(bool(stage.parameters) for stage in twin.plan.stages)  # the last stage owns none here
    assert kinds == ["cross-stage sum"] * (clipped and owners > 1) + ["new value", "partial gradient"]


@pytest.mark.parametrize("stages", [2, 3])
def test_tied_embedding_with_active_global_norm_clipping_where_every_stage_owns_parameters(stages):
    """The clip is active on every step and every stage owns parameters (the last a layer before the
    tied projection), so a stage clipping by its own part of the norm would train differently."""
    clip = 0.1
    twin = train_twins(partial(tied_lm, num_stages=stages, head=True),
                       lambda: P.SGD(0.5, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip)),
                       steps=4, batch_size=8, num_microbatches=4)
    assert twin.plan.shared == {"embedding": (0, stages - 1)}
    assert_clipping_matters(twin.ref_grad_squares, twin.plan, clip)
    assert_same_training(twin)


def test_tied_embedding_is_identical_on_every_stage_that_reads_it():
    net = tied_lm(num_stages=3)
    minimize(net, P.Momentum(0.1, momentum=0.9), dict(num_microbatches=2))
    plan = staticpipe.plan_of(net.main)
    assert "shared parameters" in str(plan)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(3):
        exe.run(net.main, feed=net.random_batch(4, seed=step))
        first, last = (np.array(exe.scope_of(d).find_var("embedding").get_tensor()) for d in ("gpu:0", "gpu:2"))
        np.testing.assert_array_equal(first, last)
    assert exe.scope_of("gpu:1").find_var("embedding") is None


# ------------------------------------------------------------------------- batch norm and dropout

def test_batch_norm_statistics_per_microbatch_and_eval_uses_trained_statistics():
    from models import build_resnet
    builder = partial(build_resnet, depth=50, num_stages=3, width=8, image_size=16)
    ref_eval, pipe_eval, trained = gradient_merge_twins(builder, lambda: P.Momentum(0.05, momentum=0.9))
    assert any(k in trained for k in op_vars(builder().main, "batch_norm", "Mean"))  # running means are state
    np.testing.assert_allclose(pipe_eval, ref_eval, rtol=1e-5)


@dataclass
class ConvBatchNorm:
    main: paddle.static.Program
    startup: paddle.static.Program
    loss: paddle.static.Variable
    statistics: list[str]  # batch norm's running mean and variance

    def random_batch(self, batch_size, seed=0):
        rng = np.random.default_rng(seed)
        return {"x": rng.standard_normal((batch_size, 2, 6, 6)).astype("float32"),
                "y": rng.integers(0, 4, (batch_size, 1)).astype("int64")}


def conv_batch_norm(guarded=True, microbatches=2):
    """conv + batch norm + relu + pool on gpu:0, linear + cross-entropy on gpu:1. Unguarded, it is the
    single-device reference of a pipeline of ``microbatches`` micro-batches: the same layers (the same
    parameters) applied to each slice of the batch, the losses averaged, so batch norm sees each micro-batch
    alone and moves its running statistics once per micro-batch, as the pipeline's stages do."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 3
    slices = 1 if guarded else microbatches

    def on(device):
        return staticpipe.device_guard(device) if guarded else contextlib.nullcontext()

    with paddle.static.program_guard(main, startup), fresh_names():
        x = paddle.static.data("x", [None, 2, 6, 6], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        with on("gpu:0"):
            conv, norm = paddle.nn.Conv2D(2, 4, 3, padding=1), paddle.nn.BatchNorm2D(4)
        with on("gpu:1"):
            fc = paddle.nn.Linear(4 * 3 * 3, 4)
        losses = []
        for part, label in zip(paddle.split(x, slices) if slices > 1 else [x],
                               paddle.split(y, slices) if slices > 1 else [y]):
            with on("gpu:0"):
                h = paddle.nn.functional.max_pool2d(paddle.nn.functional.relu(norm(conv(part))), 2)
            with on("gpu:1"):
                losses.append(paddle.mean(paddle.nn.functional.cross_entropy(fc(paddle.flatten(h, 1)), label)))
        loss = paddle.add_n(losses) / slices if slices > 1 else losses[0]
    return ConvBatchNorm(main, startup, loss, [norm._mean.name, norm._variance.name])


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_batch_norm_equals_one_device_per_micro_batch(recompute, program_ir):
    """Losses, parameters and running statistics as one device that normalizes each micro-batch alone.
    Recomputed, batch norm (``batch_norm_`` updates its running statistics in place) runs again in the
    backward on a copy of the statistics: they move once per micro-batch, not twice."""
    ref, pipe = conv_batch_norm(guarded=False), conv_batch_norm()
    minimize(ref, P.Momentum(0.05, momentum=0.9), None)
    plan = minimize(pipe, P.Momentum(0.05, momentum=0.9), dict(num_microbatches=2, recompute=recompute)).plan
    assert plan.stages[0].recompute == recompute
    assert set(pipe.statistics) <= set(plan.stages[0].persistables)
    names = assert_state_trains_alike(ref, pipe, steps=3, batch_size=12)
    assert set(pipe.statistics) < set(names)


def assert_state_trains_alike(ref, pipe, steps, batch_size):
    """Train minimized ``ref`` on one device and ``pipe`` as a pipeline from the same state (all of it:
    parameters, running statistics, optimizer state, by name) on the same batches: the losses and the
    whole trained state alike (rtol 1e-5, atol 1e-5); returns the state's names. ``train_twins`` compares
    parameters, which on the legacy IR leave batch norm's running statistics out."""
    plain, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    plain.run(ref.startup, scope=scope)
    exe = staticpipe.Executor()
    exe.run(pipe.startup)
    names = sorted(exe.state_dict(pipe.main))
    assert set(parameter_names(ref.main)) <= set(names)
    exe.set_state_dict(pipe.main, {n: np.array(scope.find_var(n).get_tensor()) for n in names})
    ref_losses, losses = [], []
    for step in range(steps):
        batch = ref.random_batch(batch_size, seed=step)
        ref_losses.append(float(plain.run(ref.main, feed=batch, fetch_list=[ref.loss], scope=scope)[0]))
        losses.append(float(exe.run(pipe.main, feed=batch, fetch_list=[pipe.loss])[0]))
    state = exe.state_dict(pipe.main)
    exe.close()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name in names:
        np.testing.assert_allclose(state[name], np.array(scope.find_var(name).get_tensor()), rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    return names


def test_resnet_with_one_micro_batch_trains_as_one_device(program_ir):
    """models' ResNet-50 (paddle.nn's Conv2D and BatchNorm2D) over 2 stages; one micro-batch, so batch norm
    sees the whole batch as on one device: losses, parameters and running statistics as one device."""
    from models import build_resnet
    builder = partial(build_resnet, depth=50, num_stages=2, width=8, image_size=16)
    ref, pipe = builder(guarded=False), builder()
    assert parameter_names(ref.main) == parameter_names(pipe.main)
    minimize(ref, P.Momentum(0.05, momentum=0.9), None)
    minimize(pipe, P.Momentum(0.05, momentum=0.9), dict(num_microbatches=1))
    assert_state_trains_alike(ref, pipe, steps=2, batch_size=8)


@dataclass
class DropoutNet:
    main: paddle.static.Program
    startup: paddle.static.Program
    loss: paddle.static.Variable

    def random_batch(self, batch_size, seed=0):
        rng = np.random.default_rng(seed)
        return {"features": rng.standard_normal((batch_size, 16)).astype("float32"),
                "label": rng.integers(0, 4, (batch_size, 1)).astype("int64")}


def dropout_net(guarded=True):
    """Two stages with dropout after every hidden layer; the program's random seed fixes the masks."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 5

    def on(device):
        return staticpipe.device_guard(device) if guarded else paddle.static.device_guard(None)

    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with on("gpu:0"):
            x = paddle.static.data("features", [None, 16], "float32")
            h = paddle.nn.functional.dropout(paddle.static.nn.fc(x, 32, activation="relu"), 0.5)
        with on("gpu:1"):
            label = paddle.static.data("label", [None, 1], "int64")
            h = paddle.nn.functional.dropout(paddle.static.nn.fc(h, 32, activation="relu"), 0.5)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(paddle.static.nn.fc(h, 4), label))
    return DropoutNet(main, startup, loss)


def test_dropout_masks_are_reproducible_with_a_seed():
    """With a program seed every dropout op draws the same mask per run, in the pipeline as in the
    micro-batched reference; training twice gives identical parameters."""
    _, _, first = gradient_merge_twins(dropout_net, lambda: P.SGD(0.1))
    _, _, second = gradient_merge_twins(dropout_net, lambda: P.SGD(0.1))
    for name, value in first.items():
        np.testing.assert_array_equal(value, second[name], err_msg=name)


# ------------------------------------------------------------------------------------- recompute

@pytest.mark.parametrize("schedule", ["F-then-B", "1F1B"])
def test_recompute_trains_identically_and_holds_less(schedule, program_ir):
    """Recompute changes where activations come from, not what is computed: parameters are identical
    to the run without it, and each stage holds only its inputs between forward and backward."""
    from models import build_resnet
    builder = partial(build_resnet, depth=50, num_stages=2, width=8, image_size=16)
    runs = {}
    for recompute in (False, True):
        net = builder()
        minimize(net, P.Momentum(0.05, momentum=0.9),
                 dict(num_microbatches=4, schedule=schedule, recompute=recompute))
        exe = staticpipe.Executor()
        exe.run(net.startup)
        for step in range(2):
            exe.run(net.main, feed=net.random_batch(16, seed=step))
        runs[recompute] = exe.state_dict(net.main), exe.memory_stats(), staticpipe.plan_of(net.main)
    (plain, plain_mem, _), (recomputed, recomputed_mem, plan) = runs[False], runs[True]
    for name, value in plain.items():  # batch-norm running statistics included: updated once, not twice
        np.testing.assert_array_equal(recomputed[name], value, err_msg=name)
    for stage in (0, 1):
        assert recomputed_mem[stage]["peak_activation_bytes"] < plain_mem[stage]["peak_activation_bytes"] / 4
        assert recomputed_mem[stage]["peak_inflight_microbatches"] == plain_mem[stage]["peak_inflight_microbatches"]
    assert plain_mem[0]["peak_inflight_microbatches"] == (4 if schedule == "F-then-B" else 2)
    assert "(recompute)" in str(plan)
    for stage in plan.stages:  # between forward and backward a stage keeps its inputs and what it sends, no more
        fwd, bwd = stage.sections["forward"], stage.sections["backward"]
        here = staticpipe.plan.SectionRef(stage.index, "forward")
        received = {v.name for r in plan.routes if r.dst == here for v in r.vars}
        sent = {v.name for r in plan.routes if r.src == here for v in r.vars}
        assert set(fwd.keep) == set(fwd.feeds) | received | sent, stage.index
        assert stage.recompute and bwd.recomputed_ops == fwd.source_ops


def test_recompute_refuses_unseeded_dropout_and_unknown_stages():
    def build(seeded):
        main, startup = paddle.static.Program(), paddle.static.Program()
        if seeded:
            main.random_seed = 3
        with paddle.static.program_guard(main, startup):
            with staticpipe.device_guard("gpu:0"):
                x = paddle.static.data("x", [None, 4], "float32")
                h = paddle.nn.functional.dropout(paddle.static.nn.fc(x, 4), 0.5)
            with staticpipe.device_guard("gpu:1"):
                loss = paddle.mean(paddle.static.nn.fc(h, 1))
        return main, startup, loss

    main, startup, loss = build(seeded=False)
    with paddle.static.program_guard(main, startup), pytest.raises(ValueError, match=re.escape(
            "recompute on stage 0: op #2 'dropout' draws new random numbers on every run, so its "
            "recomputation would differ; set main_program.random_seed before building the network")):
        staticpipe.PipelineOptimizer(P.SGD(0.1), num_microbatches=2, recompute=[0]).minimize(loss)
    main, startup, loss = build(seeded=True)
    with paddle.static.program_guard(main, startup), pytest.raises(ValueError, match=re.escape(
            "recompute names stages [2], but the program has stages 0..1")):
        staticpipe.PipelineOptimizer(P.SGD(0.1), num_microbatches=2, recompute=[2]).minimize(loss)


# ------------------------------------------------------------------------ end-to-end model parity

@pytest.mark.parametrize("stages, schedule", [(2, "1F1B"), (3, "1F1B"), (4, "1F1B"), (4, "F-then-B"), (2, "ZB-H1")])
def test_gpt_with_adamw_warmup_cosine_and_global_norm_clipping(stages, schedule, program_ir):
    """The realistic case: tied embeddings across the first and last stage, AdamW with weight decay,
    linear warm-up into cosine decay, global-norm clipping across every stage. The clip (0.1; the
    gradient norm is 0.6 to 0.9) is active on every step and every stage owns parameters, so a stage
    clipping by its local norm would train differently (the reference's norms are asserted: legacy IR,
    whose clip ops name them). The oracle: legacy IR, the reference's own rounding noise (measured with
    Paddle's gradient merge, which builds legacy programs only); PIR, rtol and atol 2e-5."""
    from models import build_gpt
    clip = 0.1

    def make():
        sched = LR.LinearWarmup(LR.CosineAnnealingDecay(0.01, T_max=8), 2, 0.0, 0.01)
        return P.AdamW(sched, weight_decay=0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))

    legacy = program_ir == "legacy"
    twin = train_twins(partial(build_gpt, num_stages=stages), make, steps=4, batch_size=8, num_microbatches=4,
                       schedule=schedule, noise=legacy)
    assert twin.plan.num_stages == stages and list(twin.plan.shared) == ["tok_embedding"]
    if legacy:
        assert_clipping_matters(twin.ref_grad_squares, twin.plan, clip)
        assert_adam_family_training(twin)
    else:
        assert_same_training(twin, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_dlrm_with_embeddings_on_a_cpu_stage(sparse, optimizer, program_ir):
    """Heterogeneous placement: embedding tables on "cpu", the MLPs on gpu:k (CPU devices here). The
    embeddings' concatenation goes from the CPU stage straight to the top MLP's stage (a skip route)."""
    from models import build_dlrm
    if sparse and optimizer == "adam" and program_ir == "legacy":
        pytest.skip("a sparse gradient's Adam update is refused on the legacy IR (test below); a PIR program's "
                    "embedding gradient is dense")
    make, rtol, atol = {"sgd": (lambda: P.SGD(0.1), 1e-5, 1e-6), "adam": (lambda: P.Adam(0.01), 2e-5, 2e-5)}[optimizer]
    builder = partial(build_dlrm, num_stages=3, is_sparse=sparse)
    net = builder()
    minimize(net, make(), dict(num_microbatches=2))
    plan = staticpipe.plan_of(net.main)
    assert plan.devices == ["cpu", "gpu:0", "gpu:1"]
    wide = [o for o in parameter_owners(net.main) if not o.startswith("sparse_embedding")][0]  # the first dense layer
    assert all(p.startswith("sparse_embedding") or p.rsplit(".", 1)[0] == wide for p in plan.stages[0].parameters)
    assert_same_training(train_twins(builder, make, num_microbatches=4), rtol=rtol, atol=atol)


def test_sparse_gradients_with_a_lazy_sparse_optimizer_are_refused():
    """Sparse (SelectedRows) gradients are summed densely over micro-batches: exact for SGD (above), but
    Paddle's sparse momentum skips rows absent from a batch, which a dense sum cannot reproduce."""
    from models import build_dlrm
    net = build_dlrm(num_stages=3, is_sparse=True)
    with pytest.raises(ValueError) as err:
        minimize(net, P.Momentum(0.1, momentum=0.9), dict(num_microbatches=2))
    assert re.fullmatch(r"optimizer op #\d+ 'momentum' updates 'sparse_embedding_\d' from a sparse gradient; "
                        r"micro-batch accumulation makes it dense, which changes this optimizer's sparse \(lazy\) "
                        r"update: use is_sparse=False for that embedding, or the SGD optimizer", str(err.value))
