"""Mixed precision across stages: Paddle's static AMP decorators inside a PipelineOptimizer.

What must hold (and what each test checks against single-device Paddle running the same decorator):
- fp16 dynamic loss scaling: the loss-gradient seed carries the scale and 1/M, the accumulated gradients
  are unscaled once per step, the overflow flag is or-ed over every stage, so an overflow on one stage
  skips every stage's update and every stage's copy of the loss-scale state changes alike;
- bf16: the casts run where their data flows, cut variables may be bfloat16;
- the loss-scale state is in the state dict and in checkpoints, so a resume is exact.

On CPU, Paddle 2.6 has no float16 kernels for its white-list ops: ``decorate`` (fp16 O1) inserts no casts
and its loss scaling runs in float32, so pipeline and reference compute the same numbers up to summation
order (tolerance 1e-5, as for fp32). ``decorate_bf16`` casts and runs bfloat16 kernels; there the
reference is Paddle's gradient merge over the same micro-batches (a bf16 matmul rounds its per-batch sum
once, so micro-batches round differently from one whole batch by up to bf16's 2^-8; per micro-batch, the
pipeline's float32 accumulation is the reference's, to 1e-5).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import partial

import pytest

import staticpipe
from models import build_gpt, build_mlp
from pipeline_util import (assert_adam_family_training, gradient_merge_twins, minimize, needs_cpu_bf16,
                           train_twins)
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {
    "F-then-B": ["gpu:0", "gpu:1", "gpu:2"],
    "1F1B": ["gpu:0", "gpu:1"],
    "interleaved": ["gpu:0", "gpu:1", "gpu:0", "gpu:1"],
    "ZB-H1": ["gpu:0", "gpu:1", "gpu:2"],
    "ZB-V": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "V-Min": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "V-Half": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
    "ZB-2P": ["gpu:0", "gpu:1", "gpu:2"],
    "Eager1F1B": ["gpu:0", "gpu:1"],
    "DualPipeV": ["gpu:0", "gpu:1", "gpu:1", "gpu:0"],
}
INIT_SCALE = 2.0 ** 15


def fp16(optimizer, **kw):
    """fp16 O1 with dynamic loss scaling that grows every 2 good steps: a 4-step run changes the scale."""
    return paddle.static.amp.decorate(optimizer, init_loss_scaling=INIT_SCALE, incr_every_n_steps=2,
                                      use_dynamic_loss_scaling=True, **kw)


def adamw_clipped(clip=0.5):
    return paddle.optimizer.AdamW(0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))


def loss_scale_names(program) -> dict[str, str]:
    """The loss-scale state of a program minimized by ``paddle.static.amp.decorate``, by its role: the
    scale is what ``check_finite_and_unscale`` divides by, the counters what ``update_loss_scaling`` keeps."""
    [update] = [op for op in program.global_block().ops if op.type == "update_loss_scaling"]
    return {"scale": update.input("PrevLossScaling")[0], "good": update.input("InGoodSteps")[0],
            "bad": update.input("InBadSteps")[0]}


def stage_copies(exe, program, name) -> dict[int, np.ndarray]:
    """Each stage's own copy of ``name`` (stages sharing a device share one)."""
    plan = staticpipe.plan_of(program)
    return {s: np.array(exe._devices.worker(plan.stages[s].device).scope.find_var(name).get_tensor())
            for s in plan.stage_of_var(name)}


def twins(builder, make_opt, batches, **pipeline):
    """Single-device Paddle and the pipeline, same decorator, same initial state, same global batches;
    returns (reference state, pipeline state, reference losses, pipeline losses, executor, network)."""
    ref, pipe = builder(guarded=False), builder()
    minimize(ref, make_opt(), None)
    minimize(pipe, make_opt(), pipeline)
    ref_exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    ref_exe.run(ref.startup, scope=scope)
    exe = staticpipe.Executor()
    exe.run(pipe.startup)
    names = sorted(exe.state_dict(pipe.main))
    exe.set_state_dict(pipe.main, {n: np.array(scope.find_var(n).get_tensor()) for n in names})
    ref_losses, pipe_losses = [], []
    for batch in batches:
        ref_losses.append(float(ref_exe.run(ref.main, feed=batch, fetch_list=[ref.loss.name], scope=scope)[0]))
        pipe_losses.append(float(exe.run(pipe.main, feed=batch, fetch_list=[pipe.loss])[0]))
    reference = {n: np.array(scope.find_var(n).get_tensor()) for n in names}
    return reference, exe.state_dict(pipe.main), ref_losses, pipe_losses, exe, pipe


