"""What every check shares: its row, the context it runs in (CPU dry run or GPUs, sizes, tolerances,
places), exact GPU math for equivalence, and the comparison of two states."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from .._paddle import np, paddle, use_legacy_ir

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
MiB = 1 << 20


@dataclass
class Row:
    check: str
    devices: str
    result: str
    status: str
    seconds: float


class Context:
    """What a check needs to know: CPU dry run or GPUs, sizes, tolerances, places."""

    def __init__(self, cpu: bool, quick: bool, tf32: bool, in_process: bool = False):
        use_legacy_ir()  # on Paddle 3: the checks include AMP and saved plans, legacy-IR features there
        paddle.enable_static()
        self.cpu, self.quick, self.tf32, self.in_process = cpu, quick, tf32, in_process
        self.gpus = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() and not cpu else 0
        if cpu:
            self.rtol, self.atol = 1e-5, 1e-6
        elif tf32:
            self.rtol, self.atol = 1e-2, 1e-3
        else:
            self.rtol, self.atol = 1e-4, 1e-5

    @property
    def small(self) -> bool:
        return self.cpu or self.quick

    def place(self):
        """Where single-device references run: GPU 0, or the CPU in a dry run (never a CUDAPlace without
        a GPU: constructing one on a CPU build of Paddle kills the process)."""
        return paddle.CUDAPlace(0) if self.gpus else paddle.CPUPlace()

    def device_map(self, devices) -> dict:
        """Pipeline device -> GPU for a pipeline of more GPU devices than this machine has (gpu:k on GPU
        k mod count); empty when every device exists (and on CPU, where gpu:k are CPU devices anyway).
        Always a dict, so that STATICPIPE_DEVICE_MAP in the environment does not change a check."""
        if not self.gpus:
            return {}
        return {d: f"gpu:{int(d.split(':')[1]) % self.gpus}" for d in devices
                if d.startswith("gpu:") and int(d.split(":")[1]) >= self.gpus}

    def describe(self, devices) -> str:
        """The devices column: the pipeline's devices and where they ran."""
        devices = list(devices)
        if not self.gpus:
            return f"CPU: {'+'.join(devices)} as CPU devices"
        mapping = self.device_map(devices)
        used = sorted({mapping.get(d, d) for d in devices if d.startswith("gpu:")})
        where = ", ".join(f"GPU {u.split(':')[1]}" for u in used)
        cpu = "CPU + " if "cpu" in devices else ""
        mapped = f" (device map {', '.join(f'{k}->{v}' for k, v in mapping.items())})" if mapping else ""
        return f"{'+'.join(devices)} on {cpu}{where}{mapped}"

    def tolerance(self) -> str:
        if self.cpu:
            return f"rtol {self.rtol:g}, atol {self.atol:g}"
        return f"rtol {self.rtol:g}, atol {self.atol:g}, TF32 {'on' if self.tf32 else 'off'}"


@contextlib.contextmanager
def exact_gpu_math(ctx: Context) -> Iterator[None]:
    """TF32 off in cuBLAS and deterministic cuDNN algorithms for an equivalence check (unless --tf32);
    flags a CPU build does not define are skipped. The environment variables set for the check's process
    (NVIDIA_TF32_OVERRIDE=0, read when CUDA libraries start) do the rest."""
    wanted = {} if (ctx.tf32 or not ctx.gpus) else {"FLAGS_allow_tf32_cublas": False, "FLAGS_cudnn_deterministic": True}
    saved = {}
    for flag, value in wanted.items():
        try:
            saved.update(paddle.get_flags([flag]))
            paddle.set_flags({flag: value})
        except Exception:  # noqa: BLE001 -- not defined in this build of Paddle
            pass
    try:
        yield
    finally:
        for flag, value in saved.items():
            paddle.set_flags({flag: value})


def compare(got: dict, want: dict, ctx: Context) -> tuple[float, str, list[str]]:
    """(largest relative difference, its tensor, tensors beyond ``atol + rtol * |want|``) of ``got``
    against ``want`` (name -> array); a name in only one of them counts as beyond."""
    worst, worst_name = 0.0, "-"
    bad = sorted(set(got) ^ set(want))
    for name, ref in want.items():
        if name not in got or ref.size == 0:
            continue
        value = np.asarray(got[name])
        rel = float(np.max(np.abs(value.astype(np.float64) - ref))) / max(float(np.max(np.abs(ref))), 1e-30)
        if rel > worst:
            worst, worst_name = rel, name
        if not np.allclose(value, ref, rtol=ctx.rtol, atol=ctx.atol):
            bad.append(name)
    return worst, worst_name, bad


def timed(run: Callable, warmup: int, steps: int) -> tuple[float, list]:
    """(seconds of ``steps`` calls of ``run`` after ``warmup`` untimed ones, every call's result)."""
    results = [run() for _ in range(warmup)]
    start = time.perf_counter()
    results += [run() for _ in range(steps)]
    return time.perf_counter() - start, results


def clip(text: str, limit: int = 700) -> str:
    """``text`` cut to ``limit`` characters, keeping its start and its end (where a traceback ends)."""
    return text if len(text) <= limit else f"{text[:200]} ... {text[-(limit - 205):]}"
