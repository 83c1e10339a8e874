"""staticpipe.fleet: a Paddle fleet pipeline script, ported by imports and names, trains as one device does
(in one process and launched with data parallelism, each replica fed its own batches as Paddle's fleet
feeds them), with fleet's AMP; what staticpipe does not implement is refused by name."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

import staticpipe
from staticpipe import fleet
from staticpipe._paddle import PADDLE_MAJOR, np, paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_fleet.py")
sys.path.insert(0, os.path.join(REPO, "examples"))
import train_fleet  # noqa: E402

STEPS = 3


def run_example(tmp_path, *args, nprocs=1, pir=False):
    """The example as a user runs it; ``pir``: with Paddle 3's default IR (the suite opts in to the legacy IR)."""
    cmd = [sys.executable, EXAMPLE, "--steps", str(STEPS), "--out", str(tmp_path), *args]
    if nprocs > 1:
        cmd = [sys.executable, "-m", "staticpipe.launch", "--nprocs", str(nprocs), *cmd[1:]]
    env = {k: v for k, v in os.environ.items() if not (pir and k == "STATICPIPE_LEGACY_IR")}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def one_device(dp: int, amp: bool):
    """The example's network on one device with Paddle's own optimizer (and AMP decorator), each step on
    the global batch: every replica's micro-batches of that step together. (parameters, losses)."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    startup.random_seed = 1
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        image = paddle.static.data("pixel", [-1, 1, 28, 28], "float32")
        label = paddle.static.data("label", [-1, 1], "int64")
        hidden = paddle.static.nn.fc(paddle.flatten(image, 1), 256, activation="relu")
        hidden = paddle.static.nn.fc(hidden, 128, activation="relu")
        hidden = paddle.static.nn.fc(hidden, 128, activation="relu")
        loss = paddle.mean(paddle.nn.functional.cross_entropy(paddle.static.nn.fc(hidden, 10), label))
        opt = paddle.optimizer.Momentum(0.05, momentum=0.9)
        if amp:
            opt = paddle.static.amp.decorate(opt, init_loss_scaling=1024.0, use_dynamic_loss_scaling=True)
        opt.minimize(loss)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(startup, scope=scope)
    shards = [list(train_fleet.mnist_like_reader(r, dp, STEPS)()) for r in range(dp)]
    per_step = train_fleet.ACCUMULATE_STEPS * train_fleet.MICRO_BATCH_SIZE
    losses = []
    for step in range(STEPS):
        samples = [s for shard in shards for s in shard[step * per_step:(step + 1) * per_step]]
        batch = {"pixel": np.array([s[0] for s in samples], np.float32).reshape(-1, 1, 28, 28),
                 "label": np.array([[s[1]] for s in samples], np.int64)}
        losses.append(float(exe.run(main, feed=batch, fetch_list=[loss], scope=scope)[0]))
    return {p.name: np.array(scope.find_var(p.name).get_tensor()) for p in main.all_parameters()}, losses


def assert_params(got: dict, want: dict):
    assert set(want) <= set(got)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16-amp"])
def test_the_fleet_script_in_one_process_trains_like_one_device(tmp_path, amp):
    out = run_example(tmp_path, *(["--amp"] if amp else []))
    assert f"trained {STEPS} steps of 1 x 4 x 8 samples" in out
    want, losses = one_device(1, amp)
    assert_params(dict(np.load(tmp_path / "params_single.npz")), want)
    np.testing.assert_allclose(np.load(tmp_path / "losses_single.npy"), losses, rtol=1e-5)


@pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")
def test_the_fleet_script_runs_on_pir_as_on_the_legacy_ir(tmp_path):
    run_example(tmp_path, pir=True)
    want, losses = one_device(1, False)
    assert_params(dict(np.load(tmp_path / "params_single.npz")), want)
    np.testing.assert_allclose(np.load(tmp_path / "losses_single.npy"), losses, rtol=1e-5)


def test_the_fleet_script_under_paddles_own_launcher_trains_like_one_device(tmp_path):
    """``python -m paddle.distributed.launch --nproc_per_node 2``, as a fleet script is started: 2 stages."""
    launcher = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(tmp_path / "log"),
                               "--nproc_per_node", "2", EXAMPLE, "--steps", str(STEPS), "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=280, cwd=tmp_path)
    logs = "".join(p.read_text()[-1500:] for p in sorted((tmp_path / "log").glob("workerlog.*")))
    assert launcher.returncode == 0, launcher.stdout[-1500:] + logs
    want, losses = one_device(1, False)
    assert_params({**np.load(tmp_path / "params_0.npz"), **np.load(tmp_path / "params_1.npz")}, want)
    np.testing.assert_allclose(np.load(tmp_path / "losses_1.npy"), losses, rtol=1e-5)  # the last stage's rank


def test_the_fleet_script_launched_two_replicas_of_two_stages_each_fed_its_own_batches(tmp_path):
    """4 processes, hybrid_configs dp 2 x pp 2: each replica's loader yields its own micro-batches of
    micro_batch_size (Paddle's meaning); the global batch is 2 x 4 x 8 and training equals one device on it."""
    out = run_example(tmp_path, "--dp", "2", nprocs=4)
    assert "trained 3 steps of 2 x 4 x 8 samples" in out
    assert "micro-batch size 8, 4 micro-batches per step, global batch 64 (2 replicas, each fed its own)" in out
    want, losses = one_device(2, False)
    replicas = [{**np.load(tmp_path / f"params_{2 * r}.npz"), **np.load(tmp_path / f"params_{2 * r + 1}.npz")}
                for r in range(2)]
    assert_params(replicas[0], want)
    for name, value in replicas[0].items():  # the replicas hold the same parameters, bit for bit
        np.testing.assert_array_equal(replicas[1][name], value, err_msg=name)
    np.testing.assert_allclose(np.load(tmp_path / "losses_1.npy"), losses, rtol=1e-5)  # the last stage's rank


def small_program(devices=("gpu:0", "gpu:1")):
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with contextlib.ExitStack() as stack:
            x = paddle.static.data("x", [-1, 4], "float32")
            y = paddle.static.data("y", [-1, 1], "int64")
            h = x
            for device in devices:
                stack.enter_context(staticpipe.device_guard(device))
                h = paddle.static.nn.fc(h, 4)
            loss = paddle.mean(paddle.nn.functional.cross_entropy(h, y))
    return main, startup, loss


def refusal(configure, when="minimize", devices=("gpu:0", "gpu:1")) -> str:
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    main, startup, loss = small_program(devices)
    with pytest.raises(ValueError) as err, paddle.static.program_guard(main, startup):
        configure(strategy)
        opt = fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), strategy)
        opt.minimize(loss)
    assert staticpipe.plan_of(main) is None
    return str(err.value)