def assert_same_state(got, want, rtol=1e-5, atol=1e-6):
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
def test_fp16_loss_scaling_equals_single_device(schedule):
    """Every parameter, AdamW moment and the loss-scale state after 4 steps, with global-norm clipping
    (active) after the unscale; the scale doubled twice on every stage."""
    devices = LAYOUTS[schedule]
    builder = partial(build_mlp, num_stages=len(devices), stage_devices=devices, hidden=32, in_dim=16)
    net = builder()
    batches = [net.random_batch(16, seed=s) for s in range(4)]
    ref, got, ref_losses, losses, exe, pipe = twins(builder, lambda: fp16(adamw_clipped()), batches,
                                                    num_microbatches=4, schedule=schedule)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_same_state(got, ref)
    names = loss_scale_names(pipe.main)
    assert ref[names["scale"]].item() == INIT_SCALE * 4
    for name in names.values():  # each stage's own copy, not just the one state_dict shows
        copies = stage_copies(exe, pipe.main, name)
        assert sorted(copies) == list(range(len(devices)))
        for value in copies.values():
            np.testing.assert_array_equal(value, ref[name], err_msg=name)
    exe.close()


def test_an_overflow_on_one_stage_skips_every_stage():
    """The first layer's weight row for feature 0 is zero, and one sample's feature 0 is 3e38: the
    forward is finite everywhere, but that weight's scaled gradient (stage 0 only) overflows. No stage
    updates (AdamW skips parameters and moments), every stage halves its scale and counts a bad step,
    like single-device Paddle; the next step trains again everywhere."""
    builder = partial(build_mlp, num_stages=3, hidden=32, in_dim=16)
    net = builder()
    first_weight = next(op.input("Y")[0] for op in net.main.global_block().ops if op.type in ("mul", "matmul_v2"))
    batches = [net.random_batch(16, seed=s) for s in range(2)]
    batches[0]["features"][5, 0] = 3e38
    ref_net = builder(guarded=False)
    minimize(ref_net, fp16(paddle.optimizer.AdamW(0.01)), None)
    minimize(net, fp16(paddle.optimizer.AdamW(0.01)), dict(num_microbatches=4))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    weight = exe.state_dict(net.main)[first_weight]
    weight[0] = 0.0
    exe.set_state_dict(net.main, {first_weight: weight})
    before = exe.state_dict(net.main)
    ref_exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    ref_exe.run(ref_net.startup, scope=scope)
    for name, value in before.items():
        scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    names = loss_scale_names(net.main)

    loss, = exe.run(net.main, feed=batches[0], fetch_list=[net.loss])
    ref_exe.run(ref_net.main, feed=batches[0], scope=scope)
    assert np.isfinite(loss)
    after = exe.state_dict(net.main)
    changed = [n for n in before if n not in names.values() and not np.array_equal(after[n], before[n])]
    assert changed == []
    for role, want in (("scale", INIT_SCALE / 2), ("good", 0), ("bad", 0)):  # decr_every_n_nan_or_inf=1
        copies = stage_copies(exe, net.main, names[role])
        assert sorted(copies) == [0, 1, 2]
        assert all(v.item() == want for v in copies.values()), (role, copies)
        assert np.array(scope.find_var(names[role]).get_tensor()).item() == want

    exe.run(net.main, feed=batches[1])
    ref_exe.run(ref_net.main, feed=batches[1], scope=scope)
    trained = exe.state_dict(net.main)
    assert all(not np.array_equal(trained[p.name], after[p.name]) for p in net.main.all_parameters())
    assert_same_state(trained, {n: np.array(scope.find_var(n).get_tensor()) for n in trained})
    exe.close()


@needs_cpu_bf16
@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
def test_bf16_equals_single_device_gradient_merge(schedule):
    """decorate_bf16 casts parameters and activations and runs bfloat16 kernels; activations cross the
    stages as bfloat16 (half the bytes); every parameter and moment equals Paddle's gradient merge of the
    same AMP program over the same micro-batches."""
    devices = LAYOUTS[schedule]
    builder = partial(build_mlp, num_stages=len(devices), stage_devices=devices, hidden=32, in_dim=16)
    _, _, trained = gradient_merge_twins(
        builder, lambda: paddle.static.amp.bf16.decorate_bf16(adamw_clipped()), microbatches=4, steps=3,
        evaluate=False, schedule=schedule)
    net = builder()
    minimize(net, paddle.static.amp.bf16.decorate_bf16(adamw_clipped()), dict(num_microbatches=4, schedule=schedule))
    dtypes = {v.dtype for r in staticpipe.plan_of(net.main).routes for v in r.vars}
    assert dtypes == {"uint16"}  # Paddle's numpy stand-in for bfloat16
    assert "bfloat16" in str(staticpipe.plan_of(net.main))


