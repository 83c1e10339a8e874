"""The same training script under ``python -m paddle.distributed.launch`` (Paddle 2.6's launcher): two
processes on one node, and two "nodes" on this machine (two launchers meeting at --master
127.0.0.1:PORT). Each run must train like single-device Paddle (the unguarded twin, computed once here)
and reproduce the threaded run exactly, as under staticpipe.launch.

Paddle's launcher sets PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, PADDLE_MASTER (the job's TCPStore),
PADDLE_TRAINER_ENDPOINTS, PADDLE_CURRENT_ENDPOINT and, without accelerators, PADDLE_DISTRI_BACKEND=gloo;
worker output goes to --log_dir/workerlog.N.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from models import build_mlp
from pipeline_util import dense_layers
from test_distributed import (REPO, assert_equal_states, assert_like_paddle, fetched_losses, paddle_reference, run,
                              states)

from staticpipe._paddle import core
from staticpipe.launch import free_ports, rank_environments
from staticpipe.placement import place_of

pytestmark = pytest.mark.timeout(300)
JOB = dict(MODEL="mlp", STAGES="2", SCHED="1F1B")


def paddle_launch(out, script, *args):
    """Start ``python -m paddle.distributed.launch [args] script`` writing its states to ``out``."""
    out.mkdir()
    env = dict(os.environ, OUT=str(out), PYTHONPATH=REPO, **JOB)
    return subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(out / "log"),
                             *args, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(launcher, out):
    output = launcher.communicate(timeout=240)[0]
    logs = "".join(p.read_text()[-1500:] for p in sorted((out / "log").glob("workerlog.*")))
    assert launcher.returncode == 0, output[-1500:] + logs


@pytest.fixture(scope="module")
def threaded(tmp_path_factory):
    """The threaded run's output folder (state and losses), and the script (written by ``run``) that
    every launch runs."""
    tmp_path = tmp_path_factory.mktemp("threaded")
    single = run(tmp_path, 1, **JOB)
    assert single.returncode == 0, single.stderr[-2000:]
    return tmp_path, tmp_path / "train.py"


def assert_launched_run_is_right(outs, threaded_out):
    """The launched job's ranks (their files under ``outs``) trained like single-device Paddle and
    reproduced the threaded run bit for bit."""
    init = {k: v for out in outs for k, v in states(out, "init_[0-9].npz").items()}
    final = {k: v for out in outs for k, v in states(out, "state_[0-9].npz").items()}
    [losses] = fetched_losses(*outs)
    assert_like_paddle(init, final, losses, paddle_reference(JOB["MODEL"], int(JOB["STAGES"])))
    assert_equal_states(final, states(threaded_out, "state_single.npz"))
    np.testing.assert_array_equal(losses, np.load(threaded_out / "loss_single.npy"))


def test_two_processes_on_one_node(tmp_path, threaded):
    threaded_out, script = threaded
    out = tmp_path / "job"
    finish(paddle_launch(out, script, "--nproc_per_node", "2"), out)
    assert_launched_run_is_right([out], threaded_out)


def test_two_nodes_on_this_machine(tmp_path, threaded):
    """Two launchers, one process each: node 1 finds node 0 through --master."""
    threaded_out, script = threaded
    master = f"127.0.0.1:{free_ports(1)[0]}"
    outs = [tmp_path / f"node{rank}" for rank in (0, 1)]
    launchers = [paddle_launch(out, script, "--nnodes", "2", "--master", master, "--rank", str(rank),
                               "--nproc_per_node", "1") for rank, out in enumerate(outs)]
    for launcher, out in zip(launchers, outs):
        finish(launcher, out)
    nodes = [states(out, "state_[0-9].npz") for out in outs]
    weight = dense_layers(build_mlp(num_stages=int(JOB["STAGES"])).main)[0][0]  # the job's first layer's
    assert weight in nodes[0] and weight not in nodes[1]  # one stage per node
    assert_launched_run_is_right(outs, threaded_out)


def test_without_cuda_every_rank_uses_gloo_on_the_cpu(monkeypatch):
    """On a CUDA machine with a GPU per rank, staticpipe.launch picks NCCL and gives rank r GPU r (not
    run here: no GPU); without CUDA, gloo, and a launched rank's gpu:k runs on the CPU."""
    envs = rank_environments(2)
    assert [e["PADDLE_DISTRI_BACKEND"] for e in envs] == ["gloo", "gloo"]
    assert not any("FLAGS_selected_gpus" in e for e in envs)
    monkeypatch.setenv("FLAGS_selected_gpus", "0")
    assert isinstance(place_of("gpu:1", launched=True), core.CPUPlace)
