"""PIR programs (Paddle 3's default IR) pipelined through the same API, against single-device PIR training.

Each test builds its programs inside ``paddle.pir_utils.IrGuard`` (this process builds legacy programs
otherwise, see conftest.py), trains a pipeline and the same network on one device from the same initial
values, and compares losses and parameters. Feature tests that take the ``program_ir`` fixture
(conftest.py) run on both IRs from one body, every schedule among them (``test_schedules_train.py``);
this file holds what is PIR's own.
"""
from __future__ import annotations

import pytest

import staticpipe
from staticpipe._paddle import PADDLE_MAJOR, np, paddle

pytestmark = pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")

BATCH, FEATURES, CLASSES = 12, 12, 4


@pytest.fixture(autouse=True)
def _pir():
    with paddle.pir_utils.IrGuard():
        yield


def mlp(devices, hidden=16, data=None):
    """x -> (fc + relu) per device in ``devices`` -> fc -> softmax cross-entropy on the last device;
    ``data`` (a dict) receives the data values."""
    def layers():
        x = paddle.static.data("x", [None, FEATURES], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        if data is not None:
            data.update(x=x, y=y)
        h = x
        for k, device in enumerate(devices):
            with staticpipe.device_guard(device):
                h = paddle.nn.functional.relu(paddle.static.nn.fc(h, hidden))
                if k == len(devices) - 1:
                    logits = paddle.static.nn.fc(h, CLASSES)
                    loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, y))
        return loss
    return layers


def build(layers, optimizer, pipeline=None):
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        loss = layers()
        opt = optimizer()
        if pipeline is not None:
            opt = staticpipe.PipelineOptimizer(opt, **pipeline)
        opt.minimize(loss)
    return main, startup, loss, opt


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((BATCH, FEATURES)).astype("float32"),
             "y": rng.integers(0, CLASSES, (BATCH, 1)).astype("int64")} for _ in range(steps)]


def params(program):
    return [p.name for p in program.global_block().all_parameters()]


def reference(layers, optimizer, data, lr_steps=False):
    """Single-device PIR training on ``data``: (initial parameters, losses, final parameters), both
    parameter lists in ``params`` order."""
    main, startup, loss, opt = build(layers, optimizer)
    scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):  # Paddle's PIR executor sets a scheduled learning rate in the global scope
        exe.run(startup)
        init = [np.array(scope.find_var(n).get_tensor()) for n in params(main)]
        losses = []
        for batch in data:
            losses.append(float(exe.run(main, feed=batch, fetch_list=[loss])[0]))
            if lr_steps:
                opt._learning_rate.step()
    return init, losses, [np.array(scope.find_var(n).get_tensor()) for n in params(main)]


def train_twins(layers, optimizer, pipeline, steps=3, lr_steps=False):
    """(reference losses, pipeline losses, reference parameters, pipeline parameters, the pipeline's optimizer)."""
    data = batches(steps)
    init, ref_losses, ref = reference(layers, optimizer, data, lr_steps)
    main, startup, loss, opt = build(layers, optimizer, pipeline)
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    exe.set_state_dict(main, dict(zip(params(main), init)))
    losses = []
    for batch in data:
        losses.append(float(exe.run(main, feed=batch, fetch_list=[loss])[0]))
        if lr_steps:
            opt.inner._learning_rate.step()
    state = exe.state_dict(main)
    exe.close()
    return ref_losses, losses, ref, [state[n] for n in params(main)], opt


def assert_same(ref_losses, pipe_losses, ref, pipe, tol=None):
    """By default the project's float32 tolerance, rtol 1e-5 and atol 1e-6 (``pipeline_util``'s): the pipeline
    sums micro-batch gradients where the reference reduces the batch at once, and a matmul's sums also follow
    the thread budget of the thread running it, so Adam's updates differ by a few ulps. ``tol``: both."""
    rtol, atol = (1e-5, 1e-6) if tol is None else (tol, tol)
    np.testing.assert_allclose(pipe_losses, ref_losses, rtol=rtol, atol=atol)
    assert len(pipe) == len(ref)
    for k, (mine, theirs) in enumerate(zip(pipe, ref)):
        np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=atol, err_msg=f"parameter #{k}")


def adam():
    return paddle.optimizer.Adam(0.01)


