"""Fetching state that several stages hold (the learning rate, every stage's; a tied embedding, its owner's
and its copy's), in a job of one process per stage: every process gets the value, as one process does (it
used to be read from the first stage holding it only, and the others got None)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from staticpipe._paddle import PADDLE_MAJOR, np

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, os.path.join({repo!r}, "tests"))
    import numpy as np
    import staticpipe
    from staticpipe._paddle import paddle
    paddle.enable_static()
    from test_training_parity import tied_lm
    net = tied_lm(num_stages=2, head=True)
    with paddle.static.program_guard(net.main, net.startup):
        lr = paddle.optimizer.lr.PiecewiseDecay([1], [0.1, 0.05])
        inner = paddle.optimizer.SGD(lr)
        staticpipe.PipelineOptimizer(inner, num_microbatches=2).minimize(net.loss)
        rate = inner._global_learning_rate()  # the learning rate's variable (its name is Paddle's to choose)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    rank = os.environ.get("PADDLE_TRAINER_ID", "single")
    got = []
    for step in range(2):
        value, table = exe.run(net.main, feed=net.random_batch(4, seed=step), fetch_list=[rate, "embedding"])
        got += [np.asarray(value, np.float64).reshape(-1), np.asarray(table, np.float64).reshape(-1)]
        lr.step()
    np.savez(os.path.join({out!r}, f"fetched_{{rank}}.npz"), *got)
    exe.close()
""")


@pytest.mark.parametrize("ir", ["legacy"] + (["pir"] if PADDLE_MAJOR >= 3 else []))
def test_every_rank_fetches_state_that_several_stages_hold(tmp_path, ir):
    env = {k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")}
    if ir == "legacy":
        env["STATICPIPE_LEGACY_IR"] = "1"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, out=str(tmp_path)))
    for command in ([sys.executable, str(script)],
                    [sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", str(script)]):
        done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    single = list(np.load(tmp_path / "fetched_single.npz").values())
    assert [v[0] for v in single[0::2]] == pytest.approx([0.1, 0.05])  # the rate of each step, as scheduled
    for rank in ("0", "1"):
        for k, (got, want) in enumerate(zip(np.load(tmp_path / f"fetched_{rank}.npz").values(), single)):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, value {k}")
