"""Faults in a job of several processes: the watchdog (staticpipe/runtime/watchdog.py) stops every rank
when one fails or dies, naming it, and stays silent when ranks finish at different times.

The ranks run without a launcher that stops the others (``run_ranks``: each rank is test_distributed's
``run`` with staticpipe.launch's environment for that rank), so only the watchdog can end them.
"""
from __future__ import annotations

import concurrent.futures as cf
import re
import time

import pytest
import test_distributed
from test_distributed import SCRIPT, run

from staticpipe.launch import launch, rank_environments
from staticpipe.runtime.watchdog import STOPPED_EXIT

pytestmark = pytest.mark.timeout(150)
JOB = dict(MODEL="mlp", STAGES="2", SCHED="1F1B")
FEED = "feed=net.random_batch(8, seed=step)"
# rank 1 feeds labels out of range at step 1: its stage's cross-entropy fails, rank 0's does not
BAD_LABEL = ("feed=dict(net.random_batch(8, seed=step), **({{'label': np.full((8, 1), 99)}} "  # SCRIPT is a
             "if rank == os.environ.get('FAIL_RANK') and step == 1 else {{}}))")  # format string
LABEL_ERROR = ("StageError: stage 1 (gpu:1) failed in action 1F0: IndexError: OutOfRangeError: label value "
               "should less than the shape of axis dimension when label value(99) not equal to "
               "ignore_index(-100), But received label value as 99 and shape of axis dimension is 10")


def run_ranks(tmp_path, nprocs=2, **env):
    """Every rank of a job as its own ``run``: [(completed process, monotonic time it ended)] by rank."""
    def one(rank, rank_env):
        out = tmp_path / f"rank{rank}"
        out.mkdir()
        result = run(out, 1, **env, **rank_env)
        return result, time.monotonic()
    with cf.ThreadPoolExecutor(nprocs) as pool:
        futures = [pool.submit(one, r, e) for r, e in enumerate(rank_environments(nprocs))]
    return [f.result() for f in futures]


def watchdog_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("staticpipe: ")]


@pytest.fixture
def failing_script(monkeypatch):
    assert FEED in SCRIPT
    monkeypatch.setattr(test_distributed, "SCRIPT", SCRIPT.replace(FEED, BAD_LABEL))


def test_a_killed_rank_stops_the_others_within_30_s(tmp_path):
    """SIGKILL: rank 1's heartbeat stops; rank 0, blocked in a gloo receive, exits by itself (default
    heartbeat timeout)."""
    (rank0, end0), (rank1, end1) = run_ranks(tmp_path, KILL_RANK="1", **JOB)
    assert rank1.returncode == -9
    assert rank0.returncode == STOPPED_EXIT, rank0.stderr[-2000:]
    [line] = watchdog_lines(rank0.stderr)
    assert re.fullmatch(r"staticpipe: rank 1 stopped \(no heartbeat for \d+\.\d s\); stopping rank 0", line)
    assert "Traceback" not in rank0.stderr  # its gloo receive failed too: not reported as its own failure
    assert end0 - end1 < 30


def test_a_killed_store_host_stops_the_others_at_once(tmp_path):
    """Rank 0 serves the job's TCPStore: when it dies, the others' next store call fails (the monitor's,
    or the failure record of a stage whose gloo receive saw the connection reset)."""
    (rank0, end0), (rank1, end1) = run_ranks(tmp_path, KILL_RANK="0", **JOB)
    assert rank0.returncode == -9
    assert rank1.returncode == STOPPED_EXIT, rank1.stderr[-2000:]
    [line] = watchdog_lines(rank1.stderr)
    assert re.fullmatch(r"staticpipe: rank 0 stopped \(its TCPStore at 127\.0\.0\.1:\d+ is unreachable\); "
                        r"stopping rank 1", line)
    assert "Traceback" not in rank1.stderr
    assert end1 - end0 < 5


def test_a_failing_stage_stops_the_others_with_its_error(tmp_path, failing_script):
    (rank0, end0), (rank1, end1) = run_ranks(tmp_path, FAIL_RANK="1", **JOB)
    assert rank1.returncode == 1
    assert rank1.stderr.rstrip().endswith("[operator < softmax_with_cross_entropy > error]")
    assert watchdog_lines(rank1.stderr) == []
    assert rank0.returncode == STOPPED_EXIT, rank0.stderr[-2000:]
    assert watchdog_lines(rank0.stderr) == [f"staticpipe: rank 1 (gpu:1) failed: {LABEL_ERROR}; stopping rank 0"]
    assert abs(end0 - end1) < 10


def test_a_rank_that_exits_mid_job_stops_the_others_at_once(tmp_path, monkeypatch):
    """``sys.exit(4)`` on rank 1 between steps: to its atexit that is a normal end, but rank 0 still
    waits for its messages. The gloo connection breaks, and rank 0 names rank 1 at once (it used to wait
    out the heartbeat timeout, then blame itself)."""
    kill = 'if rank == os.environ.get("KILL_RANK") and step == 1:'
    assert kill in SCRIPT
    exit_ = 'if rank == os.environ.get("EXIT_RANK") and step == 1:\n        sys.exit(4)\n    '
    monkeypatch.setattr(test_distributed, "SCRIPT", SCRIPT.replace(kill, exit_ + kill))
    (rank0, end0), (rank1, end1) = run_ranks(tmp_path, EXIT_RANK="1", **JOB)
    assert rank1.returncode == 4
    assert rank0.returncode == STOPPED_EXIT, rank0.stderr[-2000:]
    assert watchdog_lines(rank0.stderr) == [
        "staticpipe: rank 1 exited in the middle of a step (rank 0's exchange with it broke); stopping rank 0"]
    assert end0 - end1 < 5


def test_the_launcher_names_the_failing_rank(tmp_path, failing_script):
    result = run(tmp_path, 2, FAIL_RANK="1", **JOB)
    assert result.returncode == 1
    assert "staticpipe.launch: rank 1 exited with code 1; stopping the other ranks" in result.stderr
    assert "rank 0 exited" not in result.stderr


def test_the_launcher_does_not_name_a_rank_its_watchdog_stopped(capfd):
    """Rank 0 is stopped by its watchdog (STOPPED_EXIT) before rank 1, which failed, has exited."""
    code = launch(2, ["-c", f"import os, sys, time; rank = os.environ['PADDLE_TRAINER_ID']; "
                            f"time.sleep(0 if rank == '0' else 1); sys.exit({STOPPED_EXIT} if rank == '0' else 7)"])
    assert code == 7
    assert capfd.readouterr().err == "staticpipe.launch: rank 1 exited with code 7; stopping the other ranks\n"


@pytest.mark.parametrize("late", ["0", "1"])
def test_ranks_that_finish_at_different_times_exit_cleanly(tmp_path, monkeypatch, late):
    """A rank that finishes early is not a dead rank; rank 0, which serves the store, waits for the others
    (the heartbeat timeout at most), and a rank that saw rank 0 leave does not take the store's going
    for a fault. The late rank sleeps longer than the heartbeat timeout after training."""
    monkeypatch.setattr(test_distributed, "SCRIPT", SCRIPT + "import time\ntime.sleep(float(os.environ.get("
                        "'SLEEP_' + rank, 0)))\n")
    results = run_ranks(tmp_path, STATICPIPE_HEARTBEAT_TIMEOUT="2", **{f"SLEEP_{late}": "5"}, **JOB)
    for result, _ in results:
        assert result.returncode == 0, result.stderr[-2000:]
        assert watchdog_lines(result.stderr) == []
