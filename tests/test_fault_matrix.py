"""Fault-injection matrix: an exception in every stage x every action kind x every schedule.

Issue 13, "Also" 1. Each case makes one action of one training step raise ``InjectedFault("injected
fault at <action>")`` (``tests/fault_util.py`` patches the runtime's per-action seams) and checks:

- the call raises ``staticpipe.StageError``, its text ``stage S (gpu:k) failed in action <action>: InjectedFault:
  injected fault at <action>``, with ``stage``/``device``/``action`` set and the injected error as ``__cause__``,
  within 5 s;
- every worker has left its step (no thread still runs one) and the step was not counted;
- the failed step left nothing behind: the state equals the state before it, and one clean step then
  gives exactly the loss, parameters and optimizer state of a twin executor that never failed and took
  the same clean step.

In one process (the full matrix): schedules F-then-B, 1F1B, interleaved (4 stages on 2 devices), ZB-H1,
ZB-V, V-Min, V-Half and DualPipeV (4 stages on 2 devices), ZB-2P and Eager1F1B, 4 micro-batches; every
stage, every action kind the schedule has (W only in the split-backward schedules; DualPipeV's paired
FB; SEND/RECV of each channel a stage uses), at the first and the last micro-batch, and every OPT. The
failing action first waits until the other ranks have gone as far as they can without it
(``quiesce``), so each case is deterministic: whether another stage has
already applied its update is decided by the schedule (``fault_util.updated_before``), not by a race.

A failure before the updates (F, B, W, SEND, RECV) leaves nothing behind: no rank starts its updates
before every rank has finished its forwards and backwards (``runtime/optimize_phase.py``). A failure in
an update (OPT) comes after that barrier: its message says that other stages may have applied theirs, and
exactly the stages the schedule lets update (``fault_util.updated_before``) did.

In two processes (``python -m staticpipe.launch --nprocs 2``, gloo): a representative subset of 9 cases
covering every action kind (DualPipeV's paired FB too) and both ranks, on F-then-B, 1F1B, interleaved,
ZB-H1, ZB-V and DualPipeV (V-Min, V-Half, ZB-2P and Eager1F1B hold no kind of action those lack)
(``LAUNCHED``). Why not the full matrix: one failure ends a job (the watchdog stops the other rank), and
each job costs 7-11 s on the 2-core machine (the launcher and both ranks import Paddle, then the first
step makes the gloo groups), so the 348 cases would take about an hour. The launcher must exit non-zero
naming the failing rank, the output must name the stage and action, within a bounded time, and no
process may be left.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time

import pytest
from fault_util import MICROBATCHES, SCHEDULES, InjectedFault, build_pipeline, inject, targets, updated_before

import staticpipe
from staticpipe._paddle import np

pytestmark = pytest.mark.timeout(180)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8
FAILING_BATCH, CLEAN_BATCH = 1, 2  # seeds of the failed step's batch and of the clean step's


UPDATE_FAILED = ("the step's forwards and backwards all succeeded, then this update failed: other stages may "
                 "have applied theirs, so the stages may now disagree; reload a checkpoint to go on")


@functools.cache
def pipeline(schedule: str):
    return build_pipeline(schedule)


def _cases():
    out = []
    for schedule in SCHEDULES:
        actions = staticpipe.plan_of(pipeline(schedule).main).actions
        for action in targets(actions, (0, MICROBATCHES - 1)):
            out.append(pytest.param(schedule, str(action), id=f"{schedule}-{action}"))
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def twins():
    """schedule -> (state before any step, loss and state after one clean step) of an executor that never
    failed; built on first use."""
    made, executors = {}, []

    def get(schedule):
        if schedule not in made:
            net = pipeline(schedule)
            exe = staticpipe.Executor()
            executors.append(exe)
            exe.run(net.startup)
            initial = exe.state_dict(net.main)
            loss, = exe.run(net.main, feed=net.random_batch(BATCH, CLEAN_BATCH), fetch_list=[net.loss])
            made[schedule] = initial, loss, exe.state_dict(net.main)
        return made[schedule]
    yield get
    for exe in executors:
        exe.close()


@pytest.mark.parametrize("schedule,action", CASES)
def test_a_fault_stops_the_step_with_its_error_and_the_next_step_is_clean(twins, schedule, action):
    net = pipeline(schedule)
    plan = staticpipe.plan_of(net.main)
    initial, twin_loss, twin_state = twins(schedule)
    stage = int(action[0])
    device = plan.stages[stage].device
    exe = staticpipe.Executor()
    try:
        exe.run(net.startup)
        with inject(action, quiesce=True) as tracker:
            start = time.monotonic()
            with pytest.raises(staticpipe.StageError) as err:
                exe.run(net.main, feed=net.random_batch(BATCH, FAILING_BATCH), fetch_list=[net.loss])
            elapsed = time.monotonic() - start
            running = dict(tracker.running)
        update = action.endswith("OPT")
        assert str(err.value) == (f"stage {stage} ({device}) failed in action {action}: InjectedFault: "
                                  f"injected fault at {action}" + (f" ({UPDATE_FAILED})" if update else ""))
        assert (err.value.stage, err.value.device, str(err.value.action)) == (stage, device, action)
        assert isinstance(err.value.__cause__, InjectedFault)
        assert str(err.value.__cause__) == f"injected fault at {action}"
        assert elapsed < 5, f"the failed step took {elapsed:.1f} s"
        assert running == {d: 0 for d in plan.ranks}, f"a worker is still in its step: {running}"
        assert exe.global_step == 0

        after = exe.state_dict(net.main)
        changed = sorted(n for n, v in initial.items() if not np.array_equal(after[n], v))
        updated = updated_before(plan.actions, action)
        assert update or not updated  # only an update's failure may leave other updates applied
        # exactly the stages the schedule lets update before the failure: none unless an update failed
        assert sorted({s for n in changed for s in plan.stage_of_var(n)}) == updated, changed
        assert all(p in changed for s in updated for p in plan.stages[s].parameters), changed
        if updated:
            return  # the stages disagree, as the message says: the next step would continue from them

        loss, = exe.run(net.main, feed=net.random_batch(BATCH, CLEAN_BATCH), fetch_list=[net.loss])
        assert exe.global_step == 1
        state = exe.state_dict(net.main)
        assert sorted(state) == sorted(twin_state)
        differ = sorted(n for n, v in twin_state.items() if not np.array_equal(state[n], v))
        assert not differ and np.array_equal(loss, twin_loss), (float(loss), float(twin_loss), differ)
    finally:
        exe.close()


# --- two processes ------------------------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{repo!r}, {tests!r}]
    import staticpipe
    from fault_util import build_pipeline, inject
    net = build_pipeline(os.environ["SCHED"])
    exe = staticpipe.Executor()
    exe.run(net.startup)
    try:
        with inject(os.environ["FAULT"]):
            for step in range(3):
                exe.run(net.main, feed=net.random_batch({batch}, seed=step), fetch_list=[net.loss])
    except staticpipe.StageError:
        print(f"raised at {{time.time()}}", file=sys.stderr, flush=True)
        raise
""")

