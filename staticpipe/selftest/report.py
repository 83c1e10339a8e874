"""The report a user pastes into a bug report: what ran where (staticpipe, Paddle and its commit, the CUDA
and cuDNN Paddle was built with, the GPUs, Python, the CPU), then the checks' rows as one Markdown table."""
from __future__ import annotations

import os
import platform
from importlib import metadata

from .._paddle import paddle
from ..capabilities import describe
from .harness import FAIL, PASS, SKIP, Context, Row

GiB = 1 << 30


def environment() -> dict[str, str]:
    """The facts of this machine and installation a bug report needs, by name."""
    cuda = paddle.is_compiled_with_cuda()
    return {
        "staticpipe": f"{staticpipe_version()} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})",
        "Paddle": f"{paddle.__version__}, commit {paddle.version.commit}",
        "CUDA": paddle.version.cuda() if cuda else "none (a CPU build of Paddle)",
        "cuDNN": paddle.version.cudnn() if cuda else "none",
        "GPUs": gpus(),
        "Python": f"{platform.python_version()} ({platform.python_implementation()}) on {platform.platform()}",
        "CPU": describe().split("CPU: ", 1)[-1],
    }


def staticpipe_version() -> str:
    try:
        return metadata.version("staticpipe")
    except metadata.PackageNotFoundError:
        return "not installed"


def gpus() -> str:
    """The GPUs this process sees, their count and names (compute capability, memory); "no GPU" and why."""
    if not paddle.is_compiled_with_cuda():
        return "no GPU (a CPU build of Paddle)"
    count = paddle.device.cuda.device_count()
    if not count:
        return f"no GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r})"
    return f"{count}: " + "; ".join(_gpu(k) for k in range(count))


def _gpu(k: int) -> str:
    try:
        p = paddle.device.cuda.get_device_properties(k)
        return f"GPU {k} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / GiB:.0f} GiB)"
    except Exception:  # noqa: BLE001 -- the name alone, or the index alone: the report is still printed
        try:
            return f"GPU {k} {paddle.device.cuda.get_device_name(k)}"
        except Exception:  # noqa: BLE001
            return f"GPU {k}"


def title(ctx: Context) -> str:
    """The report's first line: what kind of run this is."""
    sizes = "quick sizes" if ctx.quick else "full sizes"
    isolation = "all checks in one process (--in-process)" if ctx.in_process else "each check in its own process"
    if ctx.cpu:
        return (f"staticpipe selftest, CPU DRY RUN (--cpu): every stage is a CPU device; these are NOT GPU "
                f"results. {sizes}, {isolation}")
    return (f"staticpipe selftest on {ctx.gpus} GPU(s): {sizes}, TF32 in equivalence rows: "
            f"{'on' if ctx.tf32 else 'off'}, {isolation}")


def fields(facts: dict[str, str]) -> str:
    """``facts`` as a Markdown list, one line each."""
    return "\n".join(f"- {name}: {value}" for name, value in facts.items())


def format_table(rows: list[Row], header: str) -> str:
    """The rows as one Markdown table under ``header``, and a line that counts them."""
    def cell(text: str) -> str:
        return text.replace("|", "/")

    out = [header, "", "| check | devices | result | status | seconds |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {cell(r.check)} | {cell(r.devices)} | {cell(r.result)} | {r.status} | {r.seconds:.1f} |" for r in rows]
    failed = [r.check for r in rows if r.status == FAIL]
    out.append("")
    out.append(f"{len(rows)} checks: {sum(r.status == PASS for r in rows)} passed, {len(failed)} failed, "
               f"{sum(r.status == SKIP for r in rows)} skipped" + (f" (failed: {'; '.join(failed)})" if failed else ""))
    return "\n".join(out)