@pytest.mark.parametrize("schedule", ["1F1B", "F-then-B"])
@pytest.mark.parametrize("optimizer", [lambda: paddle.optimizer.SGD(0.1),
                                       lambda: paddle.optimizer.Momentum(0.1, momentum=0.9), adam],
                         ids=["sgd", "momentum", "adam"])
def test_mlp_two_stages_equals_one_device(schedule, optimizer):
    *result, opt = train_twins(mlp(["gpu:0", "gpu:1"]), optimizer, dict(num_microbatches=4, schedule=schedule))
    assert_same(*result)
    assert opt.plan.num_stages == 2 and opt.plan.schedule == staticpipe.schedule.get_kind(schedule).name


def test_mlp_three_and_four_stages():
    *result, opt = train_twins(mlp(["gpu:0", "gpu:1", "gpu:2", "gpu:3"]), adam, dict(num_microbatches=4))
    assert_same(*result)
    assert opt.plan.devices == ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]
    *result, _ = train_twins(mlp(["gpu:0", "gpu:1", "gpu:2"]), adam, dict(num_microbatches=3))
    assert_same(*result)


def test_custom_schedule_text():
    text = "rank 0: 0F0 0F1 0B0 0B1 0OPT\nrank 1: 1F0 1B0 1F1 1B1 1OPT"
    *result, opt = train_twins(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2, schedule=text))
    assert_same(*result)
    assert opt.plan.schedule == "custom"


def test_learning_rate_scheduler_steps_like_one_device():
    def warm_cosine():
        cosine = paddle.optimizer.lr.CosineAnnealingDecay(0.05, T_max=4)
        return paddle.optimizer.AdamW(paddle.optimizer.lr.LinearWarmup(cosine, 2, 0.0, 0.05), weight_decay=0.01)
    *result, _ = train_twins(mlp(["gpu:0", "gpu:1"]), warm_cosine, dict(num_microbatches=2), steps=4, lr_steps=True)
    assert_same(*result)


def test_plan_names_the_cut_values_with_static_shapes():
    _, _, _, opt = build(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2, micro_batch_size=8))
    text = str(opt.plan)
    cut = [v for r in opt.plan.routes for v in r.vars]
    assert [v.shape for v in cut] == [(-1, 16), (-1, 16)] and [v.dtype for v in cut] == ["float32"] * 2
    assert cut[1].name == cut[0].name + "@GRAD"
    assert f"{cut[0].name} [8, 16] float32" in text and "stage 0 forward -> stage 1 forward" in text
    assert opt.plan.data_vars == {"x": (0,), "y": (1,)}


def test_train_from_dataset_reads_the_started_loader():
    """Paddle's meaning: a loader batch is one micro-batch; two of them make the step's global batch."""
    data = batches(2)
    init, ref_losses, ref = reference(mlp(["gpu:0", "gpu:1"]), adam, data)
    values = {}
    main, startup, loss, opt = build(mlp(["gpu:0", "gpu:1"], data=values), adam, dict(num_microbatches=2))
    loader = staticpipe.io.DataLoader.from_generator(feed_list=[values["x"], values["y"]], capacity=4, iterable=False)
    samples = [(x, y) for batch in data for x, y in zip(batch["x"], batch["y"])]
    loader.set_sample_generator(lambda: iter(samples), batch_size=BATCH // 2)
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    exe.set_state_dict(main, dict(zip(params(main), init)))
    loader.start()
    history = exe.train_from_dataset(main, fetch_list=[loss], print_period=1)
    state = exe.state_dict(main)
    assert_same(ref_losses, [float(h[0]) for h in history], ref, [state[n] for n in params(main)])
    exe.close()


def test_zero_bubble_splits_the_backward_and_trains_alike():
    """ZB-H1: each backward op computing both an activation and a weight gradient is rebuilt in two halves
    (Paddle's vjp of its forward op asked for one kind each), B on the critical path, W later."""
    *result, opt = train_twins(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=4, schedule="ZB-H1"))
    assert_same(*result)
    for stage in opt.plan.stages:
        b, w = stage.sections["backward"].program, stage.sections["weight"].program
        grads_b = [op for op in b.global_block().ops if op.name() == "pd_op.matmul_grad"]
        grads_w = [op for op in w.global_block().ops if op.name() == "pd_op.matmul_grad"]
        assert grads_w and all(not op.result(0).initialized() for op in grads_w)  # W: no activation gradient
        assert all(not op.result(1).initialized() for op in grads_b)  # B: no weight gradient


