"""Processes of the self-test's own: a command run in a session of its own under a time limit (so a hang
is killed with every process it started), with this process's staticpipe and models on its path."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import tempfile


def run_group(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own; on timeout kill the whole session (a launcher and its ranks).
    Returns (exit code or None on timeout, its output: stdout and stderr together)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        log.seek(0)
        return code, log.read()


def with_packages_on_path(env: dict) -> dict:
    """``env`` with the folders holding the staticpipe and models this process imported first on
    PYTHONPATH: a child process (a check, a script in a temporary folder, its launched ranks) imports the
    same copies from any working directory."""
    roots = []
    for package in ("staticpipe", "models"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin:
            root = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
            if root not in roots:
                roots.append(root)
    rest = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    return dict(env, PYTHONPATH=os.pathsep.join(roots + rest))
