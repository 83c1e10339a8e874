"""``python -m staticpipe.launch`` under signals and faults: whatever ends a job, no rank outlives it, and
the launcher's last line names the cause (the module docstring of staticpipe/launch.py lists them).

Each job runs the launcher as a process of its own (it gets real signals) on 2 ranks that write their
pid to ``OUT/pid<rank>`` first, so the test can check that none is left. ``TRAIN`` ranks train an MLP
on 2 stages until stopped (``OUT/training<rank>`` once they are in their second step); ``SLEEP``
ranks only sleep, for what needs no training. Teardown kills whatever a failed test left behind.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_distributed import REPO

from staticpipe import launch

pytestmark = pytest.mark.timeout(60)
TRAIN = f"""
import os, sys
sys.path.insert(0, {REPO!r}); sys.path.insert(0, {os.path.join(REPO, "tests")!r})
rank, out = os.environ["PADDLE_TRAINER_ID"], os.environ["OUT"]
with open(os.path.join(out, f"pid{{rank}}"), "w") as f:
    f.write(str(os.getpid()))
if rank == os.environ.get("EXIT_EARLY"):  # before joining the job
    sys.exit(5)
import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import paddle
net = build_mlp(num_stages=2)
minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2, schedule="1F1B"))
exe = staticpipe.Executor()
exe.run(net.startup)
for step in range(100000):
    if step == 1:
        open(os.path.join(out, f"training{{rank}}"), "w").close()
    if rank == os.environ.get("EXIT_RANK") and step == 2:
        sys.exit(int(os.environ["EXIT_CODE"]))
    exe.run(net.main, feed=net.random_batch(8, seed=step), fetch_list=[net.loss])