# every action kind, every schedule, both ranks (rank 0 also serves the job's TCPStore), and a rank's second
# stage (interleaved, ZB-V)
LAUNCHED = [
    ("F-then-B", "1RECV_F3<0"),  # rank 1
    ("1F1B", "0B3"),  # rank 0, after rank 1 has finished its step
    ("1F1B", "0OPT"),  # rank 0, while rank 1 is already in the next step
    ("interleaved", "3SEND_B0>2"),  # rank 1's second stage
    ("ZB-H1", "1W0"),  # rank 1
    ("ZB-H1", "0SEND_F2>1"),  # rank 0
    ("ZB-V", "2OPT"),  # rank 1, the second stage of its group of OPT actions
    ("ZB-V", "0F1"),  # rank 0, the calling thread's rank in one process
    ("DualPipeV", "2F2&1B0"),  # rank 1, a paired F&B
]


def _processes_running(path: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if path.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


@pytest.mark.parametrize("schedule,action", LAUNCHED, ids=[f"{s}-{a}" for s, a in LAUNCHED])
def test_a_fault_in_a_launched_job_stops_it_naming_rank_stage_and_action(tmp_path, schedule, action):
    plan = staticpipe.plan_of(pipeline(schedule).main)
    stage = int(action[0])
    rank, device = plan.stages[stage].rank, plan.stages[stage].device
    assert action in {str(a) for a in plan.actions[rank]}
    script = tmp_path / "faulty_job.py"
    script.write_text(SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests"), batch=BATCH))
    env = dict(os.environ, PYTHONPATH=REPO, SCHED=schedule, FAULT=action)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", str(script)], env=env,
                            capture_output=True, text=True, timeout=150)
    elapsed, ended = time.monotonic() - start, time.time()
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert f"staticpipe.launch: rank {rank} exited with code 1; stopping the other ranks" in out, out[-3000:]
    assert f"rank {1 - rank} exited" not in out, out[-3000:]
    assert (f"StageError: stage {stage} ({device}) failed in action {action}: InjectedFault: injected fault at "
            f"{action}") in out, out[-3000:]
    assert elapsed < 90, f"the job took {elapsed:.0f} s"
    raised = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("raised at ")]
    assert len(raised) == 1 and ended - raised[0] < 15, f"the job ended {ended - raised[0]:.1f} s after the fault"
    assert _processes_running(str(script)) == []
