"""The checks, by key, and how one runs: here (an exception fails its row), or in a process of its own
under a time limit (a crash or a hang fails its row; the process's output is kept in a log)."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from typing import Callable

from .amp import check_bf16, check_fp16
from .equivalence import check_dlrm, check_gpt, check_mlp, check_resnet
from .harness import FAIL, Context, Row, clip
from .process import run_group, with_packages_on_path
from .seed import check_memory, check_seed
from .two_processes import check_launch

CHECKS: dict[str, tuple[str, Callable, bool]] = {  # key -> (row title, function, needs exact GPU math)
    "a-mlp": ("a. equivalence: MLP", check_mlp, True),
    "a-resnet": ("a. equivalence: ResNet (batch norm)", check_resnet, True),
    "a-gpt": ("a. equivalence: GPT (tied embedding)", check_gpt, True),
    "b-dlrm": ("b. heterogeneous cpu+gpu: DLRM", check_dlrm, True),
    "c-seed": ("c. seed ResNet-50: 2 stages vs 1 GPU", check_seed, False),
    "d-memory": ("d. peak memory per stage", check_memory, False),
    "e-launch": ("e. 2-process launch (NCCL)", check_launch, True),
    "f-amp": ("f. AMP fp16 across stages", check_fp16, False),
    "g-bf16": ("g. AMP bf16 across stages", check_bf16, False),
}
RESULT_TAG = "STATICPIPE_SELFTEST_ROW "  # a check's process prints its row on a line after this


def run_check(key: str, ctx: Context) -> Row:
    """One check in this process; an exception becomes a FAIL row naming it."""
    title, function, _ = CHECKS[key]
    start = time.perf_counter()
    try:
        devices, result, status = function(ctx)
    except Exception as exc:  # noqa: BLE001 -- reported in the row, the other checks still run
        traceback.print_exc()
        devices, result, status = "-", clip(f"error: {type(exc).__name__}: {exc}".replace("\n", " ")), FAIL
    return Row(title, devices, result, status, round(time.perf_counter() - start, 1))


def print_row(row: Row) -> None:
    """What a check's process prints last: its row, for ``run_isolated``."""
    print(RESULT_TAG + json.dumps(asdict(row)), flush=True)


def run_isolated(key: str, args) -> Row:
    """One check in a process of its own (``python -m staticpipe.selftest --worker KEY``), under a time
    limit; a crash or a hang becomes a FAIL row. The process's whole output is kept in
    ``args.log_dir``/<check>.log."""
    title, _, exact = CHECKS[key]
    cmd = [sys.executable, "-m", "staticpipe.selftest", "--worker", key]
    cmd += [flag for flag, on in (("--cpu", args.cpu), ("--quick", args.quick), ("--tf32", args.tf32)) if on]
    env = with_packages_on_path(os.environ)
    if exact and not args.tf32 and not args.cpu:
        env.update(NVIDIA_TF32_OVERRIDE="0", FLAGS_allow_tf32_cublas="0", FLAGS_cudnn_deterministic="1")
    timeout = args.timeout or (300 if args.cpu or args.quick else 900)
    start = time.perf_counter()
    code, output = run_group(cmd, env, timeout)
    seconds = round(time.perf_counter() - start, 1)
    log = os.path.join(args.log_dir, f"{key}.log")
    with open(log, "w") as f:
        f.write(output)
    rows = [line[len(RESULT_TAG):] for line in output.splitlines() if line.startswith(RESULT_TAG)]
    if rows:
        row = Row(**json.loads(rows[-1]))
        if row.status == FAIL:
            row.result += f" (log: {log})"
        return row
    lines = [line for line in output.splitlines() if line.strip()]
    why = f"timed out after {timeout:g} s (a hang?)" if code is None else f"the check's process exited with code {code}"
    return Row(title, "-", clip(f"{why}: {' | '.join(lines[-3:])}") + f" (log: {log})", FAIL, seconds)