@pytest.mark.parametrize("amp", ["fp16", pytest.param("bf16", marks=needs_cpu_bf16)])
def test_gpt_tied_embedding_adamw_clipping_over_four_stages(amp):
    """The GPT's token table is read on the first and the last stage (a shared parameter: partial
    gradients sent to its owner, the new value sent back), under AMP with clipping after the unscale."""
    builder = partial(build_gpt, num_stages=4)
    if amp == "fp16":  # AdamW: parameters compared up to the reference's own rounding noise (pipeline_util)
        twin = train_twins(builder, lambda: fp16(adamw_clipped(0.3)), steps=3, batch_size=8, noise=True,
                           num_microbatches=4)
        assert_adam_family_training(twin)
        assert twin.plan.shared  # the tied embedding
    else:
        gradient_merge_twins(builder, lambda: paddle.static.amp.bf16.decorate_bf16(adamw_clipped(0.3)),
                             microbatches=4, steps=2, batch_size=8, evaluate=False)


@pytest.mark.parametrize("amp", ["fp16", pytest.param("bf16-pure", marks=needs_cpu_bf16)])
def test_checkpoint_carries_the_amp_state_and_resumes_exactly(tmp_path, amp):
    """fp16: the loss scale and its counters; pure bf16: bfloat16 parameters and float32 master weights."""
    builder = partial(build_mlp, num_stages=2, hidden=32, in_dim=16)
    net = builder()
    batches = ([net.random_batch(16, seed=s) for s in range(4)] if amp == "fp16"
               else [bf16_batch(net, s) for s in range(4)])

    def trainer():
        net = builder()
        minimize(net, fp16(paddle.optimizer.AdamW(0.01)) if amp == "fp16" else pure_bf16(), dict(num_microbatches=4))
        exe = staticpipe.Executor()
        exe.run(net.startup)
        return net, exe

    net, exe = trainer()
    for batch in batches:
        exe.run(net.main, feed=batch)
    straight = exe.state_dict(net.main)
    exe.close()
    net, exe = trainer()
    for batch in batches[:3]:
        exe.run(net.main, feed=batch)
    staticpipe.save(net.main, str(tmp_path / "ckpt"), exe)
    exe.close()
    net, exe = trainer()
    staticpipe.load(net.main, str(tmp_path / "ckpt"), exe)
    exe.run(net.main, feed=batches[3])
    resumed = exe.state_dict(net.main)
    exe.close()
    if amp == "fp16":
        names = loss_scale_names(net.main)
        assert straight[names["scale"]].item() == INIT_SCALE * 4 and straight[names["good"]].item() == 0
    else:
        masters = [op.input("MasterParam")[0] for op in net.main.global_block().ops if op.type == "sgd"]
        assert len(masters) == len(net.main.all_parameters()) and all(straight[n].dtype == np.float32 for n in masters)
    assert sorted(resumed) == sorted(straight)
    for name, value in straight.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)


def test_verify_checks_amp_programs():
    net = build_mlp(num_stages=2, hidden=32, in_dim=16)
    minimize(net, fp16(adamw_clipped()), dict(num_microbatches=4))
    report = staticpipe.verify(net.main, [net.random_batch(16, seed=s) for s in range(3)], net.startup)
    assert report.ok, str(report)
    for name in loss_scale_names(net.main).values():  # compared like any state, step by step
        assert report.max_diff[name] == [0.0, 0.0, 0.0], name


def test_the_decorator_goes_inside_the_pipeline_optimizer():
    """PipelineOptimizer(decorate(opt)) is the order that works; Paddle's decorators refuse to wrap a
    PipelineOptimizer, or it refuses their calls, each naming the fix."""
    pipe = staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.1), num_microbatches=2)
    with pytest.raises(RuntimeError, match="optimizer is expected to be paddle.optimizer.Optimizer, but receive "
                                           "<class 'staticpipe.optimizer.PipelineOptimizer'>"):
        paddle.static.amp.decorate(pipe)
    class Custom:  # has a minimize, but staticpipe knows only how Paddle's optimizers write the program
        def minimize(self, loss, **kwargs):
            return [], []

    with pytest.raises(ValueError, match=r"decorate_bf16\), got test_amp\.test_the_decorator_goes_inside_the_pipeline_"
                                         r"optimizer\.<locals>\.Custom$"):
        staticpipe.PipelineOptimizer(Custom())
    with pytest.raises(AttributeError) as err:
        paddle.static.amp.bf16.decorate_bf16(pipe)
    assert str(err.value).endswith("wrap the AMP-decorated optimizer in it instead: "
                                   "PipelineOptimizer(paddle.static.amp.decorate(optimizer), ...)")


