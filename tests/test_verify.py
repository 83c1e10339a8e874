"""staticpipe.verify: the equivalence oracle reports real drift and real placement errors."""
from __future__ import annotations

import re
import warnings

import pytest

import staticpipe
from models import build_gpt, build_mlp
from pipeline_util import assert_clipping_matters, clip_norm_squares, dense_layers, minimize
from staticpipe._paddle import np, paddle
from staticpipe.runtime.channel import InProcessChannel

pytestmark = pytest.mark.timeout(120)


def loader_of(net, microbatches, steps, global_batch=8):
    """A loader of micro-batches: ``microbatches`` loader batches make one step's global batch."""
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    return loader.set_sample_generator(net.sample_reader(global_batch * steps), batch_size=global_batch // microbatches)


def reference_norms(net, batches):
    """What verify's reference computes, recomputed: ``net.main`` run unsplit from the startup state on
    ``batches``, the scheduler advanced per step and put back; per step, the loss and the squared norm
    of every parameter's pre-clip gradient (Paddle's ClipGradByGlobalNorm's own values)."""
    exe = staticpipe.Executor()
    exe.run(net.startup)
    initial = exe.state_dict(net.main)
    exe.close()
    ref, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    for name, value in initial.items():
        scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    squares = clip_norm_squares(net.main)
    sched = net.main.lr_scheduler
    saved = sched.state_dict()
    losses, norms = [], []
    for batch in batches:
        loss, *values = ref.run(net.main, feed=batch, fetch_list=[net.loss.name, *squares.values()], scope=scope)
        losses.append(float(np.mean(loss)))
        norms.append({p: float(np.asarray(v).item()) for p, v in zip(squares, values)})
        sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched.set_state_dict(saved)
    return losses, norms


def clipped(kind, clip):
    sched = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.01, T_max=10), 2, 0.0, 0.01)
    if kind == "momentum":
        return paddle.optimizer.Momentum(sched, momentum=0.9, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))
    return paddle.optimizer.AdamW(sched, weight_decay=0.01, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))


CLIP = 0.1  # the test GPT's gradient norm is 0.6 to 0.9: clipping is active on every step


@pytest.mark.parametrize("stages, kind", [(3, "momentum"), (2, "adamw")])
def test_verify_passes_a_correct_pipeline_and_reports_every_step(stages, kind):
    """GPT (tied embedding on the first and last stage), warm-up into cosine decay and a global-norm
    clip that is active on every step of verify's reference, with parameters on every stage."""
    net = build_gpt(num_stages=stages)
    minimize(net, clipped(kind, CLIP), dict(num_microbatches=4))
    sched = net.main.lr_scheduler
    report = staticpipe.verify(net.main, loader_of(net, 4, 3), net.startup, steps=3)
    assert report.ok, str(report)
    assert len(report.pipeline_losses) == 3 and report.max_diff["tok_embedding"][0] <= 1e-6
    pc = report.placement
    assert pc.ok and pc.placed_once + len(pc.replicated) == pc.ops == len(net.main.global_block().ops)
    assert any("all-reduce" in why for why in pc.replicated.values())  # the global-norm sum
    assert sched.last_epoch == 0  # the user's scheduler is left where it was
    text = str(report)
    assert text.startswith("staticpipe.verify: OK after 3 steps") and "missing none, duplicated none" in text
    whole = net.random_batch(24)  # the loader's 24 samples: three global batches of 8
    losses, norms = reference_norms(net, [{k: v[8 * s:8 * (s + 1)] for k, v in whole.items()} for s in range(3)])
    assert losses == report.reference_losses  # the same reference, so the same gradients
    assert_clipping_matters(norms, staticpipe.plan_of(net.main), CLIP)


def test_verify_catches_stages_that_clip_by_their_local_norm(monkeypatch):
    """A planted bug: the cross-stage sum of the global-norm clip returns each rank its own part, so
    every stage clips by its local norm. verify must report the drift."""
    real = InProcessChannel.allreduce

    def local_part(self, key, rank, value, ranks):
        total = real(self, key, rank, value, ranks)
        return total if key == ("opt", "ready") else value
    monkeypatch.setattr(InProcessChannel, "allreduce", local_part)
    net = build_gpt(num_stages=3)
    minimize(net, clipped("momentum", CLIP), dict(num_microbatches=4))
    report = staticpipe.verify(net.main, loader_of(net, 4, 3), net.startup, steps=3)
    assert not report.ok and "MISMATCH" in str(report)
    wrong = report.mismatches()  # parameters and their optimizer states (velocities) on every stage
    for stage in staticpipe.plan_of(net.main).stages:
        assert any(m == p or m.startswith(p + "_") for p in stage.parameters for m in wrong), (stage.index, wrong)


def test_verify_starts_from_the_startup_state_or_an_executors_current_state(program_ir):
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))
    report = staticpipe.verify(net.main, [net.random_batch(8, seed=s) for s in range(2)], net.startup, steps=2)
    assert report.ok, str(report)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(8))
    before = exe.state_dict(net.main)
    report = staticpipe.verify(net.main, [net.random_batch(8, seed=s) for s in range(2)], net.startup,
                               steps=2, executor=exe)
    assert report.ok, str(report)
    for name, value in exe.state_dict(net.main).items():
        np.testing.assert_array_equal(value, before[name])


def test_verify_catches_a_broken_plan():
    """Drop the gradient accumulation of one stage: the oracle must see the drift and name the state."""
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))
    backward = staticpipe.plan_of(net.main).stages[1].sections["backward"].run.program.global_block()  # what runs
    weight = dense_layers(net.main)[-1][0]  # the classifier's, on stage 1
    merged = f"{weight}@GRAD@MERGED"
    idx = next(i for i, op in enumerate(backward.ops) if op.type == "sum" and op.output("Out")[0] == merged)
    backward._remove_op(idx)
    report = staticpipe.verify(net.main, loader_of(net, 2, 2), net.startup, steps=2)
    assert not report.ok and weight in report.mismatches()
    assert "MISMATCH" in str(report) and "beyond tolerance after the last step: " in str(report)


def test_verify_checks_its_arguments():
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))
    with pytest.raises(ValueError, match="verify needs a program rewritten by staticpipe.PipelineOptimizer"):
        staticpipe.verify(paddle.static.Program(), [], net.startup)
    with pytest.raises(ValueError, match=re.escape("the loader gave batches for 1 step(s); verify was asked for 3 steps")):
        staticpipe.verify(net.main, [net.random_batch(8)], net.startup, steps=3)
