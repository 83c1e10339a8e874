"""Every example runs, on whichever Paddle this suite runs on (CI runs it on 2.6.2 and on 3.3.1), with small
sizes: the main job of the README and the others (the seed ResNet-50 job: tests/test_seed_example.py).
They run as a user runs them, without the suite's legacy-IR opt-in (conftest.py): on Paddle 3 the MLP, DLRM
and GPT examples build PIR programs, and those that need a legacy-only feature opt in themselves."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXAMPLES = {  # script (a case after a space) -> (small arguments, a line its last output must match)
    "train_mlp.py": (["--steps", "3", "--width", "64", "--batch", "64"],
                     r"^3 steps of 64 samples in [\d.]+ s: [\d.]+ samples/s on 2 pipeline stages; loss [\d.]+ -> [\d.]+$"),
    "train_mlp.py one thread": (["--steps", "3", "--width", "64", "--batch", "64", "--stages", "4",
                                 "--worker-threads", "1"],
                                r"^3 steps of 64 samples in [\d.]+ s: [\d.]+ samples/s on 4 pipeline stages; loss [\d.]+ -> [\d.]+$"),
    "train_dlrm.py": (["--steps", "3"], r"^devices \['cpu', 'gpu:0', 'gpu:1'\]; loss [\d.]+ -> [\d.]+$"),
    "train_gpt.py": (["--steps", "3"], r"^loss [\d.]+ -> [\d.]+; activation memory per stage: \{0: "),
    "auto_partition.py": (["--steps", "2", "--batch", "16", "--microbatches", "4"],
                          r"^loss [\d.]+ -> [\d.]+; last step's busy time per stage: "),
    "auto_plan.py": (["--steps", "2", "--cap-mib", "6", "--time-steps", "1", "--devices", "2"],  # predicted == measured
                     r"^activation peak per device, predicted / measured: gpu:0 (\S+ \S+) / \1, gpu:1 (\S+ \S+) / \2$"),
    "pretrain_gpt_fleet.py": (["--steps", "3"], r"^trained 3 steps; last loss [\d.]+$"),
    "kill_and_resume.py": (["--epochs", "2", "--kill-after", "5", "--dir", "{tmp}/runs"],
                           r"^after 20 steps, the killed and resumed job's parameters and optimizer state equal the "
                           r"undisturbed job's bit for bit$"),
    "run_saved_plan.py": (["--steps", "3", "--dir", "{tmp}/plan", "--width", "32"],
                          r"^trained 3 steps from .+/plan: loss [\d.]+ -> [\d.]+$"),
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(script, tmp_path):
    args, last = EXAMPLES[script]
    cmd = [sys.executable, os.path.join(REPO, "examples", script.split()[0])] + [a.format(tmp=tmp_path) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in ("STATICPIPE_LEGACY_IR", "FLAGS_enable_pir_api")}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [ln for ln in result.stdout.splitlines() if ln.strip()]
    assert lines and re.search(last, lines[-1]), result.stdout[-2000:]