DP_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import paddle
net = build_mlp(num_stages=2, hidden=32, in_dim=16)
minimize(net, paddle.static.amp.decorate(paddle.optimizer.AdamW(0.01), init_loss_scaling=2.0 ** 15,
                                         incr_every_n_steps=2), dict(num_microbatches=2, dp_degree=2))
exe = staticpipe.Executor()
exe.run(net.startup)
exe.set_state_dict(net.main, dict(np.load(os.path.join(os.environ["OUT"], "initial.npz"))), strict=False)
rank = os.environ["PADDLE_TRAINER_ID"]
for step in range(2):
    batch = dict(np.load(os.path.join(os.environ["OUT"], f"batch_{{step}}.npz")))
    exe.run(net.main, feed=batch)
    np.savez(os.path.join(os.environ["OUT"], f"state_{{rank}}_{{step}}.npz"), **exe.state_dict(net.main))
"""


def test_data_parallel_replicas_agree_on_an_overflow_in_one_replica(tmp_path):
    """dp=2 x pp=2 on 4 processes; the overflowing sample is in the second replica's half of the batch
    (its stage 0 alone overflows): the replicas average their gradients before the check, so all four
    ranks skip the step and halve their scale; the next step equals single-device Paddle."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    net, ref = build_mlp(num_stages=2, hidden=32, in_dim=16), build_mlp(num_stages=2, hidden=32, in_dim=16, guarded=False)
    minimize(ref, fp16(paddle.optimizer.AdamW(0.01)), None)
    first_weight = next(op.input("Y")[0] for op in ref.main.global_block().ops if op.type in ("mul", "matmul_v2"))
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(ref.startup, scope=scope)
    names = [v.name for v in ref.main.list_vars() if v.persistable and v.name not in ("feed", "fetch")]
    scope.find_var(first_weight).get_tensor().set(
        np.where(np.arange(16)[:, None] == 0, 0, np.array(scope.find_var(first_weight).get_tensor())).astype("float32"),
        paddle.CPUPlace())
    initial = {n: np.array(scope.find_var(n).get_tensor()) for n in names}
    np.savez(tmp_path / "initial.npz", **initial)
    batches = [net.random_batch(16, seed=s) for s in range(2)]
    batches[0]["features"][12, 0] = 3e38  # sample 12: the second replica's half
    for step, batch in enumerate(batches):
        np.savez(tmp_path / f"batch_{step}.npz", **batch)
    (tmp_path / "train.py").write_text(DP_SCRIPT.format(repo=repo, tests=os.path.join(repo, "tests")))
    result = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "4", str(tmp_path / "train.py")],
                            env=dict(os.environ, OUT=str(tmp_path), PYTHONPATH=repo), capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    scale = loss_scale_names(ref.main)["scale"]
    for rank in range(4):
        skipped = dict(np.load(tmp_path / f"state_{rank}_0.npz"))
        assert skipped[scale].item() == INIT_SCALE / 2, rank
        assert all(np.array_equal(v, initial[n]) for n, v in skipped.items() if n != scale), rank
    for batch in batches:
        exe.run(ref.main, feed=batch, scope=scope)
    for replica in (0, 1):
        got = {**np.load(tmp_path / f"state_{2 * replica}_1.npz"), **np.load(tmp_path / f"state_{2 * replica + 1}_1.npz")}
        assert_same_state(got, {n: np.array(scope.find_var(n).get_tensor()) for n in names}, atol=1e-7)


def pure_bf16():
    """Parameters, activations and feeds in bfloat16, float32 master weights (on CPU Paddle's bf16 SGD
    kernel is the one optimizer with a bfloat16 kernel)."""
    return paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.SGD(0.1, multi_precision=True),
                                                use_pure_bf16=True, use_bf16_guard=False)


def bf16_batch(net, seed):
    batch = net.random_batch(16, seed=seed)
    batch["features"] = paddle.static.amp.bf16.amp_utils.convert_float_to_uint16(batch["features"])
    return batch


