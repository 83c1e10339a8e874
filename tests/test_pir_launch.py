"""PIR programs with one stage per process (``staticpipe.launch``, gloo on CPU), against the same script's
threaded run in one process: every parameter and optimizer state, and the fetched losses, bit for bit.

The scripts run with no flags (the suite's legacy-IR opt-in taken out of their environment): the whole
process builds PIR programs, staticpipe's default on Paddle 3. ``tests/test_distributed.py`` checks the same on legacy programs against single-device Paddle;
``tests/test_pir.py`` checks the threaded PIR run against single-device PIR training.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from staticpipe._paddle import PADDLE_MAJOR

pytestmark = [pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR"), pytest.mark.timeout(300)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    import numpy as np
    import staticpipe
    from models import build_mlp
    from staticpipe._paddle import paddle
    net = build_mlp(num_stages=2, in_dim=16, hidden=16, depth=4)
    assert paddle.framework.in_pir_mode() and isinstance(net.main, paddle.pir.Program)
    with paddle.static.program_guard(net.main, net.startup):
        inner = paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=paddle.nn.ClipGradByGlobalNorm(2.6))
        opt = staticpipe.PipelineOptimizer(inner, num_microbatches=4, dp_degree=int(os.environ.get("DP", "1")))
        opt.minimize(net.loss)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    rank = os.environ.get("PADDLE_TRAINER_ID", "single")
    losses = []
    for step in range(3):
        loss, = exe.run(net.main, feed=net.random_batch(8, seed=step), fetch_list=[net.loss])
        losses.append(np.nan if loss is None else float(loss))
    np.savez(os.path.join(os.environ["OUT"], f"state_{{rank}}.npz"), **exe.state_dict(net.main))
    np.save(os.path.join(os.environ["OUT"], f"loss_{{rank}}.npy"), np.array(losses))
    exe.close()
""")


def run(tmp_path, nprocs: int, **env: str) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """(the merged state of every process, each process's fetched losses) of SCRIPT on ``nprocs``."""
    out = tmp_path / f"out{nprocs}_{env.get('DP', '1')}"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO))
    env = {**{k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")},
           "OUT": str(out), **env}
    command = [sys.executable, str(script)] if nprocs == 1 else [
        sys.executable, "-m", "staticpipe.launch", "--nprocs", str(nprocs), str(script)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    state: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(str(out / "state_*.npz"))):
        for name, value in np.load(path).items():
            if name in state:  # several replicas hold it: the same bits
                np.testing.assert_array_equal(value, state[name], err_msg=name)
            state[name] = value
    return state, [np.load(p) for p in sorted(glob.glob(str(out / "loss_*.npy")))]


@pytest.mark.parametrize("nprocs, dp", [(2, "1"), (4, "2")], ids=["pp2", "dp2xpp2"])
def test_launched_pir_pipeline_equals_the_threaded_one(tmp_path, nprocs, dp):
    """One pipeline over processes: the threaded run's bits. Two replicas (each trains on half of every
    global batch and they average their gradients): bit-identical replicas (``run`` checks), equal to the
    one pipeline up to float32 summation order (the tolerance of tests/test_distributed.py)."""
    single, (single_losses,) = run(tmp_path, 1)
    launched, losses = run(tmp_path, nprocs, DP=dp)
    assert set(launched) == set(single)
    rtol, atol = (0, 0) if dp == "1" else (1e-5, 1e-7)
    for name in single:
        np.testing.assert_allclose(launched[name], single[name], rtol=rtol, atol=atol, err_msg=name)
    fetched = [lo for lo in losses if not np.isnan(lo).any()]
    assert fetched
    for lo in fetched:
        np.testing.assert_allclose(lo, single_losses, rtol=rtol, atol=atol)
