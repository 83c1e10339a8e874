"""Mutation check: plant known-bad edits in a copy of the repository and see that the tests catch each one.

Run from anywhere::

    python tests/mutation/run_mutants.py            # every mutant, baseline first; exit 1 if one survives
    python tests/mutation/run_mutants.py b e        # only mutants b and e
    python tests/mutation/run_mutants.py --all      # no -x: count every test a mutant fails (slower)
    python tests/mutation/run_mutants.py --list     # the mutants and their tests, nothing run
    python tests/mutation/run_mutants.py --extra    # the x mutants: checks that newer tests can fail
    python tests/mutation/run_mutants.py x1 --tests tests/test_models.py::test_resnet_loss_falls_as_in_single_device_training
    python tests/mutation/run_mutants.py --from-git HEAD   # mutate a commit's tree instead of the work tree

What it does:

1. copies the working tree (what is on disk now, tracked or not; no ``.git``, caches or build output) to a
   temporary directory (or, with ``--from-git REV``, that commit's tree via ``git archive``: useful while
   the working tree is half-edited and its own tests fail), and checks with a probe that
   ``python -m pytest`` run there imports the copy's ``staticpipe`` and ``models`` (``python -m`` puts
   the current directory first on ``sys.path``; ``PYTHONPATH`` is set to the copy too, so that
   subprocesses the tests start from another directory import the copy and not the editable install,
   which may point at yet another checkout);
2. runs every selected test once unmutated (the baseline): a mutant "caught" by a test that already fails
   would mean nothing, so a failing baseline stops the run;
3. for each mutant: replaces its exact ``old`` text (which must occur exactly once in the file, or the
   script stops and says the code moved: update the mutant) by ``new``, runs
   ``python -m pytest -q -x -p no:cacheprovider <its tests>`` with the copy as working directory, puts the
   file back, and records the first failing test (caught), SURVIVED, or TIMED OUT (the run outlived
   ``TIMEOUT_S`` although every test has a pytest-timeout: no verdict);
4. prints a table (mutant, file:line, seconds, caught by / SURVIVED, tests run) and exits 1 if any mutant
   survived or timed out (2 for a setup problem: old text not found, failing baseline, probe importing the
   wrong tree).

Bytecode is never written in the copy (``PYTHONDONTWRITEBYTECODE=1``): a mutant and the original of equal
size written within the same second could otherwise be served from a stale ``.pyc``.

The mutants are the issue-14 list: drop the 1/M loss-gradient scale; a local instead of a global norm;
skip the replica gradient mean; cooldown backwards in the wrong order; delete the old checkpoint before
the new one is in place; send a cut variable to the wrong stage; add a shared parameter's partial gradient
twice. The ``x`` mutants (``--extra``) check that tests written to replace weaker ones can fail: bugs
the old tests let through. Each entry's tests are chosen to be relevant and fast (2 CPU cores: the whole
run takes a few minutes); ``--all`` shows how many tests of that selection each mutant breaks.

This file is not a pytest test module (its name does not match ``test_*.py``), so the suite's collection
never runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "*.egg-info", ".benchmarks", "build",
                                "dist", "out", "*.pyc", "mutation")
TIMEOUT_S = 600  # one pytest run; beyond it a mutant gets no verdict (a hang must fail a test's own timeout)


@dataclass(frozen=True)
class Mutant:
    key: str
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, or "-k" expressions
    extra: bool = False  # not one of issue 14's list: a check that a newer test has teeth (run with --extra)


MUTANTS = [
    Mutant("a", "drop the 1/M loss-gradient scale", "staticpipe/rewrite/sections.py",
           old="            value = desc.attr(\"value\") / num_microbatches\n",
           new="            value = desc.attr(\"value\")\n",
           tests=("tests/test_equivalence.py::test_pipeline_equals_single_device",
                  "tests/test_training_parity.py::test_training_equals_single_device")),
    Mutant("b", "local norm instead of global (cross-stage sum not all-reduced)",
           "staticpipe/runtime/optimize_phase.py",
           old="            total = job.channel.allreduce((\"opt\", sums.pop()), rank, "
               "sum(parts[1:], parts[0].copy()),\n"
               "                                          len(plan.ranks))\n",
           new="            total = sum(parts[1:], parts[0].copy())  # this rank's stages only\n",
           tests=("tests/test_training_parity.py", "tests/test_verify.py")),
    Mutant("c", "skip the replica gradient mean", "staticpipe/runtime/optimize_phase.py",
           old="    scope: core._Scope = worker.scope\n"
               "    values = {n: np.array(tensor_of(scope, n, \"OPT\")) for n in buffers}\n",
           new="    return\n"
               "    scope: core._Scope = worker.scope\n"
               "    values = {n: np.array(tensor_of(scope, n, \"OPT\")) for n in buffers}\n",
           tests=("tests/test_distributed.py::"
                  "test_data_times_pipeline_parallel_equals_one_pipeline_on_the_global_batch",)),
    Mutant("d", "1F1B cooldown backwards in the wrong micro-batch order", "staticpipe/schedule/one_f_one_b.py",
           old="        acts += [B(s, i) for i in range(next_b, num_microbatches)]\n",
           new="        acts += [B(s, i) for i in reversed(range(next_b, num_microbatches))]\n",
           tests=("tests/test_schedule.py", "tests/test_schedule_lowering.py", "tests/test_schedule_sim.py")),
    Mutant("e", "delete the old checkpoint before the new one is in place", "staticpipe/atomic.py",
           old="            os.rename(target, os.path.join(staging, PREVIOUS))\n",
           new="            shutil.rmtree(target)\n",
           tests=("tests/test_checkpoint_crash.py", "tests/test_checkpoint_safety.py", "tests/test_checkpoint.py")),
    Mutant("f", "send a cut variable to the wrong stage (SEND peer assumes a forward chain: stage + 1)",
           "staticpipe/schedule/lowering.py",
           old="            out += [Action(Kind.SEND, a.stage, a.microbatch, r.index, r.dst.stage, r.channel)\n",
           new="            out += [Action(Kind.SEND, a.stage, a.microbatch, r.index, a.stage + 1, r.channel)\n",
           tests=("tests/test_schedule_lowering.py", "tests/test_schedule_sim.py")),
    Mutant("g", "add a shared parameter's partial gradient twice on its owner",
           "staticpipe/rewrite/optimize_section.py",
           old="            append_tagged_op(dst, \"elementwise_add\", device, ROLE_OPTIMIZE, "
               "inputs={\"X\": [target], \"Y\": [name]},\n"
               "                             outputs={\"Out\": [target]}, attrs={\"axis\": -1})\n",
           new="            for _ in range(2):\n"
               "                append_tagged_op(dst, \"elementwise_add\", device, ROLE_OPTIMIZE, "
               "inputs={\"X\": [target], \"Y\": [name]},\n"
               "                                 outputs={\"Out\": [target]}, attrs={\"axis\": -1})\n",
           tests=("tests/test_training_parity.py::test_tied_embedding_trains_like_single_device",
                  "tests/test_training_parity.py::test_gpt_with_adamw_warmup_cosine_and_global_norm_clipping")),
    Mutant("x5", "AMP: each stage skips on its own overflow flag (not or-ed over the stages)",
           "staticpipe/rewrite/optimize_section.py",
           old="        append_cast(dst, total, out, dtype, device, ROLE_OPTIMIZE)\n",
           new="        append_cast(dst, partial, out, dtype, device, ROLE_OPTIMIZE)\n",
           tests=("tests/test_amp.py",), extra=True),
    Mutant("x6", "AMP: every stage of a device updates the shared loss-scale state",
           "staticpipe/rewrite/optimize_section.py",
           old="        elif not item.updates_state:\n",
           new="        elif False:\n",
           tests=("tests/test_amp.py",), extra=True),
    # --extra: bugs that the tests these replace did not catch (a loss that only has to fall; a PNG whose
    # header alone was checked)
    Mutant("x1", "1/M loss-gradient scale off by one: 1/(M+1)", "staticpipe/rewrite/sections.py",
           old="            value = desc.attr(\"value\") / num_microbatches\n",
           new="            value = desc.attr(\"value\") / (num_microbatches + 1)\n",
           tests=("tests/test_models.py::test_resnet_loss_falls_as_in_single_device_training",), extra=True),
    Mutant("x2", "Gantt bars drawn in their stage's row instead of their rank's", "staticpipe/schedule/gantt.py",
           old="            y, h = (r + 0.3, 0.12) if thin else (r - 0.35, 0.6)\n",
           new="            y, h = (a.stage + 0.3, 0.12) if thin else (a.stage - 0.35, 0.6)\n",
           tests=("tests/test_schedule_sim.py::test_draw_gantt",), extra=True),
    Mutant("x3", "Gantt raw timelines not shifted to start at 0", "staticpipe/schedule/gantt.py",
           old="    return [(r, a, s - t0, e - t0) for r, a, s, e in events]\n",
           new="    return events\n",
           tests=("tests/test_schedule_sim.py::test_draw_gantt",), extra=True),
    Mutant("x4", "Gantt PNG saved before the layout is final", "staticpipe/schedule/gantt.py",
           old="    fig.tight_layout(rect=(0, 0, 1, 0.97))\n    fig.savefig(path, dpi=100)\n",
           new="    fig.savefig(path, dpi=100)\n    fig.tight_layout(rect=(0, 0, 1, 0.97))\n",
           tests=("tests/test_schedule_sim.py::test_draw_gantt",), extra=True),
]

PROBE = '''
import os, subprocess, sys, tempfile
import models, staticpipe

def test_where():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print("PROBE", staticpipe.__file__, models.__file__)
    assert staticpipe.__file__.startswith(root + os.sep), (staticpipe.__file__, root)
    assert models.__file__.startswith(root + os.sep), (models.__file__, root)
    out = subprocess.run([sys.executable, "-c", "import staticpipe; print(staticpipe.__file__)"],
                         cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True).stdout
    print("PROBE subprocess", out.strip())
    assert out.startswith(root + os.sep), (out, root)
'''


class SetupError(Exception):
    pass


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def pytest(copy: Path, args: list[str], stop_first: bool = True) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"] + (["-x"] if stop_first else [])
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd + args, cwd=copy, env=environment(copy), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -1, f"{exc.stdout or ''}\n(killed after {TIMEOUT_S} s)"
    return rc, out, time.perf_counter() - started


def failed_tests(out: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)


def locate(text: str, old: str, where: str) -> int:
    """The 1-based line of ``old`` in ``text``; ``old`` must occur exactly once."""
    count = text.count(old)
    if count != 1:
        raise SetupError(f"{where}: the mutant's old text occurs {count} times (expected once); the code moved, "
                         f"update the mutant:\n{old}")
    return text[:text.index(old)].count("\n") + 1


def make_copy(copy: Path, rev: str | None) -> None:
    if rev is None:
        shutil.copytree(REPO, copy, ignore=IGNORE, symlinks=True)
        return
    copy.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], capture_output=True)
    if archive.returncode != 0:
        raise SetupError(f"git archive {rev}: {archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive.stdout, check=True)


def run(mutants: list[Mutant], stop_first: bool, baseline: bool, rev: str | None = None,
        verbose: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="staticpipe-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        make_copy(copy, rev)
        for m in mutants:  # every mutant must still apply before anything runs
            locate((copy / m.path).read_text(), m.old, m.path)
        probe = copy / "tests" / "mutation_probe.py"  # not test_*.py: only runs when named
        probe.write_text(PROBE)
        rc, out, _ = pytest(copy, ["-s", str(probe.relative_to(copy))])
        probe.unlink()
        if rc != 0:
            raise SetupError(f"the probe failed: pytest in the copy does not import the copy\n{out[-3000:]}")
        print(f"copy of {'the working tree' if rev is None else rev}: {copy}")
        print("\n".join("  " + line for line in out.splitlines() if line.startswith("PROBE")))
        if baseline:
            selected = sorted({t for m in mutants for t in m.tests})
            rc, out, seconds = pytest(copy, selected, stop_first=False)
            if rc != 0:
                raise SetupError(f"the baseline (no mutant) fails, so a catch would mean nothing:\n{out[-3000:]}")
            print(f"baseline: {len(selected)} selections pass unmutated ({seconds:.0f} s)")
        rows = []
        for m in mutants:
            path = copy / m.path
            original = path.read_text()
            line = locate(original, m.old, m.path)
            path.write_text(original.replace(m.old, m.new))
            try:
                rc, out, seconds = pytest(copy, list(m.tests), stop_first=stop_first)
            finally:
                path.write_text(original)
            if rc == 0:
                verdict = "SURVIVED"
            elif rc == -1:
                verdict = "TIMED OUT"
            elif rc == 1:
                failed = failed_tests(out)
                verdict = (f"{len(failed)} failed, first: {failed[0]}" if not stop_first and failed else
                           failed[0] if failed else "rc 1")
            else:  # 2 interrupted (e.g. a collection error), 3 internal error, 4 usage error, 5 nothing collected
                raise SetupError(f"mutant {m.key}: pytest exited {rc}, which is no verdict:\n{out[-3000:]}")
            rows.append((m, f"{m.path}:{line}", verdict, seconds))
            print(f"  {m.key}: {verdict} ({seconds:.0f} s)", flush=True)
            if verbose:
                errors = [line for line in out.splitlines() if line.startswith("E ")][:8]
                print("".join(f"      {line[:200]}\n" for line in errors), end="")
    print_table(rows)
    survivors = [f"{m.key} ({verdict})" for m, _, verdict, _ in rows if verdict in ("SURVIVED", "TIMED OUT")]
    if survivors:
        print(f"\nnot caught: {', '.join(survivors)}")
        return 1
    print(f"\nall {len(rows)} mutants caught")
    return 0


def print_table(rows) -> None:
    print()
    print(f"{'mutant':<7} {'file:line':<42} {'seconds':>7}  result")
    for m, where, verdict, seconds in rows:
        result = verdict if verdict in ("SURVIVED", "TIMED OUT") else f"caught: {verdict}"
        print(f"{m.key:<7} {where:<42} {seconds:7.1f}  {result}")
        print(f"{'':<7} {m.name}")
        print(f"{'':<7} tests: {' '.join(m.tests)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keys", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--all", action="store_true", help="run every selected test (no -x) and count failures")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    parser.add_argument("--from-git", metavar="REV", help="mutate this commit's tree (git archive), not the work tree")
    parser.add_argument("--extra", action="store_true", help="run the x mutants (checks of newer tests) instead")
    parser.add_argument("--tests", nargs="+", metavar="ARG", help="run these pytest arguments instead of each "
                        "mutant's own tests (e.g. to see that an older test lets a mutant through)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each caught mutant's first error lines")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    unknown = set(args.keys) - {m.key for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; known: {' '.join(m.key for m in MUTANTS)}")
    mutants = [m for m in MUTANTS if m.key in args.keys] if args.keys else [m for m in MUTANTS if m.extra == args.extra]
    if args.tests:
        mutants = [dataclasses.replace(m, tests=tuple(args.tests)) for m in mutants]
    if args.list:
        for m in mutants:
            print(f"{m.key}) {m.name}: {m.path}\n     tests: {' '.join(m.tests)}")
        return 0
    started = time.perf_counter()
    try:
        code = run(mutants, stop_first=not args.all, baseline=not args.no_baseline, rev=args.from_git,
                   verbose=args.verbose)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"total {time.perf_counter() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