@needs_cpu_bf16
def test_pure_bf16_starts_like_amp_init_and_trains_like_one_device():
    """Executor.run(startup) stores each stage's parameters as the program declares them (bfloat16), as
    Paddle's amp_init does on one device: the initial state equals it bit for bit. With one micro-batch
    a step equals the single-device step bit for bit; with four, every schedule gives the same bits
    (gradients of low precision accumulate in float32 buffers, in micro-batch order)."""
    ref = build_mlp(num_stages=2, hidden=32, in_dim=16, guarded=False)
    with paddle.static.program_guard(ref.main, ref.startup), paddle.utils.unique_name.guard():
        amp = pure_bf16()
        amp.minimize(ref.loss)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(ref.startup, scope=scope)
    amp.amp_init(paddle.CPUPlace(), scope=scope)
    batches = [bf16_batch(ref, s) for s in range(3)]

    def pipeline(devices, schedule, microbatches):
        net = build_mlp(num_stages=len(devices), stage_devices=devices, hidden=32, in_dim=16)
        opt = minimize(net, pure_bf16(), dict(num_microbatches=microbatches, schedule=schedule))
        pipe = staticpipe.Executor()
        pipe.run(net.startup)
        opt.amp_init(paddle.CPUPlace())
        initial = pipe.state_dict(net.main)
        for batch in batches:
            pipe.run(net.main, feed=batch)
        state = pipe.state_dict(net.main)
        pipe.close()
        return net, initial, state

    net, initial, one = pipeline(["gpu:0", "gpu:1"], "1F1B", 1)
    assert {initial[p.name].dtype for p in net.main.all_parameters()} == {np.dtype("uint16")}
    assert sorted(initial) == sorted(n for n in initial if scope.find_var(n) is not None)
    for name, value in initial.items():
        np.testing.assert_array_equal(value, np.array(scope.find_var(name).get_tensor()), err_msg=name)
    for batch in batches:
        exe.run(ref.main, feed=batch, scope=scope)
    for name, value in one.items():
        np.testing.assert_array_equal(value, np.array(scope.find_var(name).get_tensor()), err_msg=name)
    runs = [pipeline(devices, schedule, 4)[2] for schedule, devices in
            (("1F1B", ["gpu:0", "gpu:1"]), ("F-then-B", ["gpu:0", "gpu:1"]), ("ZB-V", LAYOUTS["ZB-V"]))]
    for other in runs[1:]:
        for name, value in runs[0].items():
            np.testing.assert_array_equal(other[name], value, err_msg=name)
    with pytest.raises(ValueError, match="amp_init\\(test_program=...\\): casting an evaluation program"):
        minimize(build_mlp(num_stages=2), pure_bf16(), dict(num_microbatches=2)).amp_init(
            paddle.CPUPlace(), test_program=ref.main)


def test_amp_levels_that_would_do_nothing_on_cpu_are_refused():
    net = build_mlp(num_stages=2, hidden=32, in_dim=16)
    before = len(net.main.global_block().ops)
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(ValueError) as err:
            minimize(net, paddle.static.amp.decorate(paddle.optimizer.AdamW(0.01, multi_precision=True), level="O2",
                                                     dtype=dtype), dict(num_microbatches=2))
        assert str(err.value) == (
            f"paddle.static.amp.decorate(level='O2', dtype='{dtype}') needs CUDA: on CPU Paddle has no {dtype} "
            f"kernels for its white-list ops, casts nothing and would train in float32; use "
            "paddle.static.amp.bf16.decorate_bf16 for bfloat16 on CPU")
    assert len(net.main.global_block().ops) == before  # refused before anything was added
    with pytest.raises(ValueError, match="^amp_init before minimize: call minimize"):
        staticpipe.PipelineOptimizer(pure_bf16()).amp_init(paddle.CPUPlace())


