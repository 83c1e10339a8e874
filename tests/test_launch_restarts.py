"""``python -m staticpipe.launch --max-restarts N``: a failed run is restarted with every rank, each told
which run it is, the job's id and where to report its progress; one line per failure says what it cost
and what happens next; the restarts end, the same failure every time is called a bug, and a signal to the
launcher (here during the restart delay, or while the ranks are being stopped) ends the job at once.

The ranks run ``RANK`` (no Paddle: fast), which records each run's environment in
``OUT/run<k>-rank<r>.json``, "trains" ``STEPS`` steps reporting each with ``staticpipe.restarts.report``,
rank 0 writing a fake checkpoint every ``CKPT_EVERY`` steps into ``CKPT`` (resuming from its job's newest
there, as a rank does), and then ends its run as ``FAIL`` says for it: a comma list, one entry per run,
for rank ``FAIL_RANK``: "kill" (SIGKILL), an exit code (not 3, ``STOPPED_EXIT``: the launcher would take
it for a rank its watchdog stopped), or "ok"; the other rank exits 0 on an "ok" run, else waits to be
stopped.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from staticpipe import launch
from staticpipe.launch_restarts import Runs
from staticpipe.restarts import Progress, report

pytestmark = pytest.mark.timeout(60)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK = f"""
import json, os, signal, sys, time
sys.path.insert(0, {os.path.join(REPO, "staticpipe")!r})  # restarts.py alone: the package imports Paddle
import restarts
env = os.environ
rank, run, out = int(env["PADDLE_TRAINER_ID"]), int(env["STATICPIPE_RESTART"]), env["OUT"]
with open(os.path.join(out, f"run{{run}}-rank{{rank}}.json"), "w") as f:
    json.dump(dict({{k: env.get(k) for k in ("STATICPIPE_RESTART", "STATICPIPE_JOB", "STATICPIPE_PROGRESS")}},
                   pid=os.getpid()), f)
if env.get("TERM_NOTE"):  # note a SIGTERM, and take the grace to exit
    signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(out, f"term{{run}}-rank{{rank}}"), "w").close())
resumed = restarts.newest_checkpoint(env["CKPT"], env["STATICPIPE_JOB"]) if run else None
checkpoint, checkpoint_step = resumed or (None, None)
every = int(env.get("CKPT_EVERY", "0"))
for step in range((checkpoint_step or 0) + 1, int(env["STEPS"]) + 1):
    if rank == 0 and every and step % every == 0:
        checkpoint, checkpoint_step = os.path.join(env["CKPT"], f"step-{{step:08d}}"), step
        os.makedirs(checkpoint)
        with open(os.path.join(checkpoint, "meta.json"), "w") as f:
            json.dump({{"job": env["STATICPIPE_JOB"]}}, f)
    restarts.report(restarts.Progress(step, checkpoint, checkpoint_step))
open(os.path.join(out, f"stepped{{run}}-rank{{rank}}"), "w").close()
plan = env["FAIL"].split(",")
how = plan[run] if run < len(plan) else "ok"
if how == "ok":
    sys.exit(0)
if rank != int(env["FAIL_RANK"]):
    time.sleep(60)
    sys.exit(0)
while not os.path.exists(os.path.join(out, f"stepped{{run}}-rank{{1 - rank}}")):  # its peer reported
    time.sleep(0.01)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(how))
"""


def command(out, max_restarts, delay="0.1"):
    return [sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", "--max-restarts", str(max_restarts),
            "--restart-delay", delay, str(out / "rank.py")]


def environment(out, fail, steps, fail_rank=1, ckpt_every=0, **extra):
    out.mkdir(exist_ok=True)
    (out / "rank.py").write_text(RANK)
    return dict(os.environ, OUT=str(out), CKPT=str(out / "ckpt"), FAIL=fail, FAIL_RANK=str(fail_rank),
                STEPS=str(steps), CKPT_EVERY=str(ckpt_every), **extra)


def run_job(out, max_restarts, fail, steps, **kw):
    """(exit code, the launcher's ``staticpipe.launch:`` lines, all of stderr)."""
    done = subprocess.run(command(out, max_restarts), cwd=REPO, env=environment(out, fail, steps, **kw),
                          capture_output=True, text=True, timeout=50)
    return done.returncode, launcher_lines(done.stderr), done.stderr


def launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("staticpipe.launch: ")]


