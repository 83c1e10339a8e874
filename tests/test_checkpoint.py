"""Checkpoints, exact resume, evaluation and inference export of pipelined programs."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import staticpipe
from models import build_mlp, build_resnet
from pipeline_util import dense_layers, evaluation_net, minimize, parameter_names, parameter_owners
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trained(builder=build_mlp, steps=2, optimizer=lambda: paddle.optimizer.Adam(0.01), **kw):
    net = builder(**kw)
    minimize(net, optimizer(), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(steps):
        exe.run(net.main, feed=net.random_batch(8, seed=step))
    return net, exe


def reference_with_state(ref, exe, net):
    """A plain Paddle executor and scope holding the unguarded twin ``ref`` with ``net``'s trained state."""
    pexe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    pexe.run(ref.startup, scope=scope)
    for name, value in exe.state_dict(net.main).items():
        if scope.find_var(name) is not None:
            scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    return pexe, scope


def first_weight(program):
    """The first dense layer's weight (of the program's first layer) on either IR."""
    first = parameter_owners(program)[0]
    return next(n for n in parameter_names(program) if n.startswith(first + ".w"))


def test_checkpoint_round_trips_and_is_paddles_format(tmp_path, program_ir):
    net = build_mlp(num_stages=3)
    adam = minimize(net, paddle.optimizer.Adam(0.01), dict(num_microbatches=2)).inner
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(2):
        exe.run(net.main, feed=net.random_batch(8, seed=step))
    path = str(tmp_path / "ck")
    staticpipe.save(net.main, path, exe)
    assert sorted(os.listdir(path)) == ["meta.json", "model.pdopt", "model.pdparams"]
    state = exe.state_dict(net.main)
    accumulators = {v.name for per_param in adam._accumulators.values() for v in per_param.values()}
    assert len(accumulators) >= 2 * len(parameter_names(net.main)) and accumulators <= set(state)  # Adam's state
    later = [float(exe.run(net.main, feed=net.random_batch(8, seed=step), fetch_list=[net.loss])[0])
             for step in (2, 3)]
    fresh_net, fresh = trained(num_stages=3, steps=0)
    assert staticpipe.load(fresh_net.main, path, fresh)["step"] == 2 and fresh.global_step == 2
    restored = fresh.state_dict(fresh_net.main)
    assert restored.keys() == state.keys()
    for name, value in restored.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    # the same training from the same saved state: the same losses, the same bits
    assert [float(fresh.run(fresh_net.main, feed=net.random_batch(8, seed=step), fetch_list=[fresh_net.loss])[0])
            for step in (2, 3)] == later
    for name, value in fresh.state_dict(fresh_net.main).items():
        np.testing.assert_array_equal(value, exe.state_dict(net.main)[name], err_msg=name)
    # into the single-device program with Paddle's own loader, and back
    ref = build_mlp(num_stages=3, guarded=False)
    minimize(ref, paddle.optimizer.Adam(0.01), None)
    pexe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        pexe.run(ref.startup)
        paddle.static.load(ref.main, os.path.join(path, "model"), pexe)
        for name, value in state.items():
            np.testing.assert_array_equal(np.array(scope.find_var(name).get_tensor()), value, err_msg=name)
        pexe.run(ref.main, feed=ref.random_batch(8, seed=9))
        os.makedirs(tmp_path / "single")
        paddle.static.save(ref.main, str(tmp_path / "single" / "model"))
    staticpipe.load(fresh_net.main, str(tmp_path / "single"), fresh)
    weight = first_weight(fresh_net.main)
    np.testing.assert_array_equal(fresh.state_dict(fresh_net.main)[weight],
                                  np.array(scope.find_var(weight).get_tensor()))
    exe.close(), fresh.close()


def test_a_checkpoint_of_another_program_is_refused(tmp_path):
    net, exe = trained(num_stages=2, hidden=32)
    staticpipe.save(net.main, str(tmp_path / "ck"), exe)
    other, other_exe = trained(num_stages=2, hidden=16, depth=5, steps=0)
    with pytest.raises(ValueError) as err:
        staticpipe.load(other.main, str(tmp_path / "ck"), other_exe)
    message = str(err.value)
    layers = dense_layers(other.main)  # the checkpoint's 5 layers, then the sixth it lacks
    last = sorted(f"{p}{acc}" for p in layers[5] for acc in ("", "_beta1_pow_acc_0", "_beta2_pow_acc_0",
                                                              "_moment1_0", "_moment2_0"))
    bias = layers[0][1]
    assert message.startswith(f"checkpoint {str(tmp_path / 'ck')!r} does not match the program: missing {last}; "
                              f"unexpected none; wrong shapes ['{bias}: checkpoint [32], program [16]', "
                              f"'{bias}_moment1_0: checkpoint [32], program [16]'")
    assert message.endswith(f"'{layers[4][0]}_moment2_0: checkpoint [32, 10], program [16, 16]']; wrong dtypes none")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        staticpipe.load(net.main, str(tmp_path / "nothing"), exe)


RESUMER = """
import sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import paddle
net = build_mlp(num_stages=3)
sched = paddle.optimizer.lr.CosineAnnealingDecay(0.01, T_max=5)
minimize(net, paddle.optimizer.Adam(sched), dict(num_microbatches=2))
exe = staticpipe.Executor(); exe.run(net.startup)
first, count = {first}, {count}
if {load}:
    staticpipe.load(net.main, {path!r}, exe)
for step in range(first, first + count):
    exe.run(net.main, feed=net.random_batch(8, seed=step))
    sched.step()
staticpipe.save(net.main, {path!r}, exe)
np.savez({out!r}, **exe.state_dict(net.main))
"""