@needs_cpu_bf16
def test_bf16_parameter_copies_are_held_once_per_stage_not_per_micro_batch():
    """O1 casts every weight to bfloat16 in front of its matmul; the copy is the same for every micro-batch
    of a step, so each stage holds one (in its scope) instead of one per micro-batch in flight: the
    activations kept between forward and backward are then about half of fp32's (bfloat16 matmul outputs;
    the last stage also keeps a float32 copy of the logits for the loss), where a copy per micro-batch would
    add the weights' bf16 bytes times the micro-batches in flight (here more than fp32's whole count). The copies
    are not state (not in the state dict); recompute works with them; training still equals the merge."""
    def kept(make_opt, recompute=False):
        net = build_mlp(num_stages=2, hidden=256, in_dim=64)
        minimize(net, make_opt(), dict(num_microbatches=4, recompute=recompute))
        exe = staticpipe.Executor()
        exe.run(net.startup)
        exe.run(net.main, feed=net.random_batch(32))
        stats, state = exe.memory_stats(), exe.state_dict(net.main)
        exe.close()
        step_values = {s: m["step_value_bytes"] for s, m in stats.items()}
        params = {s: sum(state[p].nbytes for p in stage.parameters)
                  for s, stage in enumerate(staticpipe.plan_of(net.main).stages)}
        return {s: m["peak_activation_bytes"] for s, m in stats.items()}, sorted(state), step_values, params

    fp32, fp32_state, none, _ = kept(adamw_clipped)
    bf16, bf16_state, copies, params = kept(lambda: paddle.static.amp.bf16.decorate_bf16(adamw_clipped()))
    assert none == {0: 0, 1: 0}
    assert copies == {s: params[s] // 2 for s in params}  # one bf16 copy of each float32 parameter, counted
    assert sorted(bf16) == sorted(fp32) == [0, 1]
    assert all(0 < bf16[s] < 0.55 * fp32[s] for s in fp32), (bf16, fp32)
    assert bf16_state == fp32_state
    gradient_merge_twins(partial(build_mlp, num_stages=2, hidden=32, in_dim=16),
                         lambda: paddle.static.amp.bf16.decorate_bf16(adamw_clipped()), microbatches=4, steps=2,
                         evaluate=False, recompute=True)


BF16_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import paddle
net = build_mlp(num_stages=2, hidden=32, in_dim=16)
minimize(net, paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.AdamW(0.01)), dict(num_microbatches=4))
exe = staticpipe.Executor()
exe.run(net.startup)
for step in range(3):
    exe.run(net.main, feed=net.random_batch(16, seed=step))
