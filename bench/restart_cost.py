"""What an automatic restart costs: a 2-stage job under ``staticpipe.launch --max-restarts 1`` whose rank 1
is SIGKILLed mid-epoch, the downtime from the kill to the resumed job's first step, split where it goes.

Phases (wall time; every rank writes when it reached each, the launcher's line is read as it comes):

- detect + stop: the kill -> the launcher's restart line (it names the rank once the others have stopped);
- start: the line -> the restarted ranks' scripts running (a new Python);
- import: Paddle and staticpipe imported;
- build + startup: the program built, rewritten, its startup run, the job joined (gloo);
- reload + replay: the newest checkpoint read, checked and loaded into the stages, then the generator's
  batches of the epoch before the checkpoint made again and dropped (``--replay``: how many);
- and the steps lost: those trained after the checkpoint, trained again (here none: checkpoint_every=1).

Printed per model: each phase in seconds and in steady steps of that job, and the downtime against a
steady step; the checkpoint's size; the CPU and Paddle. Sizes: ``small`` MLP 4 x 256 (batch 32), ``large``
MLP 8 x 1024 (batch 256, a checkpoint of ~70 MB with Momentum's velocities).

    python bench/restart_cost.py [--models small,large] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

MODELS = {"small": dict(hidden=256, depth=4, batch=32), "large": dict(hidden=1024, depth=8, batch=256)}
STEPS, KILL_AFTER = 16, 11  # steps of one epoch (4 micro-batches each); rank 1 dies after step 11's checkpoint


def rank(args: argparse.Namespace) -> None:
    """One rank: marks the phases in ``times-run<restart>-rank<r>.json``."""
    times = {"script": time.time()}
    import staticpipe
    from models import build_mlp
    import paddle

    times["imported"] = time.time()
    size = MODELS[args.model]
    np.random.seed(0)
    net = build_mlp(num_stages=2, in_dim=64, hidden=size["hidden"], depth=size["depth"], seed=1)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9), num_microbatches=4).minimize(net.loss)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    batch = size["batch"] // 4
    samples = list(net.sample_reader(STEPS * 4 * batch)())

    def reader():
        for i in np.random.permutation(len(samples)):
            yield samples[i]

    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=8)
    loader.set_sample_generator(reader, batch_size=batch)
    step, steps = exe.step, []

    def timed_step(*a, **kw):
        steps.append(time.time())
        return step(*a, **kw)

    exe.step = timed_step
    times["ready"] = time.time()
    exe.train_from_dataset(net.main, loader, checkpoint_dir=os.path.join(args.dir, "ckpt"), checkpoint_every=1,
                           print_period=10**6)
    times["first_step"], times["steps"] = steps[0], steps
    name = f"times-run{os.environ['STATICPIPE_RESTART']}-rank{os.environ['PADDLE_TRAINER_ID']}.json"
    with open(os.path.join(args.dir, name), "w", encoding="utf-8") as f:
        json.dump(times, f)
    exe.close()


def job(model: str, directory: str) -> dict[str, float]:
    """One killed and restarted job: its phases, in seconds."""
    command = [sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", "--max-restarts", "1", "--restart-delay",
               "0", os.path.abspath(__file__), "--rank", "--model", model, "--dir", directory]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    mark = os.path.join(directory, "ckpt", f"step-{KILL_AFTER:08d}")
    while not os.path.exists(mark):
        if launcher.poll() is not None:
            raise SystemExit(f"the job ended before {mark}: {launcher.stderr.read()[-3000:]}")
        time.sleep(0.002)
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children", encoding="ascii") as f:
        pids = [int(p) for p in f.read().split()]
    victim = next(p for p in pids if b"PADDLE_TRAINER_ID=1" in open(f"/proc/{p}/environ", "rb").read().split(b"\0"))
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    line_at = None
    for line in launcher.stderr:
        if line.startswith("staticpipe.launch:") and "restart 1 of 1" in line:
            line_at = time.time()
    if launcher.wait() or line_at is None:
        raise SystemExit(f"the job failed (exit code {launcher.returncode}) or printed no restart line")
    runs = [json.load(open(os.path.join(directory, f"times-run1-rank{r}.json"), encoding="utf-8")) for r in (0, 1)]
    steady = statistics.median(np.diff(runs[0]["steps"])) if len(runs[0]["steps"]) > 2 else float("nan")
    ckpt = os.path.join(directory, "ckpt", sorted(os.listdir(os.path.join(directory, "ckpt")))[-1])
    return {"detect + stop": line_at - killed,
            "start": max(r["script"] for r in runs) - line_at,
            "import": max(r["imported"] for r in runs) - max(r["script"] for r in runs),
            "build + startup": max(r["ready"] for r in runs) - max(r["imported"] for r in runs),
            "reload + replay": max(r["first_step"] for r in runs) - max(r["ready"] for r in runs),
            "downtime": max(r["first_step"] for r in runs) - killed,
            "steady step": steady,
            "checkpoint MB": sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        return rank(args)
    import paddle
    from staticpipe.capabilities import cpu_model
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; Paddle {paddle.__version__}; 2 ranks (gloo), "
          f"{STEPS} steps an epoch, rank 1 SIGKILLed after checkpoint {KILL_AFTER}; medians of {args.repeats}")
    phases = ["detect + stop", "start", "import", "build + startup", "reload + replay", "downtime"]
    print(f"{'model':8} {'ckpt MB':>8} {'step s':>7}  " + "  ".join(f"{p:>17}" for p in phases))
    for model in args.models.split(","):
        got = [job(model, tempfile.mkdtemp(prefix=f"restart_cost-{model}-")) for _ in range(args.repeats)]
        med = {k: statistics.median(g[k] for g in got) for k in phases + ["steady step", "checkpoint MB"]}
        cells = [f"{med[p]:6.2f} s {med[p] / med['steady step']:6.1f} st" for p in phases]
        print(f"{model:8} {med['checkpoint MB']:8.1f} {med['steady step']:7.3f}  " + "  ".join(f"{c:>17}" for c in cells))
    print(f"st: steady steps of that job; reload + replay includes making again the {KILL_AFTER * 4} batches trained "
          "before the checkpoint in its epoch")


if __name__ == "__main__":
    main()