def runs_seen(out) -> dict[int, list[dict]]:
    """Per rank, the environment of each run it saw, in order."""
    return {rank: [json.loads((out / f"run{k}-rank{rank}.json").read_text())
                   for k in range(10) if (out / f"run{k}-rank{rank}.json").exists()] for rank in (0, 1)}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_rank_is_restarted_from_its_jobs_newest_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed in runs 0 and 1 after step 7, rank 0 checkpointing every 3 steps; run 2
    succeeds. A newer checkpoint of another job (and one a save left without meta.json) in the same
    directory is not resumed from."""
    out = tmp_path / "job"
    for name, meta in [("step-00000009", {"job": "another"}), ("step-00000008", None)]:
        (out / "ckpt" / name).mkdir(parents=True)
        if meta is not None:
            (out / "ckpt" / name / "meta.json").write_text(json.dumps(meta))
    code, lines, err = run_job(out, 3, "kill,kill,ok", steps=7, ckpt_every=3)
    assert code == 0, err[-3000:]
    ckpt = out / "ckpt" / "step-00000006"
    assert lines == [f"staticpipe.launch: rank 1 was killed by signal SIGKILL at step 7; restart {k} of 3 in 0.1 s, "
                     f"resuming from {ckpt} (1 step lost)" for k in (1, 2)], err[-3000:]
    seen = runs_seen(out)
    for rank in (0, 1):
        assert [e["STATICPIPE_RESTART"] for e in seen[rank]] == ["0", "1", "2"]
        assert [e["STATICPIPE_PROGRESS"] for e in seen[rank]] == [seen[rank][0]["STATICPIPE_PROGRESS"]] * 3
        assert os.path.basename(seen[rank][0]["STATICPIPE_PROGRESS"]) == f"progress-rank{rank}.json"
    assert len({e["STATICPIPE_JOB"] for rank in (0, 1) for e in seen[rank]}) == 1
    assert len(seen[0][0]["STATICPIPE_JOB"]) == 16


def test_the_same_failure_every_time_is_called_a_bug(tmp_path):
    """Exit code 7 after step 3 in every run, no checkpoint: each restart starts from the start; the last
    failure ends the job with the rank's exit code."""
    out = tmp_path / "job"
    code, lines, err = run_job(out, 2, "7,7,7", steps=3)
    assert code == 7, err[-3000:]
    failed = "staticpipe.launch: rank 1 exited with code 7 at step 3"
    assert lines == [f"{failed}; restart {k} of 2 in 0.1 s, from the start (no checkpoint yet, 3 steps lost)"
                     for k in (1, 2)] + [
        f"{failed} in each of the 3 runs: the same failure every time (a bug, not a fault); not restarting again"]
    assert [len(runs) for runs in runs_seen(out).values()] == [3, 3]


def test_restarts_used_up_by_different_failures(tmp_path):
    """Rank 0 fails before any step, with code 6, then 4: no checkpoint, nothing lost, no restart left."""
    out = tmp_path / "job"
    code, lines, err = run_job(out, 1, "6,4", steps=0, fail_rank=0)
    assert code == 4, err[-3000:]
    assert lines == [
        "staticpipe.launch: rank 0 exited with code 6 before its first step; restart 1 of 1 in 0.1 s, "
        "from the start (no checkpoint yet)",
        "staticpipe.launch: rank 0 exited with code 4 before its first step in run 2 of 2; no restart left, "
        "stopped the other ranks"], err[-3000:]


def test_no_restarts_as_before_and_a_job_id_per_launch(tmp_path):
    """``--max-restarts 0``: today's line and exit code, one run; the run's number and a new job id per
    launch are set all the same, no progress file (a rank would write it every step for nothing)."""
    code, lines, err = run_job(tmp_path / "a", 0, "7", steps=2)
    assert (code, lines) == (7, ["staticpipe.launch: rank 1 exited with code 7; stopping the other ranks"]), err
    code, lines, err = run_job(tmp_path / "b", 0, "ok", steps=2)
    assert (code, lines) == (0, []), err
    a, b = runs_seen(tmp_path / "a"), runs_seen(tmp_path / "b")
    assert [[e["STATICPIPE_RESTART"] for e in runs] for runs in (*a.values(), *b.values())] == [["0"]] * 4
    assert a[0][0]["STATICPIPE_JOB"] == a[1][0]["STATICPIPE_JOB"] != b[0][0]["STATICPIPE_JOB"]
    assert [runs[0]["STATICPIPE_PROGRESS"] for runs in (*a.values(), *b.values())] == [None] * 4


