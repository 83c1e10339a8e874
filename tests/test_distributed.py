"""One stage per process on paddle.distributed (gloo on CPU), launched by staticpipe.launch.

Each case trains the same script in one process (threads) and as N processes, and compares every
parameter and optimizer state: the processes must reproduce the threaded run exactly.
"""
from __future__ import annotations

import glob
import os
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from models import build_mlp
from pipeline_util import minimize

import staticpipe
from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    clip = paddle.nn.ClipGradByGlobalNorm(0.5)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=clip),
             dict(num_microbatches=4, schedule=os.environ["SCHED"], dp_degree=int(os.environ.get("DP", "1"))))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    rank = os.environ.get("PADDLE_TRAINER_ID", "single")
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
    script.write_text(SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests")))
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


@pytest.mark.parametrize("model,stages,nprocs,schedule,devices", [
    ("mlp", 2, 2, "1F1B", ""), ("mlp", 3, 3, "ZB-H1", ""), ("gpt", 2, 2, "1F1B", ""),
    ("mlp", 4, 2, "ZB-V", "gpu:0,gpu:1,gpu:1,gpu:0")],
    ids=["mlp-2proc-1F1B", "mlp-3proc-ZB-H1", "gpt-2proc-tied-embedding", "mlp-2proc-ZB-V-two-stages-each"])
def test_processes_reproduce_the_threaded_run(tmp_path, model, stages, nprocs, schedule, devices):
    """Every case clips by global norm. In ZB-V each process holds two stages: one passes its
    activations to the other inside the process, and both stages' parts of the global norm are summed
    before the all-reduce."""
    env = dict(MODEL=model, STAGES=str(stages), SCHED=schedule, DEVICES=devices)
    single = run(tmp_path, 1, **env)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = run(tmp_path, nprocs, **env)
    assert multi.returncode == 0, multi.stderr[-2000:]
    assert_equal_states(states(tmp_path, "state_[0-9].npz"), states(tmp_path, "state_single.npz"))


def test_a_killed_rank_stops_the_job_and_is_named(tmp_path):
    start = time.monotonic()
    result = run(tmp_path, 2, MODEL="mlp", STAGES="2", SCHED="1F1B", KILL_RANK="1")
    assert result.returncode != 0
    assert "staticpipe.launch: rank 1 exited with code -9; stopping the other ranks" in result.stderr
    assert time.monotonic() - start < 60


def test_data_times_pipeline_parallel_equals_one_pipeline_on_the_global_batch(tmp_path):
    """dp=2 x pp=2 on 4 processes: each replica trains on half of every global batch and the replicas
    average their accumulated gradients before the update (global-norm clipping after the average).
    Both replicas end bit-identical, and equal to one pipeline on the whole batch up to float32
    summation order; the fetched loss and the evaluated loss are the global batch's; rank 0 alone
    writes the checkpoint, with both pipeline ranks' state."""
    env = dict(MODEL="mlp", STAGES="2", SCHED="1F1B", EVAL="1")
    single = run(tmp_path, 1, **env)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = run(tmp_path, 4, DP="2", CKPT="1", **env)
    assert multi.returncode == 0, multi.stderr[-2000:]
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
    assert str(err.value) == ("the job has 2 processes but the plan has 2 devices ['gpu:0', 'gpu:1'] x dp_degree 2; "
                              "launch 4 processes (one per device x dp_degree 2)")
    with pytest.raises(ValueError, match=r"^dp_degree must be an integer >= 1, got 0$"):
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), dp_degree=0)
