"""One stage per process on paddle.distributed (gloo on CPU), launched by staticpipe.launch.

Each case trains the same script in one process (threads) and as N processes, and checks two things:
- against single-device Paddle training of the unguarded twin (``paddle_reference``: ``guarded=False``,
  ``paddle.static.Executor`` on the CPU, computed once per case in this process, never by staticpipe):
  the same initial state bit for bit, and the fetched losses, every parameter and every optimizer state
  after the last step within ``RTOL`` (a bug shared by the threaded and the launched runs shows here);
- against the threaded run: every parameter and optimizer state, and the fetched losses, bit for bit.
"""
from __future__ import annotations

import functools
import glob
import os
import pickle
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import numpy as np
import pytest
from models import build_gpt, build_mlp
from pipeline_util import minimize

import staticpipe
from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH = 3, 8  # SCRIPT's steps and global batch size (asserted below)
# The optimizer of every case, as SCRIPT's source text: the reference builds it from the same text.
OPTIMIZER = "paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=paddle.nn.ClipGradByGlobalNorm(clip))"
# Each model's global-norm clip, chosen so that clipping is active on some steps and not on others
# (``assert_like_paddle`` checks it on the reference; pre-clip norms MLP 2.47, 2.91, 2.68, GPT 0.864,
# 0.828, 0.764): an active step shows a wrong norm (a stage's local norm, a replica's own before the
# mean), an inactive one a wrong gradient scale (a sum over replicas or micro-batches instead of a mean),
# which clipping on every step would scale away.
CLIPS = {"mlp": 2.6, "gpt": 0.8}
# Single-device Paddle sums a batch's gradient in one kernel, a pipeline over 4 micro-batches (and 2
# replicas): float32 rounding of the same sums, amplified where a gradient coordinate is a small
# difference of large terms, and by clipping's division by the norm. Measured against the reference
# after 3 steps (every case here, threaded and launched): losses within 1.1e-7 relative, evaluated loss
# 5e-8; where |value| > 1e-3 parameters within 7.6e-6 and velocities within 2.2e-5 relative; no
# coordinate off by more than 6.3e-8 (median |velocity| 3e-3: small coordinates carry this absolute
# noise, not a relative one). With RTOL = 1e-5 the smallest passing ATOL was 3.6e-8: ATOL = 1e-7
# leaves 2.8x and is 3e4 times below the median velocity.
RTOL, ATOL = 1e-5, 1e-7

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    import numpy as np
    import staticpipe
    from models import build_gpt, build_mlp
    from pipeline_util import minimize
    from staticpipe._paddle import paddle
    stages, model = int(os.environ["STAGES"]), os.environ["MODEL"]
    devices = os.environ["DEVICES"].split(",") if os.environ.get("DEVICES") else None
    net = build_gpt(num_stages=stages) if model == "gpt" else build_mlp(num_stages=stages, stage_devices=devices)
    test = net.main.clone(for_test=True)
    clip = {clips!r}[model]
    minimize(net, {optimizer},
             dict(num_microbatches=4, schedule=os.environ["SCHED"], dp_degree=int(os.environ.get("DP", "1"))))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    rank = os.environ.get("PADDLE_TRAINER_ID", "single")
    np.savez(os.path.join(os.environ["OUT"], f"init_{{rank}}.npz"), **exe.state_dict(net.main))
    losses = []
    for step in range(3):
        if rank == os.environ.get("KILL_RANK") and step == 1:
            os.kill(os.getpid(), 9)
        loss, = exe.run(net.main, feed=net.random_batch(8, seed=step), fetch_list=[net.loss])
        losses.append(np.nan if loss is None else float(loss))
        ndim = -1 if loss is None else np.ndim(loss)
    np.savez(os.path.join(os.environ["OUT"], f"state_{{rank}}.npz"), **exe.state_dict(net.main))
    np.save(os.path.join(os.environ["OUT"], f"loss_{{rank}}.npy"), np.array(losses))
    np.save(os.path.join(os.environ["OUT"], f"ndim_{{rank}}.npy"), ndim)
    if os.environ.get("CKPT"):
        staticpipe.save(net.main, os.path.join(os.environ["OUT"], "ckpt"), exe)
    if os.environ.get("EVAL"):
        loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
        loader.set_sample_generator(net.sample_reader(24), batch_size=8)
        got = exe.evaluate(test, loader, [net.loss], num_microbatches=2, like=net.main)[0]
        np.save(os.path.join(os.environ["OUT"], f"eval_{{rank}}.npy"), np.nan if got is None else got)
