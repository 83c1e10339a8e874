"""A launched job restarted after its ranks die (``staticpipe.launch --max-restarts``) trains exactly what the
job trains undisturbed: 2 stages x 2 replicas over gloo, each replica shuffling its own data with numpy's
global generator, ranks SIGKILLed at chosen steps, at random steps, and in the middle of a checkpoint's save:
every parameter and optimizer state bit for bit, and every step's loss, re-trained steps included.

The script kills its own rank with SIGKILL right before the step a plan names (``KILLS``: run, rank, step),
so the step is exact whatever the machine's speed; from outside, the rank simply vanishes. The scripts run
on each Paddle's default IR: the legacy IR on Paddle 2.6, PIR on Paddle 3.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS, STEPS = 2, 4  # steps per epoch: 32 samples in batches of 2, 4 micro-batches a step

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {repo!r})
    import numpy as np
    import staticpipe
    from models import build_mlp
    from staticpipe._paddle import paddle

    rank, run = int(os.environ.get("PADDLE_TRAINER_ID", "0")), int(os.environ.get("STATICPIPE_RESTART", "0"))
    kills = {{tuple(k) for k in json.loads(os.environ.get("KILLS", "[]"))}}
    out = os.environ["OUT"]
    np.random.seed(100 + rank // 2)  # each replica its own order of its own data
    net = build_mlp(num_stages=2, in_dim=8, hidden=8, depth=2, seed=1)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Adam(paddle.optimizer.lr.StepDecay(0.01, 3, 0.5)),
                                           num_microbatches=4, dp_degree=2, replica_batches="own")
        opt.minimize(net.loss)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    samples = list(net.sample_reader(32, seed=rank // 2)())

    def reader():
        for i in np.random.permutation(len(samples)):
            yield samples[i]

    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=2, iterable=True)
    loader.set_sample_generator(reader, batch_size=2)
    step, losses = exe.step, {{}}

    def step_or_die(*args, **kwargs):  # the plan's kills right before the step; each step's loss right after
        if (run, rank, exe.global_step + 1) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        if ("every", rank, exe.global_step + 1) in kills:
            raise RuntimeError(f"a bug at step {{exe.global_step + 1}}")
        values = step(*args, **kwargs)
        if values[0] is not None:
            losses[exe.global_step] = float(values[0])
            with open(os.path.join(out, f"losses-run{{run}}-rank{{rank}}.json"), "w") as f:
                json.dump(losses, f)
        return values

    exe.step = step_or_die
    if ("save", run, rank) in {{k[:3] for k in kills}}:  # killed while its checkpoint of that step is half written
        from staticpipe import pickled_arrays
        write, at = pickled_arrays.write, next(k[3] for k in kills if k[:3] == ("save", run, rank))

        def write_or_die(file, arrays):
            digest = write(file, arrays)
            if exe.global_step == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return digest
        pickled_arrays.write = write_or_die
    for epoch in range({epochs}):
        exe.train_from_dataset(net.main, loader, fetch_list=[net.loss], lr_step="step", print_period=10**6,
                               checkpoint_dir=os.path.join(out, "ckpt"), checkpoint_every=1, keep_last=3)
    np.savez(os.path.join(out, f"state-rank{{rank}}.npz"), **exe.state_dict(net.main))
    exe.close()
""")


def run_job(tmp_path, name: str, kills=(), max_restarts: int = 3) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, epochs=EPOCHS))
    # each Paddle's own default IR: the legacy IR on 2.6, PIR on 3 (the suite's legacy-IR opt-in taken out)
    env = {**{k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")},
           "OUT": str(out), "KILLS": json.dumps([list(k) for k in kills])}
    done = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "4", "--max-restarts",
                           str(max_restarts), "--restart-delay", "0", str(script)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=500)
    return done, str(out)


def outcome(out: str) -> tuple[dict[str, np.ndarray], dict[int, float]]:
    """(every rank's final state, keyed by rank and name; every step's loss, re-trained steps checked equal)."""
    state = {}
    for rank in range(4):
        with np.load(os.path.join(out, f"state-rank{rank}.npz")) as f:
            state.update({f"{rank}/{k}": f[k] for k in f.files})
    losses: dict[int, float] = {}
    for file in sorted(os.listdir(out)):
        if m := re.fullmatch(r"losses-run(\d+)-rank(\d+)\.json", file):
            with open(os.path.join(out, file), encoding="utf-8") as f:
                for step, loss in json.load(f).items():
                    key = (int(m.group(2)), int(step))
                    assert losses.setdefault(key, loss) == loss, (file, step)  # a re-trained step: the same loss
    return state, losses


def launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("staticpipe.launch: ")]


def assert_restarted(stderr: str, out: str, kills) -> None:
    """One line per kill: the rank, its signal, the step the job had reached (the one before the kill), the
    restart, and a checkpoint to resume from: that step's, or the one before if the kill also stopped rank 0
    while it wrote that one."""
    lines = launcher_lines(stderr)
    assert len(lines) == len(kills), (kills, lines)
    for line, (run, rank, step) in zip(lines, kills):
        reached = step - 1
        head = (f"staticpipe.launch: rank {rank} was killed by signal SIGKILL at step {reached}; restart {run + 1} "
                f"of 3 in 0.0 s, resuming from {os.path.join(out, 'ckpt')}{os.sep}")
        assert line.startswith(head), (kills, line)
        assert line[len(head):] in (f"step-{reached:08d} (no step lost)", f"step-{reached - 1:08d} (1 step lost)")


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undisturbed")
    done, out = run_job(tmp, "plain")
    assert done.returncode == 0, done.stderr[-3000:]
    assert launcher_lines(done.stderr) == []
    return outcome(out)


def assert_same_training(got, want) -> None:
    state, losses = got
    assert state.keys() == want[0].keys()
    for name, value in want[0].items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    assert losses == want[1]
    assert len(losses) == 2 * EPOCHS * STEPS  # the two loss ranks (stage 1 of each replica), every step


@pytest.mark.parametrize("case", ["chosen", "random"])
def test_ranks_killed_three_times_end_as_the_undisturbed_job(tmp_path, undisturbed, case):
    if case == "chosen":  # mid-epoch on a loss rank, at an epoch's first step, at the very last step
        kills = [(0, 1, 3), (1, 2, STEPS + 1), (2, 0, EPOCHS * STEPS)]
    else:
        seed = random.randrange(10**6)  # a new draw each run of the suite, printed when it fails
        pick = random.Random(seed)
        steps = sorted(pick.sample(range(2, EPOCHS * STEPS + 1), 3))  # each run gets as far as the next kill
        kills = [(run, pick.randrange(4), step) for run, step in enumerate(steps)]
    done, out = run_job(tmp_path, case, kills)
    assert done.returncode == 0, (kills, done.stderr[-3000:])  # kills (run, rank, step) name the case
    assert_restarted(done.stderr, out, kills)
    assert_same_training(outcome(out), undisturbed)


def test_a_rank_killed_in_the_middle_of_a_save_resumes_from_the_previous_checkpoint(tmp_path, undisturbed):
    done, out = run_job(tmp_path, "save", [("save", 0, 0, 3)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert launcher_lines(done.stderr) == [
        f"staticpipe.launch: rank 0 was killed by signal SIGKILL at step 3; restart 1 of 3 in 0.0 s, resuming from "
        f"{os.path.join(out, 'ckpt', 'step-00000002')} (1 step lost)"]  # the step-3 save it died in never counts
    assert_same_training(outcome(out), undisturbed)
    assert not [d for d in os.listdir(os.path.join(out, "ckpt")) if "staticpipe-save" in d]  # the dead save's debris


def test_a_rank_that_fails_at_the_same_step_every_time_stops_the_job(tmp_path):
    done, out = run_job(tmp_path, "bug", [("every", 1, 3)], max_restarts=2)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: a bug at step 3" in done.stderr
    resumed = os.path.join(out, "ckpt", "step-00000002")
    assert launcher_lines(done.stderr) == [
        f"staticpipe.launch: rank 1 exited with code 1 at step 2; restart {k} of 2 in 0.0 s, resuming from {resumed} "
        "(no step lost)" for k in (1, 2)] + [
        "staticpipe.launch: rank 1 exited with code 1 at step 2 in each of the 3 runs: the same failure every time "
        "(a bug, not a fault); not restarting again"]
