"""What only PIR programs (Paddle 3's default IR) have: nothing here has a legacy-IR counterpart.

Feature tests run on both IRs from one body: they take the ``program_ir`` fixture (conftest.py), and a test
training a pipeline against one device without it fails (``pipeline_util.check_ir_coverage``). Schedules,
optimizers, clipping, tied parameters, models' networks (GPT, DLRM, ResNet), batch norm, recompute,
checkpoints, ``verify``, ``evaluate``, ``infer_from_dataset``, ``train_from_dataset`` from a started loader
and ``export_inference`` are tested so in their own files (test_equivalence.py, test_training_parity.py,
test_schedules_train.py, test_checkpoint.py, test_verify.py, test_paddle_script.py, ...). This file holds,
each under ``paddle.pir_utils.IrGuard``: how ``PirView`` names a PIR program's values in a plan (its cut
values and their gradients), the refusal to fetch a value of another program (legacy programs fetch by
name), the refusal of ``paddle.static.amp`` on PIR (which leaves the program unchanged), and what
``auto_place`` and ``profile`` do with PIR programs.
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


def test_plan_names_the_cut_values_with_static_shapes():
    _, _, _, opt = build(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2, micro_batch_size=8))
    text = str(opt.plan)
    cut = [v for r in opt.plan.routes for v in r.vars]
    assert [v.shape for v in cut] == [(-1, 16), (-1, 16)] and [v.dtype for v in cut] == ["float32"] * 2
    assert cut[1].name == cut[0].name + "@GRAD"
    assert f"{cut[0].name} [8, 16] float32" in text and "stage 0 forward -> stage 1 forward" in text
    assert opt.plan.data_vars == {"x": (0,), "y": (1,)}


def test_a_value_of_another_program_cannot_be_fetched():
    main, startup, loss, _ = build(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2))
    _, _, other_loss, _ = build(mlp(["gpu:0", "gpu:1"]), adam)
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(startup)
    with pytest.raises(ValueError, match=r"fetch_list\[0\]: the value is not one of this program's values"):
        exe.run(main, feed=batches(1)[0], fetch_list=[other_loss])
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


def test_profile_of_a_differentiated_pir_program_says_what_to_do():
    """A PIR program's backward ops do not say which forward op they belong to once built (staticpipe reads it
    from Paddle's backward while it differentiates): profile and auto_place by measured times take the forward
    program, and say so for a program that Paddle's own minimize (which sets no op roles) or a pipeline's
    minimize has differentiated."""
    plain, _, _, _ = build(mlp(["gpu:0"]), adam)
    piped, _, _, _ = build(mlp(["gpu:0", "gpu:1"]), adam, dict(num_microbatches=2))
    for main in (plain, piped):
        with pytest.raises(ValueError, match=r"^staticpipe.profile takes a PIR program before minimize \(the forward "
                                             r"program, as auto_place and auto_plan do\)"):
            staticpipe.profile(main, batches(1)[0])
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        mlp(["gpu:0"])()
    with pytest.raises(ValueError, match=r"^auto_plan of a PIR program takes the loss as its value"):
        staticpipe.auto_plan(main, "loss", adam, ["gpu:0", "gpu:1"], 2, feed=batches(1)[0])