""")


def run(tmp_path, nprocs, **env):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests"), optimizer=OPTIMIZER,
                                    clips=CLIPS))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=REPO, **env)
    cmd = [sys.executable, str(script)] if nprocs == 1 else [
        sys.executable, "-m", "staticpipe.launch", "--nprocs", str(nprocs), str(script)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def states(tmp_path, pattern):
    merged = {}
    for path in glob.glob(str(tmp_path / pattern)):
        merged.update(dict(np.load(path)))
    return merged


def assert_equal_states(pieces, reference):
    """The processes' merged state holds exactly the reference's names, each bit for bit equal."""
    assert sorted(pieces) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(pieces[name], value, err_msg=name)


assert f"for step in range({STEPS}):" in SCRIPT and f"random_batch({BATCH}, seed=step)" in SCRIPT


@dataclass(frozen=True)
class Reference:
    """Single-device Paddle training of a case's unguarded twin (see ``paddle_reference``)."""

    initial: dict  # every parameter and optimizer state after the startup program
    final: dict  # the same names after the last step
    losses: np.ndarray  # each step's loss, fetched before its update
    clip: float  # the global-norm clip
    norms: np.ndarray  # each step's global gradient norm before clipping
    evaluated: float  # the test program's mean loss over EVAL_SAMPLES samples, after the last step


EVAL_SAMPLES = 24  # SCRIPT's EVAL: sample_reader(24) in batches of 8


@functools.lru_cache(maxsize=None)
def paddle_reference(model: str, stages: int) -> Reference:
    """Train ``model``'s ``guarded=False`` twin with plain Paddle: ``paddle.static.Executor(CPUPlace())``
    in a scope of its own, its own startup program (built from the same initializer seeds as the
    pipeline's, so the initial states must be equal: checked, bit for bit, by ``assert_like_paddle``),
    SCRIPT's optimizer and SCRIPT's STEPS global batches, each whole (data-parallel replicas split them).
    Computed once per case, in the test process: about 0.1 s for the MLP, 0.5 s for the GPT."""
    paddle.enable_static()
    net = (build_gpt if model == "gpt" else build_mlp)(num_stages=stages, guarded=False)
    test = net.main.clone(for_test=True)
    minimize(net, eval(OPTIMIZER, {"paddle": paddle, "clip": CLIPS[model]}), None)
    # ClipGradByGlobalNorm computes clip / max(clip, norm): the norm is elementwise_max's Y.
    [norm] = [op.input("Y")[0] for op in net.main.global_block().ops if op.type == "elementwise_max"]
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(net.startup, scope=scope)
    names = [v.name for v in net.main.list_vars() if v.persistable and v.name not in ("feed", "fetch")]

    def snapshot():
        return {n: np.array(scope.find_var(n).get_tensor()) for n in names}

    initial, losses, norms = snapshot(), [], []
    for step in range(STEPS):
        loss, value = exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss, norm],
                              scope=scope)
        losses.append(float(loss))
        norms.append(float(np.squeeze(value)))
    evaluated, = exe.run(test, feed=net.random_batch(EVAL_SAMPLES), fetch_list=[net.loss], scope=scope)
    return Reference(initial, snapshot(), np.array(losses), CLIPS[model], np.array(norms), float(evaluated))


def fetched_losses(*dirs, pattern="loss_[0-9].npy"):
    """The losses of the ranks (under ``dirs``) that computed them: a rank without the last stage
    fetches None (saved as NaN)."""
    found = [np.load(p) for d in dirs for p in sorted(glob.glob(str(d / pattern)))]
    found = [losses for losses in found if not np.isnan(losses).all()]
    assert found, f"no rank fetched the loss in {dirs}"
    return found


