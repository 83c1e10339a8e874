"""Activation memory of F-then-B vs 1F1B, with and without recompute, measured side by side.

Each configuration trains a few steps in a process of its own and reports two independent measures:

- staticpipe's own count, per stage: the peak bytes of the activations a micro-batch's forward keeps
  for its backward (the keep-lists' tensors) and the peak number of micro-batches in flight;
- Paddle's: the allocator's peak of allocated bytes during the steps above what the startup left
  allocated (``host_memory_stat_peak_value``; on GPUs ``max_memory_allocated`` per device), and the
  process's resident memory sampled every 2 ms during the steps, above what it was before them. These
  count every allocation (activations, gradients, workspace), so they do not just repeat the keep-lists.

    python bench/memory.py [--model resnet50|mlp] [--stages 2] [--microbatches 8] [--batch 64] [--steps 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_one(args) -> dict:
    import staticpipe
    from models import build_mlp, build_resnet
    import paddle  # after staticpipe, which settles Paddle's IR flag

    if args.model == "mlp":
        net = build_mlp(num_stages=args.stages, in_dim=1024, hidden=1024, depth=8)
    else:
        net = build_resnet(depth=50, num_stages=args.stages, width=16, image_size=32)
    with paddle.static.program_guard(net.main, net.startup):
        staticpipe.PipelineOptimizer(paddle.optimizer.Momentum(0.01, momentum=0.9),
                                     num_microbatches=args.microbatches, schedule=args.schedule,
                                     recompute=args.recompute).minimize(net.loss)
    from paddle.base import core

    exe = staticpipe.Executor()
    exe.run(net.startup)
    batch = net.random_batch(args.batch)
    allocated = core.host_memory_stat_current_value("Allocated", 0)
    with RssSampler() as rss:
        for _ in range(args.steps):
            exe.run(net.main, feed=batch)
    result = {"stages": exe.memory_stats(), "rss_mib": rss.peak_above_start / 2**20,
              "allocator_mib": (core.host_memory_stat_peak_value("Allocated", 0) - allocated) / 2**20}
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count():
        result["gpu_mib"] = {k: paddle.device.cuda.max_memory_allocated(k) / 2**20
                             for k in range(paddle.device.cuda.device_count())}
    return result


class RssSampler:
    """The process's resident memory, sampled every 2 ms on a thread while the block runs."""

    def __enter__(self) -> "RssSampler":
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def peak_above_start(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "mlp"])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--schedule", help=argparse.SUPPRESS)
    ap.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.schedule:  # one configuration, in this process
        print(json.dumps(run_one(args)))
        return
    print(f"{args.model}, {args.stages} stages, {args.microbatches} micro-batches of "
          f"{args.batch // args.microbatches}, {args.steps} steps")
    print(f"{'schedule':<10} {'recompute':<10} {'stage':>5} {'kept activations MiB':>21} "
          f"{'peak in flight':>15} {'allocator peak MiB':>19} {'RSS peak MiB':>13}")
    base = None
    for schedule in ("F-then-B", "1F1B"):
        for recompute in (False, True):
            cmd = [sys.executable, __file__, "--model", args.model, "--stages", str(args.stages),
                   "--microbatches", str(args.microbatches), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--schedule", schedule] + (["--recompute"] if recompute else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            for stage, m in result["stages"].items():
                mib = m["peak_activation_bytes"] / 2**20
                base = base or mib
                print(f"{schedule:<10} {str(recompute):<10} {stage:>5} {mib:14.2f} ({mib / base:4.2f}x) "
                      f"{m['peak_inflight_microbatches']:>15} {result['allocator_mib']:>19.1f} "
                      f"{result['rss_mib']:>13.1f}")
            if "gpu_mib" in result:
                print(f"{'':<21} GPU max allocated MiB: {result['gpu_mib']}")
    print("allocator and RSS peaks: the whole process (every stage), during the steps, above the state "
          "after startup")


if __name__ == "__main__":
    main()
