"""One stage per process on paddle.distributed (gloo on CPU), launched by staticpipe.launch.

Each case trains the same script in one process (threads) and as N processes, and compares every
parameter and optimizer state: the processes must reproduce the threaded run exactly.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

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
    net = build_gpt(num_stages=stages) if model == "gpt" else build_mlp(num_stages=stages)
    clip = paddle.nn.ClipGradByGlobalNorm(0.5)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=clip),
             dict(num_microbatches=4, schedule=os.environ["SCHED"]))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    rank = os.environ.get("PADDLE_TRAINER_ID", "single")
    for step in range(3):
        if rank == os.environ.get("KILL_RANK") and step == 1:
            os.kill(os.getpid(), 9)
        exe.run(net.main, feed=net.random_batch(8, seed=step))
    np.savez(os.path.join(os.environ["OUT"], f"state_{{rank}}.npz"), **exe.state_dict(net.main))
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


@pytest.mark.parametrize("model,stages,schedule", [
    ("mlp", 2, "1F1B"), ("mlp", 3, "ZB-H1"), ("gpt", 2, "1F1B")],
    ids=["mlp-2proc-1F1B", "mlp-3proc-ZB-H1", "gpt-2proc-tied-embedding"])
def test_processes_reproduce_the_threaded_run(tmp_path, model, stages, schedule):
    env = dict(MODEL=model, STAGES=str(stages), SCHED=schedule)
    single = run(tmp_path, 1, **env)
    assert single.returncode == 0, single.stderr[-2000:]
    multi = run(tmp_path, stages, **env)
    assert multi.returncode == 0, multi.stderr[-2000:]
    reference, pieces = states(tmp_path, "state_single.npz"), states(tmp_path, "state_[0-9].npz")
    assert sorted(pieces) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(pieces[name], value, err_msg=name)


def test_a_killed_rank_stops_the_job_and_is_named(tmp_path):
    start = time.monotonic()
    result = run(tmp_path, 2, MODEL="mlp", STAGES="2", SCHED="1F1B", KILL_RANK="1")
    assert result.returncode != 0
    assert "staticpipe.launch: rank 1 exited with code -9; stopping the other ranks" in result.stderr
    assert time.monotonic() - start < 60