def assert_like_paddle(initial, final, losses, reference: Reference):
    """The run started from the reference's initial state (bit for bit), and its losses and final state
    (every parameter and optimizer state, the same names) equal single-device Paddle training within
    RTOL, ATOL; in the reference, clipping was active on some steps and not on others (see CLIPS)."""
    assert sorted(initial) == sorted(reference.initial)
    for name, value in reference.initial.items():
        np.testing.assert_array_equal(initial[name], value, err_msg=f"initial {name}")
    active = reference.norms > reference.clip
    assert active.any() and not active.all(), f"clip {reference.clip}, pre-clip norms {reference.norms}"
    np.testing.assert_allclose(losses, reference.losses, rtol=RTOL, atol=0, err_msg="losses")
    assert sorted(final) == sorted(reference.final)
    for name, value in reference.final.items():
        np.testing.assert_allclose(final[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("model,stages,nprocs,schedule,devices", [
    ("mlp", 2, 2, "1F1B", ""), ("mlp", 3, 3, "ZB-H1", ""), ("gpt", 2, 2, "1F1B", ""),
    ("mlp", 4, 2, "ZB-V", "gpu:0,gpu:1,gpu:1,gpu:0")],
    ids=["mlp-2proc-1F1B", "mlp-3proc-ZB-H1", "gpt-2proc-tied-embedding", "mlp-2proc-ZB-V-two-stages-each"])
def test_processes_train_like_paddle_and_reproduce_the_threaded_run(tmp_path, model, stages, nprocs, schedule,
                                                                    devices):
    """Every case clips by global norm, active on some steps (see CLIPS). In ZB-V each process holds two
    stages: one passes its activations to the other inside the process, and both stages' parts of the
    global norm are summed before the all-reduce."""
    env = dict(MODEL=model, STAGES=str(stages), SCHED=schedule, DEVICES=devices)
    single = run(tmp_path, 1, **env)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = run(tmp_path, nprocs, **env)
    assert multi.returncode == 0, multi.stderr[-2000:]
    reference = paddle_reference(model, stages)
    [losses] = fetched_losses(tmp_path)  # one rank holds the last stage
    assert_like_paddle(states(tmp_path, "init_[0-9].npz"), states(tmp_path, "state_[0-9].npz"), losses, reference)
    assert_like_paddle(states(tmp_path, "init_single.npz"), states(tmp_path, "state_single.npz"),
                       np.load(tmp_path / "loss_single.npy"), reference)
    assert_equal_states(states(tmp_path, "state_[0-9].npz"), states(tmp_path, "state_single.npz"))
    np.testing.assert_array_equal(losses, np.load(tmp_path / "loss_single.npy"))


def test_a_killed_rank_stops_the_job_and_is_named(tmp_path):
    start = time.monotonic()
    result = run(tmp_path, 2, MODEL="mlp", STAGES="2", SCHED="1F1B", KILL_RANK="1")
    assert result.returncode != 0
    assert "staticpipe.launch: rank 1 was killed by signal SIGKILL; stopping the other ranks" in result.stderr
    assert time.monotonic() - start < 60


def test_data_times_pipeline_parallel_equals_one_pipeline_on_the_global_batch(tmp_path):
    """dp=2 x pp=2 on 4 processes: each replica trains on half of every global batch and the replicas
    average their accumulated gradients before the update (global-norm clipping after the average).
    Both replicas end bit-identical, and equal to single-device Paddle training on the whole global
    batch, and to one (threaded) pipeline on it, up to float32 summation order; the fetched loss and
    the evaluated loss are the global batch's; rank 0 alone writes the checkpoint, with both pipeline
    ranks' state."""
    env = dict(MODEL="mlp", STAGES="2", SCHED="1F1B", EVAL="1")
    single = run(tmp_path, 1, **env)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = run(tmp_path, 4, DP="2", CKPT="1", **env)
    assert multi.returncode == 0, multi.stderr[-2000:]
    paddle_ref = paddle_reference("mlp", 2)
    for k in (0, 1):  # each replica, against Paddle on the whole batch
        assert_like_paddle(states(tmp_path, f"init_[{2 * k}{2 * k + 1}].npz"),
                           states(tmp_path, f"state_[{2 * k}{2 * k + 1}].npz"),
                           np.load(tmp_path / f"loss_{2 * k + 1}.npy"), paddle_ref)
    assert_like_paddle(states(tmp_path, "init_single.npz"), states(tmp_path, "state_single.npz"),
                       np.load(tmp_path / "loss_single.npy"), paddle_ref)
    for name in ("eval_1", "eval_3", "eval_single"):
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.npy"), paddle_ref.evaluated, rtol=RTOL, err_msg=name)
    reference = states(tmp_path, "state_single.npz")
    replicas = [states(tmp_path, f"state_[{2 * k}{2 * k + 1}].npz") for k in (0, 1)]
    assert_equal_states(replicas[1], replicas[0])
    assert sorted(replicas[0]) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(replicas[0][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    losses = [np.load(tmp_path / f"loss_{rank}.npy") for rank in (1, 3)]  # the last stage computes it
    assert np.load(tmp_path / "ndim_1.npy") == np.load(tmp_path / "ndim_single.npy")  # same shape as one process
    np.testing.assert_array_equal(losses[0], losses[1])
    np.testing.assert_allclose(losses[0], np.load(tmp_path / "loss_single.npy"), rtol=1e-6)
    assert np.isnan(np.load(tmp_path / "loss_0.npy")).all()
    evaluated = [np.load(tmp_path / f"eval_{rank}.npy") for rank in (1, 3)]  # each replica half a batch
    np.testing.assert_array_equal(evaluated[0], evaluated[1])
    np.testing.assert_allclose(evaluated[0], np.load(tmp_path / "eval_single.npy"), rtol=1e-5)
    assert np.isnan(np.load(tmp_path / "eval_0.npy"))
    saved = {}  # rank 0 wrote the checkpoint with both pipeline ranks' state
    for part in ("model.pdparams", "model.pdopt"):
        with open(tmp_path / "ckpt" / part, "rb") as f:
            saved.update(pickle.load(f))
    assert_equal_states(saved, replicas[0])


def test_data_parallel_plans_need_one_process_per_device_and_replica():
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2, dp_degree=2))
    with pytest.raises(ValueError) as err:
        staticpipe.Executor().run(net.startup)
    assert str(err.value) == ("dp_degree=2 runs one process per device and replica: launch 4 processes "
                              "(python -m staticpipe.launch --nprocs 4 script.py)")
    with pytest.raises(ValueError) as err:
        staticpipe.plan_of(net.main).stages_of_process((0, 2))
    assert str(err.value) == ("the job has 2 processes but the plan has 2 devices ['gpu:0', 'gpu:1'] x dp_degree=2; "
                              "launch 4 processes (one per device x dp_degree=2)")
    sharded = build_mlp(num_stages=2)  # fleet's dp_degree 1 x sharding_degree 2: named as the user set them
    minimize(sharded, paddle.optimizer.SGD(0.1), dict(num_microbatches=2, dp_degree=2, sharding_degree=2))
    with pytest.raises(ValueError) as err:
        staticpipe.plan_of(sharded.main).stages_of_process((0, 6))
    assert str(err.value) == ("the job has 6 processes but the plan has 2 devices ['gpu:0', 'gpu:1'] x dp_degree=1 x "
                              "sharding_degree=2; launch 4 processes (one per device x dp_degree=1 x sharding_degree=2)")
    with pytest.raises(ValueError, match=r"^dp_degree must be an integer >= 1, got 0$"):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), dp_degree=0)


