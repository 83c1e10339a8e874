"""``python -m staticpipe.selftest``: what a machine with GPUs must show before staticpipe's GPU path is trusted.

    python -m staticpipe.selftest                # on a machine with paddlepaddle-gpu and 1+ GPUs
    python -m staticpipe.selftest --quick        # the same checks with small sizes (a few minutes)
    python -m staticpipe.selftest --cpu --quick  # a dry run of the harness on CPU devices (what CI runs)

Without CUDA (and without ``--cpu``) it prints why it skipped and exits 0. Otherwise it prints a report to
paste into a bug report as it is: a header (staticpipe's version, Paddle's version and commit, the CUDA and
cuDNN Paddle was built with, the GPUs, Python, the CPU), then ONE Markdown table, a row per check (check,
devices, result / metric, PASS / FAIL / SKIP, seconds); it exits 1 if any check failed:

  a. equivalence on GPU stages: MLP, ResNet-50 (batch norm) and GPT (tied embedding) pipelines against
     single-device training on one GPU (``paddle.static.Executor(paddle.CUDAPlace(0))``), from the same
     initial state on the same batches. MLP and GPT: the reference trains on the whole global batch.
     ResNet: batch norm normalises each micro-batch by its own statistics (as Paddle's pipeline does), so
     its exact reference is Paddle's GradientMergeOptimizer, one executor run per micro-batch. Every
     parameter and optimizer state (batch-norm running statistics included) must be within
     ``atol + rtol * |reference|`` and the losses within rtol; the row gives the largest relative
     difference (max |pipeline - reference| / max |reference|, over each tensor) and the tolerance.
     TF32 is switched off for these rows (``NVIDIA_TF32_OVERRIDE=0``, ``FLAGS_allow_tf32_cublas=0``,
     ``FLAGS_cudnn_deterministic=1``): rtol 1e-4, atol 1e-5. ``--tf32`` leaves TF32 on: rtol 1e-2,
     atol 1e-3. On CPU (``--cpu``) the suite's own tolerance, rtol 1e-5, atol 1e-6.
  b. heterogeneous stages: DLRM with its embedding tables on a "cpu" stage and the MLPs on GPU stages,
     against the whole program on one GPU; same tolerances.
  c. the seed job (``examples/train_resnet50_seed.py``; its network is ``models/seed_resnet.py``): 2
     pipeline stages against the same network on one GPU (plain Momentum, the whole global batch per run),
     both fed the same global batch from host memory; samples/s of both and their ratio. With one GPU the
     two stages run on GPU 0 through the device map (``{"gpu:1": "gpu:0"}``), and the row says so.
  d. peak memory per stage of the seed job pipelined: ``Executor.memory_stats()`` (activations held
     between forward and backward, micro-batches in flight: at most 2 / 1 for 1F1B on 2 stages) and
     ``paddle.device.cuda.max_memory_allocated`` of each GPU, in a fresh process.
  e. the launched 2-process path (``python -m staticpipe.launch --nprocs 2``): NCCL when there are 2+ GPUs
     (a cut tensor of 64 MiB at full size), the merged state of both ranks against the same job in one
     process; "skipped: 1 GPU" otherwise. With ``--cpu`` it runs on gloo.
  f. AMP fp16 across the stages: a 2-stage MLP in fp32 and fp16 O1, samples/s and kept activations per
     stage side by side, and every stage's copy of the fp16 loss scale equal.
  g. AMP bf16 across the stages: the same MLP in fp32 and bf16 O1. On CPU stages bfloat16 needs a CPU whose
     oneDNN runs it (``staticpipe.capabilities``); where it does not, the row is SKIP with the reason.

Each check runs in its own process (``--in-process`` runs them here), under a time limit (``--timeout``),
so a crash or a hang (an NCCL deadlock) is reported in its row and the other checks still run.
Each check's whole output is kept in ``--log-dir`` (default: a new temporary directory, printed), and a
failed row names its log. ``--only a-mlp,e-launch`` runs some of them; ``--json PATH`` also writes the
header's fields and the rows as JSON.

``--cpu`` hides every GPU (``CUDA_VISIBLE_DEVICES=""``): the "gpu:k" stages become CPU devices and the
report is labelled CPU DRY RUN -- it exercises the harness, it is never a GPU result.

The checks need the ``models`` package that installs with staticpipe.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

from .._paddle import paddle
from . import checks
from .harness import FAIL, Context
from .process import with_packages_on_path
from .report import environment, fields, format_table, title

SKIP_MESSAGE = ("no CUDA device: this Paddle {why}, so there is nothing to check here; run on a GPU machine "
                "(paddlepaddle-gpu) with `python -m staticpipe.selftest` (`--quick` for small sizes), "
                "or `python -m staticpipe.selftest --cpu` for a dry run of the harness on CPU devices")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m staticpipe.selftest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU devices (labelled CPU; never a GPU result)")
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--tf32", action="store_true", help="leave TF32 on in the equivalence rows (looser tolerance)")
    ap.add_argument("--only", help=f"comma-separated checks: {', '.join(checks.CHECKS)}")
    ap.add_argument("--in-process", action="store_true", help="run every check in this process (no isolation)")
    ap.add_argument("--timeout", type=float, help="seconds per check (default 300 with --quick/--cpu, else 900)")
    ap.add_argument("--json", help="also write the header's fields and the rows to this file")
    ap.add_argument("--log-dir", help="where each check's output is kept (default: a new temporary directory)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # run one check and print its row (checks.run_isolated)
    args = ap.parse_args(argv)
    keys = list(checks.CHECKS) if not args.only else [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys + ([args.worker] if args.worker else []) if k not in checks.CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; known: {', '.join(checks.CHECKS)}")
    args.keys = keys
    return args


def needed_environment(args) -> dict[str, str]:
    """What the CUDA libraries must find in the environment when they start: no GPU in a dry run (every
    gpu:k stage a CPU device); TF32 off when one process runs every row (the equivalence rows need it;
    isolated checks get it per row from ``checks.run_isolated``)."""
    if args.cpu:
        return {"CUDA_VISIBLE_DEVICES": ""}
    if args.in_process and not args.tf32:
        return {"NVIDIA_TF32_OVERRIDE": "0"}
    return {}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    needed = needed_environment(args)
    late = any(os.environ.get(k) != v for k, v in needed.items())
    os.environ.update(needed)  # for the processes started from here
    if late and args.in_process and paddle.is_compiled_with_cuda():
        # this process's Paddle started CUDA when staticpipe was imported, before these were set: the
        # checks run in a process that starts with them
        return subprocess.call([sys.executable, "-m", "staticpipe.selftest", *argv],
                               env=with_packages_on_path(os.environ))

    if args.worker:
        checks.print_row(checks.run_check(args.worker, Context(args.cpu, args.quick, args.tf32)))
        return 0
    if not args.cpu:
        why = ("is a CPU build (paddlepaddle, not paddlepaddle-gpu)" if not paddle.is_compiled_with_cuda() else
               "has CUDA but sees no GPU (CUDA_VISIBLE_DEVICES? driver?)" if paddle.device.cuda.device_count() == 0
               else None)
        if why:
            print(SKIP_MESSAGE.format(why=why) + "\n\n" + fields(environment()))
            return 0
    ctx = Context(args.cpu, args.quick, args.tf32, args.in_process)
    facts = environment()
    header = title(ctx) + "\n\n" + fields(facts)
    print(title(ctx), file=sys.stderr, flush=True)
    if not args.in_process:
        args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="staticpipe-selftest-logs-")
        os.makedirs(args.log_dir, exist_ok=True)
        print(f"each check's output: {args.log_dir}/<check>.log", file=sys.stderr, flush=True)
    rows = []
    for key in args.keys:
        print(f"running {checks.CHECKS[key][0]} ...", file=sys.stderr, flush=True)
        row = checks.run_check(key, ctx) if args.in_process else checks.run_isolated(key, args)
        print(f"  {row.status} in {row.seconds:.1f} s: {row.result}", file=sys.stderr, flush=True)
        rows.append(row)
    print(format_table(rows, header), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title(ctx), "environment": facts, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 1 if any(r.status == FAIL for r in rows) else 0
