"""A save killed (SIGKILL) after every file-system step it takes: a whole checkpoint, the old or the new,
always loads, and what the dead save left behind is cleaned up without getting in a later save's way."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Trains a net two steps (the old state at step 1, the new at step 2), then, for k = 1, 2, ...: saves the
# old checkpoint to k<k>/ck, forks, and in the child saves the new one over it with every file-system call
# traced, SIGKILLing itself right after the k-th step; until a child's save completes. The fork children
# save a fixed state through a stand-in executor (``save`` reads only ``gathered_state_dict`` and
# ``global_step``), so they run no pipeline threads.
DRIVER = r"""
import builtins, json, os, re, shutil, signal, sys, traceback
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import staticpipe
from staticpipe._paddle import np, paddle
from models import build_mlp
from pipeline_util import minimize

out = {out!r}
REAL_OPEN = builtins.open  # the traced save's steps are written with it, untraced
net = build_mlp(num_stages=2, hidden=16)
minimize(net, paddle.optimizer.Adam(0.01), dict(num_microbatches=2))
exe = staticpipe.Executor()
exe.run(net.startup)
states = []
for step in range(2):
    exe.run(net.main, feed=net.random_batch(8, seed=step))
    states.append(exe.state_dict(net.main))
np.savez(os.path.join(out, "old.npz"), **states[0])
np.savez(os.path.join(out, "new.npz"), **states[1])


class Frozen:
    def __init__(self, state, step):
        self.state, self.global_step = state, step

    def gathered_state_dict(self, program):
        return self.state

    def gathered_positions(self, program, mine):
        return [mine]


def trace(directory, after):
    # call after(description) right after each step that changes the file system
    def short(arg):
        if isinstance(arg, int):  # a file descriptor
            arg = os.readlink(f"/proc/self/fd/{{arg}}")
        text = os.path.relpath(arg, directory) if os.path.isabs(arg) else arg
        return re.sub(r"staticpipe-save-\d+-[0-9a-f]{{8}}", "staticpipe-save-<pid>-<hex>", text)

    def wrap(module, name, counts=lambda *a, **k: True):
        real = getattr(module, name)

        def traced(*args, **kwargs):
            result = real(*args, **kwargs)
            if counts(*args, **kwargs):
                after(f"{{name}}({{', '.join(short(a) for a in args[:2 if name in ('rename', 'replace') else 1])}})")
            if name == "open" and module is builtins and counts(*args, **kwargs):
                close = result.close
                result.close = lambda: (close(), after(f"close({{short(args[0])}})"))[0]
            return result
        setattr(module, name, traced)

    for name in ("mkdir", "fsync", "write", "rename", "replace", "unlink", "remove", "rmdir"):
        wrap(os, name)
    wrap(os, "open", lambda path, flags, *a, **k: bool(flags & os.O_CREAT))
    wrap(builtins, "open", lambda file, mode="r", *a, **k: any(c in mode for c in "wax+"))
    wrap(shutil, "rmtree")


def save_new(directory, after):
    pid = os.fork()
    if pid == 0:
        try:
            trace(directory, after)
            staticpipe.save(net.main, os.path.join(directory, "ck"), Frozen(states[1], 2))
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    return os.waitpid(pid, 0)[1]


def kill_after(k):
    count = [0]

    def after(step):
        count[0] += 1
        if count[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
    return after


results = []
for k in range(1, 1000):
    directory = os.path.join(out, f"k{{k:03d}}")
    os.makedirs(directory)
    staticpipe.save(net.main, os.path.join(directory, "ck"), Frozen(states[0], 1))
    status = save_new(directory, kill_after(k))
    results.append({{"k": k, "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
                     "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}})
    if not results[-1]["killed"]:
        break
directory = os.path.join(out, "traced")
os.makedirs(directory)
staticpipe.save(net.main, os.path.join(directory, "ck"), Frozen(states[0], 1))
steps_file = os.path.join(out, "steps.txt")
save_new(directory, lambda step: REAL_OPEN(steps_file, "a").write(step + "\n"))
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f)
"""


def test_a_save_killed_after_any_step_leaves_a_whole_checkpoint(tmp_path):
    """Each kill point k (the k-th file-system step of a save: make a directory, create, write, close or
    fsync a file, rename, delete) is checked: the checkpoint loads, its step and every array are all the
    old checkpoint's or all the new one's (never a mix), the old one up to the rename of the new one into
    place and the new one from there on; the load leaves no staging directory behind; a later save and
    load work.

    It guards against the mutation "delete the previous checkpoint before the new one is renamed into
    place" (a window with no loadable checkpoint): killed inside that window, no checkpoint loads."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=REPO, tests=os.path.join(REPO, "tests"), out=str(out)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    steps = (out / "steps.txt").read_text().splitlines()
    assert [r["killed"] for r in results] == [True] * len(steps) + [False] and results[-1]["exit"] == 0, \
        proc.stderr[-3000:]
    into_place = steps.index("rename(ck.staticpipe-save-<pid>-<hex>/new, ck)")

    references = {1: dict(np.load(out / "old.npz")), 2: dict(np.load(out / "new.npz"))}
    net = build_mlp(num_stages=2, hidden=16)
    minimize(net, paddle.optimizer.Adam(0.01), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    matrix = []
    for result in results:
        directory = out / f"k{result['k']:03d}"
        left = sorted(os.listdir(directory))
        step = staticpipe.load(net.main, str(directory / "ck"), exe)["step"]
        state = exe.state_dict(net.main)
        assert state.keys() == references[step].keys()
        for name, value in state.items():
            np.testing.assert_array_equal(value, references[step][name], err_msg=f"k={result['k']}: {name}")
        killed_after = steps[result["k"] - 1] if result["killed"] else "(not killed)"
        assert step == (1 if result["killed"] and result["k"] <= into_place else 2), killed_after
        assert os.listdir(directory) == ["ck"], f"k={result['k']}: left {os.listdir(directory)}"
        assert all(name == "ck" or re.fullmatch(r"ck\.staticpipe-save-\d+-[0-9a-f]{8}", name) for name in left), left
        staticpipe.save(net.main, str(directory / "ck"), exe, step=3)
        assert staticpipe.load(net.main, str(directory / "ck"), exe)["step"] == 3
        assert os.listdir(directory) == ["ck"]
        matrix.append(f"{result['k']:3d}  {killed_after:60s} {'old' if step == 1 else 'new'}  left {left}")
    print("\n".join(matrix))
    assert steps.index("rename(ck, ck.staticpipe-save-<pid>-<hex>/previous)") < into_place