def test_point_to_point_groups_only_for_the_pairs_a_plan_sends_on():
    """A job makes a gloo group per (sender, receiver) pair the plan sends on: its routes (neighbours and
    skip connections), its optimize exchanges (a tied parameter's partial gradient to its owner, the new
    value back) and every rank's state to rank 0 for checkpoints; not all p(p-1) pairs."""
    net = build_mlp(num_stages=4)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=4))
    assert staticpipe.plan_of(net.main).rank_pairs() == ((0, 1), (1, 0), (1, 2), (2, 0), (2, 1), (2, 3), (3, 0),
                                                         (3, 2))
    gpt = build_gpt(num_stages=4)
    minimize(gpt, paddle.optimizer.SGD(0.1), dict(num_microbatches=4))
    plan = staticpipe.plan_of(gpt.main)
    assert plan.shared and (0, 3) in plan.rank_pairs() and (3, 0) in plan.rank_pairs()
    assert len(plan.rank_pairs()) == 9  # the MLP's 8 and the tied embedding's new value, rank 0 -> 3


def test_a_message_that_never_comes_is_named_when_gloos_receive_times_out(monkeypatch):
    """gloo ends a receive nobody answers after its timeout with its own words ("... TIMEOUT self_rank = none
    pair_rank = -1 ..."), which name neither the message nor the rank: a checkpoint line only rank 0 runs
    (``if rank == 0: save_persistables(...)``) ended a launched job so. The channel says which message it
    waited for, from which stage and rank, and the likely causes. (The channel is made without a job: its
    receive is what is under test.)"""
    from staticpipe.runtime.distributed import DistributedChannel

    channel = DistributedChannel.__new__(DistributedChannel)
    channel.rank, channel.stage_ranks, channel._box = 0, [0, 1], {}
    channel._send_error = channel._aborted = None

    def timed_out(src):
        raise RuntimeError("[/paddle/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:83] TIMEOUT self_rank = "
                           "none pair_rank = -1 peer_str = none")
    monkeypatch.setattr(channel, "_receive_one", timed_out)
    with pytest.raises(RuntimeError) as err:
        channel.recv(("state", 3), 1)
    assert str(err.value) == (
        "rank 0 waited 0 s for message ('state', 3) from stage 1 (rank 1) and none came: rank 1 failed, is that much "
        "slower, or is elsewhere in the script (a call every rank makes -- staticpipe.save, exe.flush, Paddle's "
        "save_persistables or save_inference_model on a pipelined program -- made on some ranks only?)")
    assert "TIMEOUT" in str(err.value.__cause__)

    def other(src):
        raise RuntimeError("connection reset by peer")
    monkeypatch.setattr(channel, "_receive_one", other)
    with pytest.raises(RuntimeError, match=r"^connection reset by peer$"):  # other errors pass as they are
        channel.recv(("state", 3), 1)
