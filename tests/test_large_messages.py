"""A 64 MiB cut tensor between two launched processes on gloo: 1F1B sends activations forward while the
gradients of the same size come back, the case in which blocking sends on shared buffers deadlock once
messages outgrow the transport's buffers (small test models never show it). The run must finish, equal
the threaded run bit for bit and single-device Paddle up to float32 summation order."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO, WIDTH, COPIES = 256, 64, 1024  # the cut: MICRO x (WIDTH * COPIES) float32 = 64 MiB

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    import numpy as np
    import staticpipe
    from test_large_messages import build, batch
    from staticpipe._paddle import paddle
    main, startup, loss = build(guarded=True)
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
    exe = staticpipe.Executor()
    exe.run(startup)
    rank = os.environ.get("PADDLE_TRAINER_ID", "single")
    np.savez(os.path.join(os.environ["OUT"], f"init_{{rank}}.npz"), **exe.state_dict(main))
    for step in range(3):
        exe.run(main, feed=batch(step))
    np.savez(os.path.join(os.environ["OUT"], f"state_{{rank}}.npz"), **exe.state_dict(main))
    cut = [v for r in staticpipe.plan_of(main).routes for v in r.vars]
    np.save(os.path.join(os.environ["OUT"], "cut_bytes.npy"), [int(np.prod(v.shape_for({micro}))) * 4 for v in cut])
""")


def build(guarded: bool):
    """x -> fc(64, tanh) -> tiled 1024 times (the 64 MiB cut) | mean of the copies -> fc(10) -> loss."""
    import staticpipe
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 1
    guard = staticpipe.device_guard if guarded else (lambda device: paddle.static.device_guard(None))
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with guard("gpu:0"):
            x = paddle.static.data("x", [None, WIDTH], "float32")
            label = paddle.static.data("label", [None, 1], "int64")
            wide = paddle.tile(paddle.static.nn.fc(x, WIDTH, activation="tanh"), [1, COPIES])
        with guard("gpu:1"):
            back = paddle.mean(paddle.reshape(wide, [-1, COPIES, WIDTH]), axis=1)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(paddle.static.nn.fc(back, 10), label))
    return main, startup, loss


def batch(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"x": rng.standard_normal((2 * MICRO, WIDTH), dtype=np.float32),
            "label": rng.integers(0, 10, (2 * MICRO, 1), dtype=np.int64)}


def test_a_64_mib_cut_tensor_crosses_two_processes_under_1f1b(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests"), micro=MICRO))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=REPO)
    for cmd in ([sys.executable, str(script)],
                [sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", str(script)]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(np.load(tmp_path / "cut_bytes.npy")) == [64 << 20, 64 << 20]  # the activation and its gradient
    single = dict(np.load(tmp_path / "state_single.npz"))
    launched = {**np.load(tmp_path / "state_0.npz"), **np.load(tmp_path / "state_1.npz")}
    assert sorted(launched) == sorted(single)
    for name, value in single.items():
        np.testing.assert_array_equal(launched[name], value, err_msg=name)

    main, startup, loss = build(guarded=False)
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():  # same names as the script's
        paddle.optimizer.SGD(0.1).minimize(loss)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(startup, scope=scope)
    for name, value in np.load(tmp_path / "init_single.npz").items():  # the same initializer seeds
        np.testing.assert_array_equal(value, np.array(scope.find_var(name).get_tensor()), err_msg=name)
    for step in range(3):
        exe.run(main, feed=batch(step), scope=scope)
    for name, value in single.items():
        np.testing.assert_allclose(value, np.array(scope.find_var(name).get_tensor()), rtol=1e-5, atol=1e-7,
                                   err_msg=name)