rank = os.environ.get("PADDLE_TRAINER_ID", "single")
np.savez(os.path.join(os.environ["OUT"], f"state_{{rank}}.npz"), **exe.state_dict(net.main))
"""


@needs_cpu_bf16
def test_bf16_cut_variables_cross_processes(tmp_path):
    """decorate_bf16 on 2 launched processes: bfloat16 activations and gradients cross gloo (as Paddle's
    uint16 stand-in) and arrive as bfloat16; the state equals the threaded run's bit for bit."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "train.py").write_text(BF16_SCRIPT.format(repo=repo, tests=os.path.join(repo, "tests")))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=repo)
    for cmd in ([sys.executable, str(tmp_path / "train.py")],
                [sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", str(tmp_path / "train.py")]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-2000:]
    single = dict(np.load(tmp_path / "state_single.npz"))
    launched = {**np.load(tmp_path / "state_0.npz"), **np.load(tmp_path / "state_1.npz")}
    assert sorted(launched) == sorted(single)
    for name, value in single.items():
        np.testing.assert_array_equal(launched[name], value, err_msg=name)


def test_a_cut_variable_whose_dtype_the_stages_disagree_on_stops_the_step_naming_it():
    """The dtype of a cut variable is part of the boundary contract: the receiver (in another process:
    from the plan alone) expects what the program declares. Here the program declares the activation
    float16 (as an AMP list would) while the producing kernel computes float32: the sending stage stops
    the step with an error naming the variable, both dtypes and the action, and nothing is updated."""
    net = build_mlp(num_stages=2, hidden=32, in_dim=16)
    cut = [op.output("Out")[0] for op in net.main.global_block().ops if op.type == "relu"][1]  # stage 0's last
    net.main.global_block().var(cut).desc.set_dtype(paddle.base.core.VarDesc.VarType.FP16)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    before = exe.state_dict(net.main)
    with pytest.raises(staticpipe.StageError) as err:
        exe.run(net.main, feed=net.random_batch(8))
    assert str(err.value) == (f"stage 0 (gpu:0) failed in action 0SEND_F0>1: ValueError: cut variable '{cut}' has dtype "
                              "float32, but the plan compiled float16")
    after = exe.state_dict(net.main)
    assert all(np.array_equal(after[n], v) for n, v in before.items())
    exe.close()


def frozen_first_stage(guarded=True):
    """The MLP with stage 0's two layers frozen (fine-tuning): stage 0 trains nothing, holds no gradient."""
    from pipeline_util import dense_layers
    net = build_mlp(num_stages=2, hidden=32, in_dim=16, guarded=guarded)
    frozen = {name for layer in dense_layers(net.main)[:2] for name in layer}
    for param in net.main.all_parameters():
        param.stop_gradient = param.name in frozen
    return net


def test_a_stage_without_gradients_still_checks_and_keeps_the_loss_scale():
    """Paddle's loss-scaling kernels need at least one gradient; a stage that trains nothing still takes part
    in the overflow vote (with a zero) and keeps its copy of the scale, which its neighbours update alike."""
    net = frozen_first_stage()
    batches = [net.random_batch(16, seed=s) for s in range(4)]
    ref, got, ref_losses, losses, exe, pipe = twins(frozen_first_stage, lambda: fp16(adamw_clipped()), batches,
                                                    num_microbatches=4)
    assert not staticpipe.plan_of(pipe.main).stages[0].grad_buffers  # stage 0 really trains nothing
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_same_state(got, ref)
    scale = loss_scale_names(pipe.main)["scale"]
    assert {s: v.item() for s, v in stage_copies(exe, pipe.main, scale).items()} == {0: INIT_SCALE * 4,
                                                                                      1: INIT_SCALE * 4}
    exe.close()


@needs_cpu_bf16
def test_bfloat16_fetches_evaluation_and_verify_see_numbers_not_bit_patterns():
    """Paddle hands bfloat16 values out as uint16 bit patterns: the mean of a step's micro-batch losses,
    an evaluation's mean and verify's differences must be taken on the numbers. Pure bf16, 2 micro-batches:
    the fetched loss is the mean of single-device Paddle's two half-batch losses (to bf16 rounding)."""
    from staticpipe.ir import as_float
    bf16 = paddle.base.core.VarDesc.VarType.BF16
    net, ref = build_mlp(num_stages=2, hidden=32, in_dim=16), build_mlp(num_stages=2, hidden=32, in_dim=16,
                                                                        guarded=False)
    minimize(net, pure_bf16(), dict(num_microbatches=2))
    minimize(ref, pure_bf16(), None)
    test = net.main.clone(for_test=True)  # after minimize: its parameters are bfloat16 too
    ref_test = ref.main.clone(for_test=True)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    batch = net.random_batch(16, seed=0)
    batch["features"][8:] *= 40  # the halves' losses differ in exponent: averaging bit patterns would show
    batch["features"] = paddle.static.amp.bf16.amp_utils.convert_float_to_uint16(batch["features"])
    rexe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    rexe.run(ref.startup, scope=scope)
    for name, value in exe.state_dict(net.main).items():
        scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
    halves = [rexe.run(ref_test, feed={k: v[h * 8:(h + 1) * 8] for k, v in batch.items()}, fetch_list=[ref.loss.name],
                       scope=scope)[0] for h in (0, 1)]
    assert all(h.dtype == np.uint16 for h in halves)  # Paddle's own fetch: bit patterns
    want = np.mean([as_float(h, bf16) for h in halves])
    assert max(as_float(h, bf16).item() for h in halves) > 2 * min(as_float(h, bf16).item() for h in halves)

    class OneBatch:
        def epoch(self):
            yield batch

    evaluated = exe.evaluate(test, OneBatch(), [net.loss.name], num_microbatches=2, like=net.main)[0]
    np.testing.assert_allclose(float(evaluated), want, rtol=2 ** -7)  # before the step changes the state
    [loss] = exe.run(net.main, feed=batch, fetch_list=[net.loss])
    assert loss.dtype == np.uint16  # as Paddle gives bfloat16
    np.testing.assert_allclose(as_float(loss, bf16), want, rtol=2 ** -7)  # the mean, rounded to bfloat16
    report = staticpipe.verify(net.main, [batch], net.startup, steps=1, rtol=2 ** -6, atol=2 ** -8)
    assert all(0.5 < loss < 1000 for loss in report.pipeline_losses + report.reference_losses)
    assert max(d[-1] for d in report.max_diff.values()) < 0.05, report.max_diff
    exe.close()


@pytest.mark.parametrize("schedule", ["ZB-H1", "ZB-V"])
def test_zero_bubble_keeps_the_weight_gradient_matmuls_in_w_under_amp(schedule, bf16_kernels_assumed):
    """Under O1 a matmul's weight gradient is the gradient of the weight's bf16 copy: it still belongs to
    the W half of the backward (else the split buys nothing and B keeps weight-sized gradients for W)."""
    devices = LAYOUTS[schedule]
    for make_opt in (adamw_clipped, lambda: paddle.static.amp.bf16.decorate_bf16(adamw_clipped())):
        net = build_mlp(num_stages=len(devices), stage_devices=devices, hidden=32, in_dim=16)
        minimize(net, make_opt(), dict(num_microbatches=4, schedule=schedule))
        for stage in staticpipe.plan_of(net.main).stages:
            ops = lambda kind: [op.type for op in stage.sections[kind].program.global_block().ops]  # noqa: E731
            assert ops("weight").count("mul_grad") == ops("forward").count("mul") >= 1, (stage.index, ops("weight"))


def test_low_precision_cross_stage_sums_travel_as_float32(bf16_kernels_assumed):
    """Pure bf16 with a global-norm clip: each stage's part of the norm is bfloat16. Parts are added by
    the channel (numpy on threads, gloo between processes), which would add bfloat16 bit patterns as
    integers, so the plan casts each part to float32 for the all-reduce and the total back. (Built only:
    Paddle 2.6 has no CPU bfloat16 kernel for the clip's squared_l2_norm.)"""
    net = build_mlp(num_stages=3, hidden=32, in_dim=16)
    minimize(net, paddle.static.amp.bf16.decorate_bf16(
        paddle.optimizer.SGD(0.1, multi_precision=True, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0)),
        use_pure_bf16=True, use_bf16_guard=False), dict(num_microbatches=2))
    plan = staticpipe.plan_of(net.main)
    sums = [ex for ex in plan.exchanges if ex.kind == "sum"]
    assert sums and all(v.dtype == "float32" for ex in sums for v in ex.vars)
    bf16 = paddle.base.core.VarDesc.VarType.BF16
    for stage in plan.stages:
        block = stage.sections["optimize"].program.global_block()
        for ex in sums:
            [reduce_op] = [op for op in block.ops if op.output_arg_names == list(ex.recv_as)]
            [cast_back] = [op for op in block.ops if op.type == "cast" and op.input("X") == list(ex.recv_as)]
            assert block.var(reduce_op.input_arg_names[0]).dtype == paddle.base.core.VarDesc.VarType.FP32
            assert block.var(cast_back.output("Out")[0]).dtype == bf16


@pytest.mark.parametrize("amp", ["fp16", pytest.param("bf16", marks=needs_cpu_bf16)])
def test_the_gpt_example_trains_with_amp(amp, tmp_path):
    """examples/train_gpt.py --amp: verify passes at the precision's tolerance, the loss falls."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, os.path.join(repo, "examples", "train_gpt.py"), "--steps", "6",
                             "--amp", amp], capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^staticpipe\.verify: OK after 3 steps", result.stdout, re.M), result.stdout[-3000:]
    first, last = (float(x) for x in re.search(r"loss ([\d.]+) -> ([\d.]+);", result.stdout).groups())
    assert last < first


def test_check_finite_leaves_the_loss_scalers_overflows_to_it_and_still_stops_a_nan_forward():
    """With ``check_finite=True`` and dynamic loss scaling, an overflow in the backward (the first weight's
    row for feature 0 is zero and one sample's feature 0 is 3e38: the forward is finite, that weight's
    scaled gradient is not) is the scaler's: the step is skipped and the scale halved, exactly as on one
    device without the check (the check raised a NonFiniteError on it, so the scale never dropped). A NaN
    in the forward is still stopped, naming the stage, the action, the op and the variable."""
    builder = partial(build_mlp, num_stages=2, hidden=16, in_dim=8)
    net, ref = builder(), builder(guarded=False)
    minimize(ref, fp16(paddle.optimizer.SGD(0.1)), None)
    minimize(net, fp16(paddle.optimizer.SGD(0.1)), dict(num_microbatches=4))
    first_weight = next(op.input("Y")[0] for op in net.main.global_block().ops if op.type in ("mul", "matmul_v2"))
    exe = staticpipe.Executor(check_finite=True)
    exe.run(net.startup)
    weight = exe.state_dict(net.main)[first_weight]
    weight[0] = 0.0
    exe.set_state_dict(net.main, {first_weight: weight})
    ref_exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    ref_exe.run(ref.startup, scope=scope)
    for name, value in exe.state_dict(net.main).items():
        scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    scale = loss_scale_names(net.main)["scale"]
    for step in range(3):
        batch = net.random_batch(8, seed=step)
        if step == 0:
            batch["features"][5, 0] = 3e38
        loss, = exe.run(net.main, feed=batch, fetch_list=[net.loss])
        want, = ref_exe.run(ref.main, feed=batch, fetch_list=[ref.loss], scope=scope)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        if step == 0:
            assert all(v.item() == INIT_SCALE / 2 for v in stage_copies(exe, net.main, scale).values())
    assert_same_state(exe.state_dict(net.main), {n: np.array(scope.find_var(n).get_tensor())
                                                 for n in exe.state_dict(net.main)})

    batch = net.random_batch(8, seed=9)
    batch["features"][6, 2] = np.nan  # row 6: micro-batch 3 of 4
    with pytest.raises(staticpipe.NonFiniteError, match=r"stage 0 \(gpu:0\) failed in action 0F3: the first "
                       r"non-finite value: op '\w+' wrote \d+ NaN and 0 Inf into '[^']+'") as err:
        exe.run(net.main, feed=batch, fetch_list=[net.loss])
    writer = next(op.type for op in net.main.global_block().ops if err.value.variable in op.output_arg_names)
    assert err.value.op == writer
    exe.close()