@pytest.mark.parametrize("devices, schedule", [(["gpu:0", "gpu:1"], "1F1B"),
                                               (["gpu:0", "gpu:1", "gpu:0", "gpu:1"], "interleaved")])
def test_global_norm_clipping_equals_one_device(devices, schedule):
    """The clip's sum of squared norms spans every stage: each stage adds its own, one exchange adds the
    stages' parts (two stages of one device add theirs locally first), and every stage scales by the same
    global norm. A clip norm below the gradients' norm, so that the clip changes the update."""
    clipped = lambda: paddle.optimizer.Momentum(0.1, momentum=0.9,  # noqa: E731
                                                grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05))
    *result, opt = train_twins(mlp(devices), clipped, dict(num_microbatches=4, schedule=schedule))
    assert_same(*result)
    sums = [ex for ex in opt.plan.exchanges if ex.kind == "sum"]
    assert len(sums) == 1 and sums[0].vars[0].shape == ()
    assert all(len(st.sections["optimize"].runs) == 2 for st in opt.plan.stages)


@pytest.mark.parametrize("schedule", ["rank 0: 0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1 0OPT 3OPT\n"
                                      "rank 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1OPT 2OPT", "ZB-V"],
                         ids=["custom", "ZB-V"])
def test_split_points_make_a_v_layout_from_the_model_zoo(schedule):
    """``models.build_mlp`` marks each stage boundary with ``split_point``: 4 stages on 2 devices in a V
    (gpu:0, gpu:1, gpu:1, gpu:0), run by a custom schedule and by ZB-V, against the zoo's own unguarded
    twin."""
    from models import build_mlp

    v = ["gpu:0", "gpu:1", "gpu:1", "gpu:0"]
    text = schedule
    nets = [build_mlp(num_stages=4, guarded=guarded, in_dim=FEATURES, hidden=16, depth=4, stage_devices=v)
            for guarded in (False, True)]
    rng = np.random.default_rng(3)
    data = [{"features": rng.standard_normal((BATCH, FEATURES)).astype("float32"),
             "label": rng.integers(0, 10, (BATCH, 1)).astype("int64")} for _ in range(3)]
    with paddle.static.program_guard(nets[0].main, nets[0].startup):
        paddle.optimizer.Adam(0.01).minimize(nets[0].loss)
    with paddle.static.program_guard(nets[1].main, nets[1].startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Adam(0.01), num_microbatches=2, schedule=text)
        opt.minimize(nets[1].loss)
    assert opt.plan.devices == v and len(opt.plan.ranks) == 2 and opt.plan.schedule == (
        "custom" if "rank" in schedule else "ZB-V")
    scope, ref = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        ref.run(nets[0].startup)
        init = [np.array(scope.find_var(n).get_tensor()) for n in params(nets[0].main)]
        ref_losses = [float(ref.run(nets[0].main, feed=b, fetch_list=[nets[0].loss])[0]) for b in data]
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(nets[1].startup)
    exe.set_state_dict(nets[1].main, dict(zip(params(nets[1].main), init)))
    losses = [float(exe.run(nets[1].main, feed=b, fetch_list=[nets[1].loss])[0]) for b in data]
    state = exe.state_dict(nets[1].main)
    assert_same(ref_losses, losses, [np.array(scope.find_var(n).get_tensor()) for n in params(nets[0].main)],
                [state[n] for n in params(nets[1].main)])
    exe.close()


def test_a_value_of_another_program_cannot_be_fetched():
    main, startup, loss, _ = build(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2))
    _, _, other_loss, _ = build(mlp(["gpu:0", "gpu:1"]), adam)
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    with pytest.raises(ValueError, match=r"fetch_list\[0\]: the value is not one of this program's values"):
        exe.run(main, feed=batches(1)[0], fetch_list=[other_loss])
    exe.close()


