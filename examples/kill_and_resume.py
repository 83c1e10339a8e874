"""Train, kill a rank, watch the job resume: ``staticpipe.launch --max-restarts`` and exactly-once data.

Runs a 2-stage pipeline job twice with ``python -m staticpipe.launch --nprocs 2 --max-restarts 2``: once
undisturbed, once with rank 1 killed by SIGKILL (from outside, as the OOM killer would) after its
checkpoint of step ``--kill-after`` appears. The launcher stops the other rank, prints one line naming
the rank, the signal, the step reached and the checkpoint it resumes from, and starts both ranks again;
``train_from_dataset`` loads that checkpoint and goes on with the batch the undisturbed run took next.
The script then compares the two runs' final parameters and optimizer state, bit for bit. Linux only
(it finds rank 1 among the launcher's children in /proc).

    python examples/kill_and_resume.py [--epochs 3] [--kill-after 7] [--dir /tmp/kill_and_resume]

Run by the launcher (``STATICPIPE_RESTART`` set), the same file is the training script of one rank: an
MLP whose loader shuffles a generator's samples with numpy's global generator every epoch.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def train(args: argparse.Namespace) -> None:
    """One rank of the job: the script as it would be without restarts, plus ``checkpoint_dir``."""
    import staticpipe
    from models import build_mlp
    import paddle

    np.random.seed(0)
    net = build_mlp(num_stages=2, in_dim=32, hidden=256, depth=4, seed=1)
    with paddle.static.program_guard(net.main, net.startup):
        opt = staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.05, momentum=0.9), num_microbatches=4)
        opt.minimize(net.loss)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    samples = list(net.sample_reader(320)())

    def reader():
        for i in np.random.permutation(len(samples)):
            yield samples[i]

    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=8)
    loader.set_sample_generator(reader, batch_size=8)  # 40 batches an epoch: 10 steps
    for _ in range(args.epochs):
        exe.train_from_dataset(net.main, loader, checkpoint_dir=os.path.join(args.dir, "ckpt"), checkpoint_every=1,
                               print_period=10**6)
    rank = os.environ["PADDLE_TRAINER_ID"]
    np.savez(os.path.join(args.dir, f"state-rank{rank}.npz"), **exe.state_dict(net.main))
    exe.close()


def launch(args: argparse.Namespace, directory: str, kill: bool) -> str:
    """The job under ``staticpipe.launch``; with ``kill``, rank 1 SIGKILLed after checkpoint --kill-after."""
    os.makedirs(directory)
    command = [sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", "--max-restarts", "2",
               "--restart-delay", "0", os.path.abspath(__file__), "--epochs", str(args.epochs), "--dir", directory]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # the ranks' too
    if kill:
        mark = os.path.join(directory, "ckpt", f"step-{args.kill_after:08d}")
        while not os.path.exists(mark) and job.poll() is None:
            time.sleep(0.005)
        if job.poll() is not None:
            raise SystemExit(f"the job ended (exit code {job.returncode}) before {mark} appeared:\n"
                             f"{job.stderr.read()[-3000:]}")
        os.kill(_rank_pid(job.pid, "1"), signal.SIGKILL)
        print(f"killed rank 1 with SIGKILL after its checkpoint of step {args.kill_after}", flush=True)
    _, err = job.communicate()
    lines = [line for line in err.splitlines() if line.startswith(("staticpipe.launch:", "staticpipe: resumed"))]
    print("\n".join(dict.fromkeys(lines)), flush=True)  # each rank says where it resumed: once
    if job.returncode:
        raise SystemExit(f"the job failed with exit code {job.returncode}:\n{err[-3000:]}")
    return directory


def _rank_pid(launcher: int, rank: str) -> int:
    """The pid of the launcher's child process that is ``rank`` (its PADDLE_TRAINER_ID)."""
    with open(f"/proc/{launcher}/task/{launcher}/children", encoding="ascii") as f:
        children = [int(pid) for pid in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"PADDLE_TRAINER_ID={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise RuntimeError(f"no rank {rank} among the launcher's children {children}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=7, help="kill rank 1 once this step's checkpoint exists")
    ap.add_argument("--dir", default=None, help="where the runs write (default: a new temporary directory)")
    args = ap.parse_args()
    if "STATICPIPE_RESTART" in os.environ:
        return train(args)
    if not 1 <= args.kill_after < args.epochs * 10:
        ap.error(f"--kill-after must be a step of the job, 1 .. {args.epochs * 10 - 1}, got {args.kill_after}")
    root = args.dir or tempfile.mkdtemp(prefix="kill_and_resume-")
    plain = launch(args, os.path.join(root, "undisturbed"), kill=False)
    killed = launch(args, os.path.join(root, "killed"), kill=True)
    same = True
    for rank in ("0", "1"):
        with np.load(os.path.join(plain, f"state-rank{rank}.npz")) as want, \
                np.load(os.path.join(killed, f"state-rank{rank}.npz")) as got:
            same &= want.files == got.files and all(np.array_equal(want[k], got[k]) for k in want.files)
    print(f"after {args.epochs * 10} steps, the killed and resumed job's parameters and optimizer state "
          f"{'equal' if same else 'DIFFER FROM'} the undisturbed job's{' bit for bit' if same else ''}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
