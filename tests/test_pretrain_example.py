"""examples/pretrain_gpt_fleet.py, a fleet GPT pretraining script (tied embeddings, recompute, AdamW with
warm-up and cosine decay, global-norm clip, masked LM loss, sharding on), launched as written at a small
size: pipeline 2 x data parallel 2 x sharding 2 (8 gloo processes) trains what one process trains on the
same global batches.

The one-process run takes all 16 micro-batches of a step itself (``--accumulate 16``); launched, each of the
4 replicas takes 4 (replica r reads micro-batches r, r+4, ...), and fleet averages the 16 micro-batches'
gradients either way. Compared: every rank's final state (parameters, and the optimizer state it holds: its
shard's), the loss the last stage's ranks fetch, and the files ``save_persistables`` writes (legacy IR; PIR
programs have no ``save_persistables`` in Paddle 3, the script writes ``staticpipe.save`` there).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import pytest
from paddle.distributed.fleet.base.topology import CommunicateTopology

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "pretrain_gpt_fleet.py")
# float32 summation order: the replicas add their micro-batches' gradients in another order than one process
RTOL, ATOL = 1e-5, 1e-6


def run(cmd: list[str], ir: str, out) -> None:
    env = {**{k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")},
           **({"STATICPIPE_LEGACY_IR": "1"} if ir == "legacy" else {})}
    os.makedirs(out, exist_ok=True)
    done = subprocess.run(cmd + ["--steps", "3", "--out", str(out)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]


def per_variable_files(directory: str) -> dict[str, bytes]:
    return {os.path.relpath(p, directory): open(p, "rb").read()
            for p in glob.glob(os.path.join(directory, "**", "*"), recursive=True) if os.path.isfile(p)}


def test_the_fleet_pretraining_script_launched_pp2_dp2_sharding2_trains_what_one_process_trains(tmp_path, program_ir):
    run([sys.executable, SCRIPT, "--pp", "2", "--accumulate", "16"], program_ir, tmp_path / "one")
    run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "8", SCRIPT, "--pp", "2", "--dp", "2", "--sharding", "2"],
        program_ir, tmp_path / "many")
    one = dict(np.load(tmp_path / "one" / "state_0.npz"))
    want_losses = np.load(tmp_path / "one" / "losses_0.npy")
    held: dict[int, set[str]] = {0: set(), 1: set()}
    topology = CommunicateTopology(["data", "pipe", "sharding", "sep", "model"], [2, 2, 2, 1, 1])  # fleet's layout
    for rank in range(8):
        stage = topology.get_coord(rank).pipe
        state = dict(np.load(tmp_path / "many" / f"state_{rank}.npz"))
        held[stage] |= set(state)
        for name, value in state.items():
            np.testing.assert_allclose(value, one[name], rtol=RTOL, atol=ATOL, err_msg=f"rank {rank}: {name}")
        losses = np.load(tmp_path / "many" / f"losses_{rank}.npy")
        if stage == 1:  # the last stage's ranks fetch the loss: the global batch's
            np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    # each stage's ranks together hold its whole state (each rank its shard of the optimizer state)
    assert held[0] | held[1] == set(one) and held[0] != set(one) and held[1] != set(one)
    if program_ir == "legacy":  # save_persistables: one device's files, the same names, the values within tolerance
        ours, theirs = per_variable_files(tmp_path / "many" / "persistables"), per_variable_files(
            tmp_path / "one" / "persistables")
        assert sorted(ours) == sorted(theirs) and len(ours) == len(one)
        for name, data in ours.items():
            value = one[name]
            assert len(data) == len(theirs[name]), name
            got = np.frombuffer(data[len(data) - value.nbytes:], dtype=value.dtype).reshape(value.shape)
            np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL, err_msg=f"persistables/{name}")