def convnet(slices=1):
    """conv + batch norm + relu + pool on gpu:0, fc + cross-entropy on gpu:1. ``slices`` > 1 is the
    single-device reference of a pipeline of that many micro-batches: the same layers (shared by name)
    applied to each slice of the batch, the losses averaged, so batch norm sees each micro-batch alone."""
    def layers():
        x = paddle.static.data("x", [None, 2, 6, 6], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        with staticpipe.device_guard("gpu:0"):
            conv, norm = paddle.nn.Conv2D(2, 4, 3, padding=1), paddle.nn.BatchNorm2D(4)
        with staticpipe.device_guard("gpu:1"):
            fc = paddle.nn.Linear(4 * 3 * 3, CLASSES)
        losses = []
        for part, label in zip(paddle.split(x, slices) if slices > 1 else [x],
                               paddle.split(y, slices) if slices > 1 else [y]):
            with staticpipe.device_guard("gpu:0"):
                h = paddle.nn.functional.max_pool2d(paddle.nn.functional.relu(norm(conv(part))), 2)
            with staticpipe.device_guard("gpu:1"):
                losses.append(paddle.mean(paddle.nn.functional.cross_entropy(fc(paddle.flatten(h, 1)), label)))
        return paddle.add_n(losses) / slices if slices > 1 else losses[0]
    return layers


def test_convnet_with_batch_norm_equals_one_device_per_micro_batch():
    m, rng = 2, np.random.default_rng(1)
    data = [{"x": rng.standard_normal((BATCH, 2, 6, 6)).astype("float32"),
             "y": rng.integers(0, CLASSES, (BATCH, 1)).astype("int64")} for _ in range(3)]
    momentum = lambda: paddle.optimizer.Momentum(0.05, momentum=0.9)  # noqa: E731
    init, ref_losses, ref = reference(convnet(slices=m), momentum, data)
    main, startup, loss, opt = build(convnet(), momentum, dict(num_microbatches=m))
    assert params(main) == params(build(convnet(slices=m), momentum)[0])
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    exe.set_state_dict(main, dict(zip(params(main), init)))
    losses = [float(exe.run(main, feed=batch, fetch_list=[loss])[0]) for batch in data]
    state = exe.state_dict(main)
    assert_same(ref_losses, losses, ref, [state[n] for n in params(main)], tol=1e-5)
    stats = [p.name for p in main.global_block().all_parameters() if not p.trainable]
    assert len(stats) == 2 and set(stats) <= set(opt.plan.stages[0].persistables)  # batch norm's running mean, var
    exe.close()


def test_a_refused_program_is_left_unchanged():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(main, startup):
        loss = mlp(["gpu:0", "gpu:1"])()
        before = len(main.global_block().ops)
        amp = paddle.static.amp.decorate(paddle.optimizer.SGD(0.1), level="O1")
        with pytest.raises(ValueError, match=r"does not pipeline PIR programs with AMP \(paddle.static.amp\) yet"):
            staticpipe.PipelineOptimizer(amp, num_microbatches=2).minimize(loss)
    assert len(main.global_block().ops) == before and staticpipe.plan_of(main) is None


def test_checkpoint_round_trip_and_verify(tmp_path):
    data = batches(4)
    main, startup, loss, opt = build(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2))
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    for batch in data[:2]:
        exe.run(main, feed=batch, fetch_list=[loss])
    staticpipe.save(main, str(tmp_path / "ckpt"), exe)
    later = [float(exe.run(main, feed=batch, fetch_list=[loss])[0]) for batch in data[2:]]
    state = exe.state_dict(main)
    again = staticpipe.Executor(paddle.CPUPlace())
    again.run(startup)
    meta = staticpipe.load(main, str(tmp_path / "ckpt"), again)
    assert meta["step"] == 2
    assert [float(again.run(main, feed=batch, fetch_list=[loss])[0]) for batch in data[2:]] == later
    restored = again.state_dict(main)
    assert set(restored) == set(state)
    for name in state:  # the same training from the same saved state: the same bits
        np.testing.assert_array_equal(restored[name], state[name], err_msg=name)
    accumulators = {v.name for per_param in opt.inner._accumulators.values() for v in per_param.values()}
    assert len(accumulators) >= 2 * len(params(main)) and accumulators <= set(state)  # Adam's state went through too
    report = staticpipe.verify(main, data[:2], startup, steps=2)
    assert report.ok, str(report)
    exe.close(), again.close()


def tied(devices):
    """An embedding-like matrix read on the first and the last stage (as GPT ties its token embedding to
    its output projection): x @ W on the first device, ... @ W^T on the last."""
    def layers():
        x = paddle.static.data("x", [None, FEATURES], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        with staticpipe.device_guard(devices[0]):
            table = paddle.static.create_parameter([FEATURES, 16], "float32", name="tied.w")
            h = paddle.tanh(paddle.matmul(x, table))
        for device in devices[1:]:
            with staticpipe.device_guard(device):
                h = paddle.nn.functional.relu(paddle.static.nn.fc(h, 16))
        with staticpipe.device_guard(devices[-1]):
            logits = paddle.static.nn.fc(paddle.matmul(h, table, transpose_y=True), CLASSES)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, y))
        return loss
    return layers