def test_ctrl_c_during_the_restart_delay_ends_the_job(tmp_path):
    """SIGINT once the restart line is out (delay 30 s): exit code 130 at once, no second run, no rank left."""
    out = tmp_path / "job"
    launcher = subprocess.Popen(command(out, 3, delay="30"), cwd=REPO, env=environment(out, "kill", steps=2),
                                stderr=subprocess.PIPE, text=True)
    try:
        line = launcher.stderr.readline()
        while line and not line.startswith("staticpipe.launch: "):
            line = launcher.stderr.readline()
        assert line.rstrip("\n") == ("staticpipe.launch: rank 1 was killed by signal SIGKILL at step 2; restart 1 of 3 "
                                     "in 30.0 s, from the start (no checkpoint yet, 2 steps lost)")
        start = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        err = launcher.communicate(timeout=20)[1]
    finally:
        launcher.kill()
        launcher.communicate()
    assert launcher.returncode == 130, err[-3000:]
    assert time.monotonic() - start < 5
    assert launcher_lines(err) == ["staticpipe.launch: SIGINT received; no rank was running"]
    time.sleep(0.5)  # a run started by mistake would have written its files by now
    seen = runs_seen(out)
    assert [len(runs) for runs in seen.values()] == [1, 1]
    assert [rank for rank in (0, 1) if alive(seen[rank][0]["pid"])] == []


def test_a_signal_while_the_ranks_are_stopped_ends_the_job(tmp_path):
    """SIGTERM to the launcher while rank 0 takes its grace after rank 1 failed: the failure's line, then
    the signal's; SIGKILL for rank 0 at once, exit code 143, no restart."""
    out = tmp_path / "job"
    launcher = subprocess.Popen(command(out, 3), cwd=REPO, env=environment(out, "5", steps=1, TERM_NOTE="1"),
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (out / "term0-rank0").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.02)
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        err = launcher.communicate(timeout=20)[1]
    finally:
        launcher.kill()
        launcher.communicate()
    assert launcher.returncode == 143, err[-3000:]
    assert time.monotonic() - start < launch.GRACE_S / 2
    assert launcher_lines(err) == ["staticpipe.launch: rank 1 exited with code 5 at step 1; stopped the other ranks",
                                   "staticpipe.launch: SIGTERM received; no rank was running"]
    seen = runs_seen(out)
    assert [len(runs) for runs in seen.values()] == [1, 1]
    assert [rank for rank in (0, 1) if alive(seen[rank][0]["pid"])] == []


def test_a_resumed_run_that_fails_before_its_first_step_lost_nothing(tmp_path, monkeypatch):
    """A run's reports are its own (the previous run's are removed before it starts): a restarted run
    that fails before it reports is at the step of its checkpoint, and resumes from it again."""
    runs = Runs(str(tmp_path), 2, max_restarts=2, delay_s=1.0)
    ckpt = tmp_path / "ckpt" / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"job": runs.job}))
    envs = runs.environments()
    for rank, step in [(0, 5), (1, 6)]:
        monkeypatch.setenv("STATICPIPE_PROGRESS", envs[rank]["STATICPIPE_PROGRESS"])
        report(Progress(step, str(ckpt) if rank == 0 else None, 4 if rank == 0 else None))
    failed = runs.failed("rank 1 exited with code 2", 1, 2)
    assert runs.next(failed) == (f"rank 1 exited with code 2 at step 6; restart 1 of 2 in 1.0 s, resuming from {ckpt} "
                                 "(2 steps lost)")
    assert [e["STATICPIPE_RESTART"] for e in runs.environments()] == ["1", "1"]
    assert not any(os.path.exists(f) for f in runs.progress_files)
    failed = runs.failed("rank 1 exited with code 2", 1, 2)
    assert runs.next(failed) == (f"rank 1 exited with code 2 at step 4; restart 2 of 2 in 1.0 s, resuming from {ckpt} "
                                 "(no step lost)")


@pytest.mark.parametrize("args,error", [
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--restart-delay", "-0.5"], "--restart-delay must be a number of seconds >= 0, got -0.5"),
    (["--restart-delay", "nan"], "--restart-delay must be a number of seconds >= 0, got nan")])
def test_bad_restart_arguments_are_refused(tmp_path, monkeypatch, capsys, args, error):
    (tmp_path / "job.py").write_text("raise SystemExit('must not run')")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["staticpipe.launch", "--nprocs", "2", *args, "job.py"])
    with pytest.raises(SystemExit) as exit_:
        launch.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: {error}\n")