"""
SLEEP = """
import os, time
with open(os.path.join(os.environ["OUT"], "pid" + os.environ["PADDLE_TRAINER_ID"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(60)
"""


class Job:
    """A launcher process on 2 ranks running ``script``, writing to ``out``."""

    def __init__(self, out, script, **env):
        out.mkdir()
        (out / "job.py").write_text(script)
        self.out = out
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", str(out / "job.py")],
            env=dict(os.environ, OUT=str(out), PYTHONPATH=REPO, GLOG_minloglevel="2", **env),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(self, *names, timeout_s=40.0):
        deadline = time.monotonic() + timeout_s
        while not all((self.out / n).exists() for n in names):
            assert self.launcher.poll() is None, self.launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no {names} after {timeout_s} s"
            time.sleep(0.1)

    def pids(self) -> list[int]:
        return [int((self.out / f"pid{rank}").read_text()) for rank in (0, 1)]

    def finish(self, timeout_s=30.0) -> tuple[int, str, str]:
        """(the launcher's exit code, its last line, all of stderr); every rank must be gone by then."""
        err = self.launcher.communicate(timeout=timeout_s)[1]
        assert [pid for pid in self.pids() if alive(pid)] == [], err[-3000:]
        return self.launcher.returncode, err.rstrip().splitlines()[-1], err


def state(pid: int) -> str | None:
    """``pid``'s state letter in /proc (R, S, T: stopped, Z: zombie, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def alive(pid: int) -> bool:
    """A zombie is not: it has ended, only its parent (maybe init) has not reaped it yet."""
    return state(pid) not in (None, "Z")


@pytest.fixture
def job(tmp_path):
    """``job(script, **env)`` starts a Job; teardown kills its launcher and its ranks if still there."""
    jobs = []

    def start(script, **env):
        jobs.append(Job(tmp_path / f"job{len(jobs)}", script, **env))
        return jobs[-1]
    yield start
    for j in jobs:
        j.launcher.kill()
        for rank in (0, 1):
            path = j.out / f"pid{rank}"
            pid = int(path.read_text()) if path.exists() else None
            if pid is not None and alive(pid) and "job.py" in open(f"/proc/{pid}/cmdline").read():
                os.kill(pid, signal.SIGKILL)
        j.launcher.communicate()


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_rank(job, signum, code):
    j = job(TRAIN)
    j.wait_for("training0", "training1")
    start = time.monotonic()
    j.launcher.send_signal(signum)
    assert j.finish()[:2] == (code, f"staticpipe.launch: {signum.name} received; stopped ranks 0, 1")
    assert time.monotonic() - start < launch.GRACE_S


@pytest.mark.parametrize("frozen", [1, 0])
def test_a_frozen_rank_is_named_not_the_rank_it_stopped(job, frozen):
    """SIGSTOP: rank 1's heartbeats stop (rank 0 sees the silence), or rank 0, which serves the store,
    stops answering (rank 1's guard sees a store call that does not return); heartbeat timeout 3 s."""
    j = job(TRAIN, STATICPIPE_HEARTBEAT_TIMEOUT="3")
    j.wait_for("training0", "training1")
    os.kill(j.pids()[frozen], signal.SIGSTOP)
    start = time.monotonic()
    code, line, err = j.finish()
    assert code == 1, err[-3000:]
    assert re.fullmatch(rf"staticpipe.launch: rank {frozen} stopped sending heartbeats for \d+\.\d s "
                        r"\(frozen or hung\); stopping the other ranks", line), err[-3000:]
    assert f"rank {1 - frozen} exited" not in err
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("rank,exit_code,code,why", [
    (1, 4, 4, "rank 1 exited with code 4"),
    (1, 0, 1, "rank 1 exited in the middle of a step (rank 0's exchange with it broke)"),
    (0, 0, 1, "rank 0 exited in the middle of a step (rank 1's exchange with it broke)")],
    ids=["rank1-code4", "rank1-code0", "rank0-code0"])
def test_a_rank_that_exits_in_the_middle_of_the_job_is_named(job, rank, exit_code, code, why):
    """``sys.exit`` before the third step: the exit code names the rank, or, for 0 (a normal exit to
    its atexit), its peer's watchdog, whose exchange with it broke -- for rank 0 once it stops serving
    the store, the heartbeat timeout (3 s) after its exit began."""
    j = job(TRAIN, EXIT_RANK=str(rank), EXIT_CODE=str(exit_code), STATICPIPE_HEARTBEAT_TIMEOUT="3")
    got, line, err = j.finish()
    assert (got, line) == (code, f"staticpipe.launch: {why}; stopping the other ranks"), err[-3000:]


def test_a_rank_that_fails_before_joining_the_job_is_named(job):
    """Rank 1 exits before it joins; rank 0 waits for it in ``init_parallel_env`` until stopped."""
    code, line, err = job(TRAIN, EXIT_EARLY="1").finish()
    assert (code, line) == (5, "staticpipe.launch: rank 1 exited with code 5; stopping the other ranks"), err[-3000:]


def test_ctrl_z_suspends_the_ranks_with_the_launcher(job):
    """Ranks run in sessions of their own (the terminal's SIGTSTP reaches the launcher only)."""
    j = job(SLEEP)
    j.wait_for("pid0", "pid1")
    j.launcher.send_signal(signal.SIGTSTP)
    until(lambda: [state(pid) for pid in [j.launcher.pid, *j.pids()]] == ["T"] * 3)
    j.launcher.send_signal(signal.SIGCONT)
    until(lambda: "T" not in [state(pid) for pid in [j.launcher.pid, *j.pids()]])
    j.launcher.send_signal(signal.SIGTERM)
    assert j.finish()[:2] == (143, "staticpipe.launch: SIGTERM received; stopped ranks 0, 1")


def test_a_second_signal_kills_the_ranks_at_once(job):
    """Ranks that ignore SIGTERM would get ``GRACE_S``; another signal ends the wait. The second is sent
    once both ranks have had the first (they note it in ``OUT/term<rank>``): two signals that reach a
    process before it runs are delivered lowest number first, SIGINT before SIGTERM, on a loaded machine
    even when sent half a second apart."""
    j = job("import os, signal\nsignal.signal(signal.SIGTERM, lambda *_: open(os.path.join(os.environ['OUT'], "
            "'term' + os.environ['PADDLE_TRAINER_ID']), 'w').close())\n" + SLEEP)
    j.wait_for("pid0", "pid1")
    j.launcher.send_signal(signal.SIGTERM)
    j.wait_for("term0", "term1")
    j.launcher.send_signal(signal.SIGINT)
    assert j.finish(timeout_s=5)[:2] == (
        143, "staticpipe.launch: SIGTERM received; stopped ranks 0, 1 (killed with SIGKILL: 0, 1)")


def test_a_second_signal_that_came_before_the_launcher_acted_on_the_first_kills_at_once(tmp_path, capsys):
    """On a loaded machine both signals can be in before the launcher's loop acts on the first: any signal
    after the one it forwards ends the grace, also one that came before the stop began."""
    job = launch.Job(str(tmp_path))
    ignoring = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    job.procs = [subprocess.Popen([sys.executable, "-c", ignoring], stdout=subprocess.PIPE, start_new_session=True)
                 for _ in range(2)]
    try:
        for p in job.procs:
            p.stdout.readline()  # SIGTERM is ignored from here on
        job.received = [signal.SIGTERM, signal.SIGINT]
        start = time.monotonic()
        assert job.watch(poll_s=0.05, wait_origin_s=5.0, grace_s=30.0) == 143
        assert time.monotonic() - start < 10
        assert capsys.readouterr().err.splitlines()[-1] == (
            "staticpipe.launch: SIGTERM received; stopped ranks 0, 1 (killed with SIGKILL: 0, 1)")
    finally:
        for p in job.procs:
            p.kill()
            p.communicate()


def test_a_killed_launcher_takes_its_ranks_along(job):
    """SIGKILL leaves the launcher no say: the kernel kills the ranks (PR_SET_PDEATHSIG)."""
    j = job(SLEEP)
    j.wait_for("pid0", "pid1")
    j.launcher.kill()
    until(lambda: not any(alive(pid) for pid in j.pids()))


@pytest.mark.parametrize("args,error", [
    (["--nprocs", "0", "job.py"], "--nprocs must be >= 1, got 0"),
    (["--nprocs", "-2", "job.py"], "--nprocs must be >= 1, got -2"),
    (["--nprocs", "2", "missing.py"], "script 'missing.py' does not exist (from {cwd})")])
def test_bad_arguments_are_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys, args, error):
    (tmp_path / "job.py").write_text("raise SystemExit('must not run')")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["staticpipe.launch", *args])
    with pytest.raises(SystemExit) as exit_:
        launch.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: {error.format(cwd=tmp_path)}\n")


def until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.05)