def test_what_staticpipe_does_not_implement_is_refused_by_name():
    assert refusal(lambda s: setattr(s, "sharding", True)) == (
        "strategy.sharding = True: staticpipe does not implement sharding; unset it (a pipeline with data "
        "parallelism is hybrid_configs' dp_degree)")
    assert refusal(lambda s: setattr(s, "pipeline_configs", {"accumulate_steps": 2, "microbatch": 2})) == (
        "strategy.pipeline_configs: unknown key 'microbatch'; its keys are ['accumulate_steps', "
        "'enable_partial_send_recv', 'micro_batch_size', 'p2p_cache_shape', 'schedule_mode']")
    assert refusal(lambda s: setattr(s, "hybrid_configs", {"mp_degree": 2})) == (
        "strategy.hybrid_configs['mp_degree'] = 2: staticpipe runs pipeline and data parallelism only (pp_degree, "
        "dp_degree); set it to 1")
    assert refusal(lambda s: setattr(s, "hybrid_configs", {"pp_degree": 4})) == (
        "strategy.hybrid_configs['pp_degree'] = 4, but the program's device_guard tags name 2 devices "
        "['gpu:0', 'gpu:1']")
    assert refusal(lambda s: setattr(s, "pipeline", False)) == (
        "the program is guarded on 2 devices ['gpu:0', 'gpu:1'] but strategy.pipeline is False: set "
        "strategy.pipeline = True to train it as a pipeline")

    def pure_bf16(s):
        s.amp = True
        s.amp_configs = {"use_pure_bf16": True}
    assert refusal(pure_bf16) == (
        "strategy.amp_configs['use_pure_bf16'] = True: Paddle's fleet AMP decorates for float16 and staticpipe "
        "follows it; for bfloat16 wrap the optimizer in paddle.static.amp.bf16.decorate_bf16 yourself")

    def offload(s):
        s.recompute = True
        s.recompute_configs = {"checkpoints": ["x"], "enable_offload": True}
    assert refusal(offload) == ("strategy.recompute_configs['enable_offload'] = True: staticpipe does not offload "
                                "checkpoints to host memory; unset it")
    with pytest.raises(ValueError, match=r"^fleet.init\(is_collective=False\) starts a parameter-server job"):
        fleet.init()


def test_configs_read_back_with_paddles_defaults():
    strategy = fleet.DistributedStrategy()
    assert strategy.pipeline_configs == {"micro_batch_size": 1, "accumulate_steps": 1, "schedule_mode": "1F1B",
                                         "p2p_cache_shape": True, "enable_partial_send_recv": True}
    strategy.pipeline_configs = {"accumulate_steps": 4, "schedule_mode": "F-then-B"}
    assert strategy.pipeline_configs["accumulate_steps"] == 4 and strategy.pipeline_configs["micro_batch_size"] == 1
    strategy.recompute_configs = {"checkpoints": ["a", "b"]}
    assert strategy.recompute_configs["checkpoints"] == ["a", "b"]
    assert fleet.worker_index() == 0 and fleet.worker_num() == 1 and fleet.is_first_worker()


def test_one_stage_ignores_fleets_default_micro_batch_size_and_fetches_per_micro_batch_on_request():
    """Paddle ignores micro_batch_size (default 1) where nothing crosses stages: loader batches of 2 train.
    ``return_merged=False`` hands out each micro-batch's loss (Paddle's pipeline fetches the last one's)."""
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": 2}
    main, startup, loss = small_program(("gpu:0",))
    with paddle.static.program_guard(main, startup):
        fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), strategy).minimize(loss)
    exe = staticpipe.Executor()
    exe.run(startup)
    rng = np.random.default_rng(0)
    micro = [{"x": rng.standard_normal((2, 4)).astype(np.float32), "y": rng.integers(0, 4, (2, 1))} for _ in range(2)]
    state = exe.state_dict(main)
    [per_micro_batch] = exe.step(main, micro, [loss], return_merged=False)
    exe.set_state_dict(main, state)
    [merged] = exe.step(main, micro, [loss])
    assert len(per_micro_batch) == 2
    np.testing.assert_allclose(np.mean(per_micro_batch), merged, rtol=1e-6)
    exe.set_state_dict(main, state)
    batch = {k: np.concatenate([m[k] for m in micro]) for k in micro[0]}
    [again] = exe.run(main, feed=batch, fetch_list=[loss], return_merged=False)
    np.testing.assert_allclose(again, per_micro_batch, rtol=1e-6)
    exe.close()