@pytest.mark.parametrize("devices, schedule", [(["gpu:0", "gpu:1"], "1F1B"),
                                               (["gpu:0", "gpu:1", "gpu:0", "gpu:1"], "interleaved")])
def test_tied_parameter_with_clipping_equals_one_device(devices, schedule):
    """The owner (first reader) updates the tied matrix from its own gradient plus the other stage's partial
    (sent once per step) and sends the new value back; clipping sees the whole gradient."""
    opt_ = lambda: paddle.optimizer.AdamW(0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1))  # noqa: E731
    *result, opt = train_twins(tied(devices), opt_, dict(num_microbatches=4, schedule=schedule))
    assert_same(*result)
    assert opt.plan.shared == {"tied.w": (0, len(devices) - 1)}
    kinds = sorted(ex.why.split(" of ")[0] for ex in opt.plan.exchanges)
    assert kinds == ["cross-stage sum", "new value", "partial gradient"]


@pytest.mark.parametrize("stages, schedule", [(2, "1F1B"), (4, "F-then-B"), (2, "ZB-H1")])
def test_gpt_tied_embedding_adamw_warmup_cosine_clip_equals_one_device(stages, schedule):
    """``models.build_gpt``: the token table is read by the lookup on the first stage and by the output
    projection on the last; AdamW, linear warm-up into cosine decay, global-norm clipping."""
    from models import build_gpt

    def optimizer():
        cosine = paddle.optimizer.lr.CosineAnnealingDecay(3e-3, T_max=4)
        return paddle.optimizer.AdamW(paddle.optimizer.lr.LinearWarmup(cosine, 2, 0.0, 3e-3), weight_decay=0.01,
                                      grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))

    nets = [build_gpt(num_stages=stages, guarded=g, n_layers=4) for g in (False, True)]
    ref_losses, losses, ref, state, exe = train_model_twins(nets, optimizer, dict(num_microbatches=4, schedule=schedule),
                                                            lr_steps=True)
    plan = staticpipe.plan_of(nets[1].main)
    assert plan.num_stages == stages and list(plan.shared) == ["tok_embedding"]
    assert_same(ref_losses, losses, ref, state, tol=2e-5)
    exe.close()


def train_model_twins(nets, optimizer, pipeline, lr_steps=False, steps=4):
    """A ``models`` network built twice (``nets``: unguarded, guarded) trained on one device and pipelined
    from the same initial values: (reference losses, pipeline losses, reference parameters, pipeline
    parameters, the pipeline's executor)."""
    opts = []
    for net, pipe in zip(nets, (None, pipeline)):
        with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
            opt = optimizer() if pipe is None else staticpipe.PipelineOptimizer(optimizer(), **pipe)
            opt.minimize(net.loss)
            opts.append(opt if pipe is None else opt.inner)
    data = [nets[0].random_batch(8, seed=k) for k in range(steps)]
    scope, ref = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        ref.run(nets[0].startup)
        init = [np.array(scope.find_var(n).get_tensor()) for n in params(nets[0].main)]
        ref_losses = []
        for batch in data:
            ref_losses.append(float(ref.run(nets[0].main, feed=batch, fetch_list=[nets[0].loss])[0]))
            if lr_steps:
                opts[0]._learning_rate.step()
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(nets[1].startup)
    exe.set_state_dict(nets[1].main, dict(zip(params(nets[1].main), init)))
    losses = []
    for batch in data:
        losses.append(float(exe.run(nets[1].main, feed=batch, fetch_list=[nets[1].loss])[0]))
        if lr_steps:
            opts[1]._learning_rate.step()
    state = exe.state_dict(nets[1].main)
    return (ref_losses, losses, [np.array(scope.find_var(n).get_tensor()) for n in params(nets[0].main)],
            [state[n] for n in params(nets[1].main)], exe)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grads", "sparse-grads"])