def test_resume_in_a_new_process_is_bit_exact(tmp_path):
    def run(first, count, load, path, out):
        script = tmp_path / f"run{first}{count}.py"
        script.write_text(RESUMER.format(repo=REPO, tests=os.path.join(REPO, "tests"), first=first, count=count,
                                         load=load, path=str(path), out=str(out)))
        subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=120)
        return dict(np.load(out))

    run(0, 2, False, tmp_path / "ck", tmp_path / "a.npz")
    resumed = run(2, 2, True, tmp_path / "ck", tmp_path / "b.npz")
    straight = run(0, 4, False, tmp_path / "straight", tmp_path / "c.npz")
    assert resumed.keys() == straight.keys()
    for name, value in straight.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)


def test_periodic_checkpoints_keep_the_last_n(tmp_path):
    net, exe = trained(num_stages=2, steps=0)
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    loader.set_sample_generator(net.sample_reader(40), batch_size=4)  # 10 micro-batches: 5 steps
    exe.train_from_dataset(net.main, loader, checkpoint_dir=str(tmp_path), checkpoint_every=2, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000004", "step-00000005"]
    fresh_net, fresh = trained(num_stages=2, steps=0)
    assert staticpipe.load(fresh_net.main, str(tmp_path / "step-00000005"), fresh)["step"] == 5
    with pytest.raises(ValueError, match=re.escape(
            "checkpoint_every must be an integer >= 1 and needs checkpoint_dir, got checkpoint_every=2, "
            "checkpoint_dir=None")):
        exe.train_from_dataset(net.main, loader, checkpoint_every=2)


@pytest.mark.parametrize("builder", [
    lambda guarded=True: build_mlp(num_stages=3, guarded=guarded),
    lambda guarded=True: build_resnet(num_stages=2, guarded=guarded, width=8, image_size=16)],
    ids=["mlp", "resnet-batchnorm"])
def test_pipelined_evaluation_equals_single_device(builder, program_ir):
    """The evaluation program runs as a forward-only pipeline on the trained stages (a PIR program has no
    ``clone(for_test=True)``: the forward network built again, ``pipeline_util.evaluation_net``)."""
    net = builder()
    test = evaluation_net(net, builder)
    assert sorted(parameter_names(test.main)) == sorted(parameter_names(net.main))  # the same parameters
    minimize(net, paddle.optimizer.Momentum(0.05, momentum=0.9), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(2):
        exe.run(net.main, feed=net.random_batch(8, seed=step))
    loader = staticpipe.io.DataLoader.from_generator(feed_list=test.feeds, iterable=True)
    loader.set_sample_generator(net.sample_reader(40), batch_size=8)
    got = exe.evaluate(test.main, loader, [test.loss, test.outputs["accuracy"]], num_microbatches=2, like=net.main)
    assert staticpipe.plan_of(test.main).schedule == "forward-only"
    # the reference: the unguarded twin's evaluation program on the same trained values, batch by batch
    ref_test = evaluation_net(builder(guarded=False), builder, guarded=False)
    pexe, scope = reference_with_state(ref_test, exe, net)
    sums = np.zeros(2)
    for batch in loader.epoch():
        sums += 8 * np.array([float(v) for v in pexe.run(ref_test.main, feed=batch, scope=scope,
                                                         fetch_list=[ref_test.loss, ref_test.outputs["accuracy"]])])
    np.testing.assert_allclose(got, sums / 40, rtol=1e-5)
    assert exe.global_step == 2  # evaluation does not count as training


@pytest.mark.parametrize("builder, batch_name", [
    (lambda guarded=True: build_mlp(num_stages=2, guarded=guarded), "features"),
    (lambda guarded=True: build_resnet(num_stages=2, guarded=guarded, width=8, image_size=16), "image")],
    ids=["mlp", "resnet-batchnorm"])
def test_inference_export_runs_in_plain_paddle(tmp_path, builder, batch_name, program_ir):
    """Paddle's ``load_inference_model`` (the legacy or the PIR format) computes from the exported model what
    the unguarded network computes in test mode from the pipeline's trained state."""
    net = builder()
    minimize(net, paddle.optimizer.Momentum(0.05, momentum=0.9), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(2):
        exe.run(net.main, feed=net.random_batch(8, seed=step))
    path = str(tmp_path / "inference" / "model")
    staticpipe.export_inference(net.main, [net.feeds[0]], [net.outputs["logits"]], path, exe)
    ref_test = evaluation_net(builder(guarded=False), builder, guarded=False)
    pexe, scope = reference_with_state(ref_test, exe, net)
    batch = net.random_batch(4, seed=5)
    expected = pexe.run(ref_test.main, feed=batch, fetch_list=[ref_test.outputs["logits"]], scope=scope)[0]
    with paddle.static.scope_guard(paddle.static.Scope()):
        program, feeds, fetches = paddle.static.load_inference_model(path, pexe)
        assert feeds == [batch_name]
        got = pexe.run(program, feed={feeds[0]: batch[batch_name]}, fetch_list=fetches)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
