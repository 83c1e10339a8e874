"""staticpipe.verify: the equivalence oracle reports real drift and real placement errors."""
from __future__ import annotations

import re

import pytest

import staticpipe
from models import build_gpt, build_mlp
from pipeline_util import minimize
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(120)


def loader_of(net, microbatches, steps, global_batch=8):
    """A loader of micro-batches: ``microbatches`` loader batches make one step's global batch."""
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    return loader.set_sample_generator(net.sample_reader(global_batch * steps), batch_size=global_batch // microbatches)


def test_verify_passes_a_correct_pipeline_and_reports_every_step():
    net = build_gpt(num_stages=3)
    sched = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.01, T_max=10), 2, 0.0, 0.01)
    minimize(net, paddle.optimizer.Momentum(sched, momentum=0.9, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0)),
             dict(num_microbatches=4))
    report = staticpipe.verify(net.main, loader_of(net, 4, 3), net.startup, steps=3)
    assert report.ok, str(report)
    assert len(report.pipeline_losses) == 3 and report.max_diff["tok_embedding"][0] <= 1e-6
    pc = report.placement
    assert pc.ok and pc.placed_once + len(pc.replicated) == pc.ops == len(net.main.global_block().ops)
    assert any("all-reduce" in why for why in pc.replicated.values())  # the global-norm sum
    assert sched.last_epoch == 0  # the user's scheduler is left where it was
    text = str(report)
    assert text.startswith("staticpipe.verify: OK after 3 steps") and "missing none, duplicated none" in text


def test_verify_starts_from_an_executors_current_state():
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(8))
    before = exe.state_dict(net.main)
    report = staticpipe.verify(net.main, [net.random_batch(8, seed=s) for s in range(2)], net.startup,
                               steps=2, executor=exe)
    assert report.ok
    for name, value in exe.state_dict(net.main).items():
        np.testing.assert_array_equal(value, before[name])


def test_verify_catches_a_broken_plan():
    """Drop the gradient accumulation of one stage: the oracle must see the drift and name the state."""
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))
    backward = staticpipe.plan_of(net.main).stages[1].sections["backward"].run.program.global_block()  # what runs
    idx = next(i for i, op in enumerate(backward.ops) if op.type == "sum" and op.output("Out")[0] == "fc_4.w_0@GRAD@MERGED")
    backward._remove_op(idx)
    report = staticpipe.verify(net.main, loader_of(net, 2, 2), net.startup, steps=2)
    assert not report.ok and "fc_4.w_0" in report.mismatches()
    assert "MISMATCH" in str(report) and "beyond tolerance after the last step: " in str(report)


def test_verify_checks_its_arguments():
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))
    with pytest.raises(ValueError, match="verify needs a program rewritten by staticpipe.PipelineOptimizer"):
        staticpipe.verify(paddle.static.Program(), [], net.startup)
    with pytest.raises(ValueError, match=re.escape("the loader gave batches for 1 step(s); verify was asked for 3 steps")):
        staticpipe.verify(net.main, [net.random_batch(8)], net.startup, steps=3)