def test_dlrm_cpu_embeddings_skip_routes_equal_one_device(sparse):
    """``models.build_dlrm`` on 3 stages (cpu, gpu:0, gpu:1): the embeddings' concatenation goes from the
    CPU stage straight to the last stage, whose backward splits its gradient apart (``builtin.split``: values
    the interpreter cannot rename, handed over by fetch and copy); sparse embedding gradients too."""
    from models import build_dlrm

    nets = [build_dlrm(num_stages=3, guarded=g, vocab_size=50, embed_dim=8, is_sparse=sparse) for g in (False, True)]
    ref_losses, losses, ref, state, exe = train_model_twins(nets, lambda: paddle.optimizer.Adam(0.01),
                                                            dict(num_microbatches=2))
    assert [s.device for s in staticpipe.plan_of(nets[1].main).stages] == ["cpu", "gpu:0", "gpu:1"]
    assert_same(ref_losses, losses, ref, state, tol=2e-5)
    exe.close()


def test_recompute_keeps_only_the_inputs_and_trains_alike():
    devices = ["gpu:0", "gpu:1"]
    *result, opt = train_twins(mlp(devices), adam, dict(num_microbatches=4, recompute=True))
    assert_same(*result)
    for stage in opt.plan.stages:
        fwd, bwd = stage.sections["forward"], stage.sections["backward"]
        received = {v.name for r in opt.plan.routes if r.dst == staticpipe.plan.SectionRef(stage.index, "forward")
                    for v in r.vars}
        sent = {v.name for r in opt.plan.routes if r.src == staticpipe.plan.SectionRef(stage.index, "forward")
                for v in r.vars}
        assert set(fwd.keep) == set(fwd.feeds) | received | sent  # nothing the forward computed for itself
        assert stage.recompute and bwd.recomputed_ops == fwd.source_ops


def test_recompute_of_an_in_place_state_update_updates_it_once():
    """Batch norm (``batch_norm_`` updates its running statistics in place) on a recomputed stage: the
    recomputation in the backward updates a copy, so the statistics move once per micro-batch, as one
    device moves them; losses, parameters and statistics as one device per micro-batch."""
    m, rng = 2, np.random.default_rng(1)
    data = [{"x": rng.standard_normal((BATCH, 2, 6, 6)).astype("float32"),
             "y": rng.integers(0, CLASSES, (BATCH, 1)).astype("int64")} for _ in range(3)]
    momentum = lambda: paddle.optimizer.Momentum(0.05, momentum=0.9)  # noqa: E731
    init, ref_losses, ref = reference(convnet(slices=m), momentum, data)
    main, startup, loss, opt = build(convnet(), momentum, dict(num_microbatches=m, recompute=True))
    assert opt.plan.stages[0].recompute
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    exe.set_state_dict(main, dict(zip(params(main), init)))
    losses = [float(exe.run(main, feed=batch, fetch_list=[loss])[0]) for batch in data]
    state = exe.state_dict(main)
    assert_same(ref_losses, losses, ref, [state[n] for n in params(main)], tol=1e-5)  # running statistics too
    exe.close()


@pytest.mark.parametrize("call, what", [
    (lambda main, exe, tmp: staticpipe.save_plan(main, str(tmp / "plan")), "save_plan"),
    (lambda main, exe, tmp: staticpipe.profile(main, batches(1)[0]), "staticpipe.profile"),
])
def test_what_does_not_take_pir_programs_yet_says_so(call, what, tmp_path):
    main, startup, _, _ = build(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2))
    exe = staticpipe.Executor(paddle.CPUPlace())
    with pytest.raises(ValueError, match=rf"^{what} does not take PIR programs yet \(Paddle 3's default IR\); build the "
                                         r"program in legacy-IR mode for it \(STATICPIPE_LEGACY_IR=1, see README\)$"):
        call(main, exe, tmp_path)
    exe.close()


def test_export_inference_gives_the_trained_network(tmp_path):
    """The exported PIR model (Paddle's ``save_inference_model``) computes, from the pipeline's trained state,
    what the same network computes on one device from that state."""
    values = {}
    main, startup, loss, _ = build(mlp(["gpu:0", "gpu:1"], data=values), adam, dict(num_microbatches=2))
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    for batch in batches(2):
        exe.run(main, feed=batch, fetch_list=[loss])
    staticpipe.export_inference(main, [values["x"], values["y"]], [loss], str(tmp_path / "model"), exe)
    trained = [exe.state_dict(main)[n] for n in params(main)]
    exe.close()
    batch = batches(1, seed=7)[0]
    plain = paddle.static.Executor(paddle.CPUPlace())
    program, feeds, fetches = paddle.static.load_inference_model(str(tmp_path / "model"), plain)
    assert sorted(feeds) == ["x", "y"]
    exported = plain.run(program, feed=batch, fetch_list=fetches)[0]
    forward, forward_startup = paddle.static.Program(), paddle.static.Program()  # the same network, no update
    with paddle.utils.unique_name.guard(), paddle.static.program_guard(forward, forward_startup):
        forward_loss = mlp(["gpu:0", "gpu:1"])()
    scope = paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        plain.run(forward_startup)
        for name, value in zip(params(forward), trained):
            scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
        expected = plain.run(forward, feed=batch, fetch_list=[forward_loss])[0]
    np.testing.assert_allclose(exported, expected, rtol=1e-6)


def test_evaluate_and_infer_a_forward_program_on_the_trained_stages():
    """PIR has no ``clone(for_test=True)``: the evaluation program is the forward network built again (same
    names, same guards). Its pipelined evaluation equals one device's on the trained state."""
    data = batches(2)
    main, startup = paddle.static.Program(), paddle.static.Program()

    def linear(x, size, name):  # parameters named by the model, so both programs read the same ones
        return paddle.nn.Linear(x.shape[-1], size, weight_attr=paddle.ParamAttr(name=f"{name}.w"),
                                bias_attr=paddle.ParamAttr(name=f"{name}.b"))(x)

    def network():
        x = paddle.static.data("x", [None, FEATURES], "float32")
        y = paddle.static.data("y", [None, 1], "int64")
        with staticpipe.device_guard("gpu:0"):
            h = paddle.nn.functional.relu(linear(x, 16, "first"))
        with staticpipe.device_guard("gpu:1"):
            return paddle.mean(paddle.nn.functional.cross_entropy(linear(h, CLASSES, "last"), y))

    with paddle.static.program_guard(main, startup):
        loss = network()
        staticpipe.PipelineOptimizer(adam(), num_microbatches=2).minimize(loss)
    evaluation = paddle.static.Program()
    with paddle.static.program_guard(evaluation, paddle.static.Program()):
        eval_loss = network()
    assert sorted(params(evaluation)) == sorted(params(main)) == ["first.b", "first.w", "last.b", "last.w"]
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    exe.run(main, feed=data[0], fetch_list=[loss])
    trained = exe.state_dict(main)

    class Batches:
        def epoch(self):
            return iter(data)

    (mean_loss,) = exe.evaluate(evaluation, Batches(), [eval_loss], num_microbatches=2)
    scope, plain = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    for name in params(evaluation):
        scope.var(name).get_tensor().set(trained[name], paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        expected = np.mean([plain.run(evaluation, feed=b, fetch_list=[eval_loss])[0] for b in data])
    np.testing.assert_allclose(mean_loss, expected, rtol=1e-6)
    assert staticpipe.plan_of(evaluation).schedule == "forward-only"
    exe.close()


def test_infer_from_dataset_of_a_training_program_runs_its_forward_in_test_mode():
    """PIR programs have no ``clone(for_test=True)``: the training program's forward ops are cloned with
    ``is_test`` set. Batch norm then reads its running statistics and leaves them; each step's loss is
    what Paddle's own inference program of the training program (``normalize_program``) computes on one
    device from the trained state, on the step's loader batches (each one micro-batch)."""
    rng = np.random.default_rng(5)
    micro = [(rng.standard_normal((BATCH // 2, 2, 6, 6)).astype("float32"),
              rng.integers(0, CLASSES, (BATCH // 2, 1)).astype("int64")) for _ in range(4)]
    main, startup, loss, _ = build(convnet(), adam, dict(num_microbatches=2))
    data_ops = {op.attrs()["name"]: op for op in main.global_block().ops if op.name() == "pd_op.data"}
    feeds = [data_ops["x"].result(0), data_ops["y"].result(0)]
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    exe.run(main, feed={"x": np.concatenate([m[0] for m in micro[:2]]),
                        "y": np.concatenate([m[1] for m in micro[:2]])}, fetch_list=[loss])
    trained = exe.state_dict(main)
    loader = staticpipe.io.DataLoader.from_generator(feed_list=feeds, capacity=4, iterable=False)
    loader.set_batch_generator(lambda: iter(micro))
    loader.start()
    history = exe.infer_from_dataset(main, loader, fetch_list=[loss])
    assert all(np.array_equal(v, trained[k]) for k, v in exe.state_dict(main).items())  # nothing updated
    inference = paddle.static.normalize_program(main, feeds, [loss])
    scope, plain = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    for name, value in trained.items():
        scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    with paddle.static.scope_guard(scope):
        expected = [plain.run(inference, feed={"x": np.concatenate([micro[k][0], micro[k + 1][0]]),
                                               "y": np.concatenate([micro[k][1], micro[k + 1][1]])})[0]
                    for k in (0, 2)]
    np.testing.assert_allclose([float(np.asarray(h[0])) for h in history], [float(e) for e in expected], rtol=1e-5)
    exe.close()


def test_models_resnet_trains_over_two_stages_as_one_device():
    """models' ResNet-50 (paddle.nn's Conv2D and BatchNorm2D: they build PIR programs) over 2 stages; one
    micro-batch, so batch norm sees the whole batch as on one device. Losses, parameters and running
    statistics as one device, the parameters found by the same names."""
    from functools import partial

    from models import build_resnet
    builder = partial(build_resnet, depth=50, num_stages=2, width=8, image_size=16)
    nets = {}
    for pipelined in (False, True):
        net = nets[pipelined] = builder(guarded=pipelined)
        with paddle.static.program_guard(net.main, net.startup):
            opt = paddle.optimizer.Momentum(0.05, momentum=0.9)
            (staticpipe.PipelineOptimizer(opt, num_microbatches=1) if pipelined else opt).minimize(net.loss)
    assert params(nets[False].main) == params(nets[True].main)
    assert_models_train_alike(nets[False], nets[True])


def assert_models_train_alike(ref, pipe, steps=2):
    """Two steps of a minimized ``models/`` network on one device (``ref``) and pipelined (``pipe``) from the
    same initial values (found by name), on the same batches: losses and final values alike."""
    names = params(ref.main)
    scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
    exe.run(ref.startup, scope=scope)
    runner = staticpipe.Executor(paddle.CPUPlace())
    runner.run(pipe.startup)
    runner.set_state_dict(pipe.main, {n: np.array(scope.find_var(n).get_tensor()) for n in names})
    ref_losses, losses = [], []
    for step in range(steps):
        batch = ref.random_batch(8, seed=step)
        ref_losses.append(float(exe.run(ref.main, feed=batch, fetch_list=[ref.loss], scope=scope)[0]))
        losses.append(float(runner.run(pipe.main, feed=batch, fetch_list=[pipe.loss])[0]))
    state = runner.state_dict(pipe.main)
    assert_same(ref_losses, losses, [np.array(scope.find_var(n).get_tensor()) for n in names],
                [state[n] for n in names], tol=1e-5)
    runner.close()


@pytest.mark.parametrize("policy, devices, schedule", [("uniform", ["gpu:0", "gpu:1"], "1F1B"),
                                                       ("params", ["gpu:0", "gpu:1", "gpu:1", "gpu:0"], "ZB-V")])
def test_auto_place_tags_a_pir_program_that_trains_as_one_device(policy, devices, schedule):
    """auto_place reads a PIR program through its view and writes the devices (and, where two stages share
    a device, a split point) on its operations; the pipeline then trains as one device."""
    from models import build_gpt
    net, ref = build_gpt(num_stages=1, guarded=False, n_layers=4), build_gpt(num_stages=1, guarded=False, n_layers=4)
    placement = staticpipe.auto_place(net.main, devices=devices, policy=policy, schedule=schedule, num_microbatches=4)
    assert [s.device for s in placement.stages] == devices
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=4, schedule=schedule)
        opt.minimize(net.loss)
    assert opt.plan.devices == devices
    with paddle.static.program_guard(ref.main, ref.startup):
        paddle.optimizer.SGD(0.1).minimize(ref.loss)
    assert_models_train_alike(ref, net)


def test_auto_place_of_a_pir_program_by_measured_times_says_what_to_do():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        mlp(["gpu:0"])()
    with pytest.raises(ValueError, match=r"^auto_place of a PIR program takes no profile= or feed= yet \(staticpipe"
                                         r"\.profile reads legacy programs only\): use policy 'uniform' or 'params'"):
        staticpipe.auto_place(main, 2, feed=batches(1)[0])

