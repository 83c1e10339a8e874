"""staticpipe.fleet: a Paddle fleet pipeline script, ported by imports and names, trains as one device does
(in one process and launched with data parallelism, each replica fed its own batches as Paddle's fleet
feeds them), with fleet's AMP; every ``*_configs`` of Paddle's strategy reads and writes as in Paddle; a
feature staticpipe does not implement runs where it is on at a degree or setting that changes nothing, and is
refused by name where it changes what training computes."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest
from google.protobuf.descriptor import FieldDescriptor

import staticpipe
from models import build_mlp
from pipeline_util import assert_same_training, fc_chain, train_twins
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


def refusal(configure, devices=("gpu:0", "gpu:1"), optimizer=lambda: paddle.optimizer.SGD(0.1)) -> str:
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    main, startup, loss = fc_chain(devices)
    with pytest.raises(ValueError) as err, paddle.static.program_guard(main, startup):
        configure(strategy)
        opt = fleet.distributed_optimizer(optimizer(), strategy)
        opt.minimize(loss)
    assert staticpipe.plan_of(main) is None
    return str(err.value)


def test_what_staticpipe_does_not_implement_is_refused_by_name():
    assert refusal(lambda s: [setattr(s, "sharding", True), setattr(s, "sharding_configs", {"stage": 2})]) == (
        "strategy.sharding_configs['stage'] = 2 (strategy.sharding = True): staticpipe shards the optimizer state "
        "only (ZeRO stage 1: sharding_configs['stage'] = 1); gradients and parameters (stages 2 and 3) are not "
        "sharded; set it to 1")
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
    assert refusal(offload) == ("strategy.recompute_configs['enable_offload'] = True (strategy.recompute = True): "
                                "staticpipe does not offload checkpoints to host memory; unset it")
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


PADDLES = paddle.distributed.fleet.DistributedStrategy
CONFIGS = sorted(n for n, _ in inspect.getmembers(PADDLES, lambda p: isinstance(p, property)) if n.endswith("_configs"))
# the parameter-server tables: Paddle's own properties, which neither reads nor writes a dict of protobuf fields
TABLES = ("fleet_desc_configs", "sparse_table_configs")


def fields_of(name: str) -> list:
    """The protobuf fields of Paddle's ``name`` configs (from the message's descriptor, not from a getter)."""
    return list(PADDLES().strategy.DESCRIPTOR.fields_by_name[name].message_type.fields)


def other_value(field, value=None):
    """A value of ``field``'s type other than ``value`` (its default), exactly representable in float32."""
    kind = field.type
    if kind == FieldDescriptor.TYPE_BOOL:
        return not value
    if kind == FieldDescriptor.TYPE_STRING:
        return (value or "") + "x"
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return 0.25 if value == 0.5 else 0.5
    return (value or 0) + 3


def test_every_configs_property_of_paddles_strategy_is_found_and_the_tables_are_paddles_own():
    assert {"sharding_configs", "tensor_parallel_configs", "gradient_merge_configs", "lamb_configs", "dgc_configs",
            "localsgd_configs", "lars_configs", "a_sync_configs", "pipeline_configs", "hybrid_configs"} <= set(CONFIGS)
    assert sorted(fleet.CONFIGS) == [n for n in CONFIGS if n not in TABLES]
    for name in TABLES:
        assert inspect.getattr_static(fleet.DistributedStrategy, name) is inspect.getattr_static(PADDLES, name)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in TABLES])
def test_a_config_reads_with_paddles_defaults(name):
    got = getattr(fleet.DistributedStrategy(), name)
    assert list(got) == [f.name for f in fields_of(name)]
    for field in fields_of(name):
        if field.type == FieldDescriptor.TYPE_MESSAGE and not field.is_repeated:  # Paddle returns the message
            assert got[field.name].ListFields() == [], field.name
        else:
            assert got[field.name] == ([] if field.is_repeated else field.default_value), field.name
    if PADDLE_MAJOR >= 3:  # Paddle 2.6's own getter fails (FieldDescriptor.label); Paddle 3's reads
        assert got == getattr(PADDLES(), name)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in TABLES])
def test_a_config_written_in_part_merges_into_it_as_in_paddle(name):
    """Every other scalar field is written (the rest keep their values), then a list field twice: Paddle's
    setters extend a list field, and so do these."""
    scalars = [f for f in fields_of(name) if not f.is_repeated and f.type not in (
        FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_ENUM)]
    lists = [f for f in fields_of(name) if f.is_repeated and f.type != FieldDescriptor.TYPE_MESSAGE]
    strategies = [fleet.DistributedStrategy()] + ([PADDLES()] if PADDLE_MAJOR >= 3 else [])
    before = getattr(strategies[0], name)
    part = {f.name: other_value(f, before[f.name]) for f in scalars[::2]}
    for strategy in strategies:
        setattr(strategy, name, dict(part))
        for f in lists[:1]:
            setattr(strategy, name, {f.name: [other_value(f)]})
            setattr(strategy, name, {f.name: [other_value(f), other_value(f, other_value(f))]})
    want = {**before, **part, **{f.name: [other_value(f), other_value(f), other_value(f, other_value(f))]
                                 for f in lists[:1]}}
    assert getattr(strategies[0], name) == want
    if PADDLE_MAJOR >= 3:
        assert getattr(strategies[1], name) == want  # Paddle's own strategy, written alike


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in TABLES])
def test_an_unknown_config_key_is_refused_as_paddle_refuses_it(name):
    strategy = fleet.DistributedStrategy()
    before = getattr(strategy, name)
    message = f"strategy.{name}: unknown key 'no_such_key'; its keys are {sorted(f.name for f in fields_of(name))}"
    for error in (AssertionError, ValueError):  # Paddle's, staticpipe's
        with pytest.raises(error, match=f"^{re.escape(message)}$"):
            setattr(strategy, name, {"no_such_key": 1})
    assert getattr(strategy, name) == before
    if PADDLE_MAJOR >= 3:
        with pytest.raises(AssertionError, match="no_such_key"):
            setattr(PADDLES(), name, {"no_such_key": 1})


def fleet_mlp(configure, make_opt):
    """A builder for ``train_twins``: the 2-stage MLP, pipelined by fleet with the strategy ``configure`` sets."""
    def build(guarded=True):
        net = build_mlp(num_stages=2, guarded=guarded, in_dim=8, hidden=16, depth=2, num_classes=4)
        if guarded:
            fleet.init(is_collective=True)
            strategy = fleet.DistributedStrategy()
            strategy.pipeline = True
            strategy.pipeline_configs = {"accumulate_steps": 2, "micro_batch_size": 8}
            configure(strategy)
            with paddle.static.program_guard(net.main, net.startup), paddle.utils.unique_name.guard():
                fleet.distributed_optimizer(make_opt(), strategy).minimize(net.loss)
        return net
    return build


def switched(**settings):
    """``configure`` for ``fleet_mlp``: each setting assigned to the strategy, in order."""
    return lambda strategy: [setattr(strategy, k, v) for k, v in settings.items()]


SGD, MOMENTUM = (lambda: paddle.optimizer.SGD(0.1)), (lambda: paddle.optimizer.Momentum(0.1, momentum=0.9))
CHANGE_NOTHING = {  # features on at a degree or setting that changes nothing here: (settings, optimizer)
    "sharding-degree-1": (switched(sharding=True, sharding_configs={"sharding_degree": 1}), MOMENTUM),
    # with pp_degree > 1 Paddle's sharding merges the pipeline's accumulate_steps, not gradient_merge_acc_step
    "sharding-degrees-of-the-pipeline": (switched(sharding=True, sharding_configs={
        "sharding_degree": 1, "pp_degree": 2, "dp_degree": 1, "gradient_merge_acc_step": 4}), MOMENTUM),
    "hybrid-sharding-degree-1": (switched(hybrid_configs={"sharding_degree": 1, "mp_degree": 1, "pp_degree": 2}),
                                 MOMENTUM),
    "tensor-parallel-degree-1": (switched(tensor_parallel=True, tensor_parallel_configs={
        "tensor_parallel_degree": 1}), MOMENTUM),
    "gradient-merge-k-steps-1": (switched(gradient_merge=True, gradient_merge_configs={"k_steps": 1}), MOMENTUM),
    "lamb-of-momentum": (switched(lamb=True), MOMENTUM),  # Paddle's fleet makes LAMB of Adam only
    "lars-of-sgd": (switched(lars=True), SGD),  # and LARS of Momentum only
    "replica-features-on-one-replica": (switched(dgc=True, localsgd=True, localsgd_configs={"k_steps": 4},
                                                 adaptive_localsgd=True, sync_batch_norm=True), MOMENTUM),
    "collective-tuning-and-no-ops": (switched(use_hierarchical_allreduce=True, fuse_grad_merge=True, elastic=True,
                                              a_sync=True, a_sync_configs={"k_steps": 4}), MOMENTUM),
}


@pytest.mark.parametrize("case", sorted(CHANGE_NOTHING))
def test_a_feature_on_where_it_changes_nothing_trains_like_one_device(case, program_ir):
    configure, make_opt = CHANGE_NOTHING[case]
    twin = train_twins(fleet_mlp(configure, make_opt), make_opt, steps=3, batch_size=16)
    assert_same_training(twin)
    assert twin.plan.num_stages == 2 and twin.plan.num_microbatches == 2


ADAM = lambda: paddle.optimizer.Adam(0.01)  # noqa: E731
TWO_REPLICAS = {"hybrid_configs": {"dp_degree": 2}}
REFUSED = {  # a feature on where it changes what training computes: (settings, optimizer, the message)
    "sharding-stage-3": (dict(sharding=True, sharding_configs={"sharding_degree": 2, "stage": 3}), SGD,
                         "strategy.sharding_configs['stage'] = 3 (strategy.sharding = True): staticpipe shards the "
                         "optimizer state only (ZeRO stage 1: sharding_configs['stage'] = 1); gradients and "
                         "parameters (stages 2 and 3) are not sharded; set it to 1"),
    "sharding-mp-degree": (dict(sharding=True, sharding_configs={"sharding_degree": 1, "mp_degree": 2}), SGD,
                           "strategy.sharding_configs['mp_degree'] = 2 (strategy.sharding = True): staticpipe runs "
                           "pipeline and data parallelism only (pp_degree, dp_degree); set it to 1"),
    "sharding-gradient-merge": (dict(sharding=True, sharding_configs={"sharding_degree": 1,
                                                                      "gradient_merge_acc_step": 4}), SGD,
                                "strategy.sharding_configs['gradient_merge_acc_step'] = 4 (strategy.sharding = True): "
                                "staticpipe does not merge gradients over steps; set it to 1 (a step already "
                                "averages the gradients of pipeline_configs['accumulate_steps'] micro-batches)"),
    "sharding-offload": (dict(sharding=True, sharding_configs={"sharding_degree": 1, "optimize_offload": True}),
                         SGD, "strategy.sharding_configs['optimize_offload'] = True (strategy.sharding = True): "
                              "staticpipe does not offload optimizer states to host memory; unset it"),
    "sharding-pp-degree": (dict(sharding=True, sharding_configs={"sharding_degree": 1, "pp_degree": 4}), SGD,
                           "strategy.sharding_configs['pp_degree'] = 4, but the program's device_guard tags name 2 "
                           "devices ['gpu:0', 'gpu:1']"),
    "sharding-dp-disagrees": (dict(hybrid_configs={"dp_degree": 2}, sharding=True,
                                   sharding_configs={"sharding_degree": 1}), SGD,
                              "strategy.hybrid_configs['dp_degree'] = 2 but strategy.sharding_configs['dp_degree'] = "
                              "1 (strategy.sharding = True): Paddle's static fleet reads the sharding_configs one; "
                              "make them agree"),
    "tensor-parallel-degree-2": (dict(tensor_parallel=True, tensor_parallel_configs={"tensor_parallel_degree": 2}),
                                 SGD, "strategy.tensor_parallel_configs['tensor_parallel_degree'] = 2 "
                                      "(strategy.tensor_parallel = True): staticpipe runs pipeline and data "
                                      "parallelism only (pp_degree, dp_degree); set it to 1"),
    "gradient-merge-k-steps-4": (dict(gradient_merge=True, gradient_merge_configs={"k_steps": 4}), SGD,
                                 "strategy.gradient_merge_configs['k_steps'] = 4 (strategy.gradient_merge = True): "
                                 "staticpipe does not merge gradients over steps; set it to 1 (a step already "
                                 "averages the gradients of pipeline_configs['accumulate_steps'] micro-batches)"),
    "lamb-of-adam": (dict(lamb=True), ADAM, "strategy.lamb = True with the optimizer Adam: Paddle's fleet trains "
                                            "it as LAMB, which staticpipe does not implement; unset strategy.lamb"),
    "lars-of-momentum": (dict(lars=True), MOMENTUM,
                         "strategy.lars = True with the optimizer Momentum: Paddle's fleet trains it as LARS, which "
                         "staticpipe does not implement; unset strategy.lars"),
    "dgc-with-replicas": (dict(dgc=True, **TWO_REPLICAS), MOMENTUM,
                          "strategy.dgc = True with the optimizer Momentum and 2 data-parallel replicas: Paddle's "
                          "fleet compresses their gradients (DGC), which staticpipe does not implement; unset it"),
    "localsgd-with-replicas": (dict(localsgd=True, localsgd_configs={"k_steps": 4}, **TWO_REPLICAS), SGD,
                               "strategy.localsgd_configs['k_steps'] = 4 (strategy.localsgd = True) with 2 "
                               "data-parallel replicas: staticpipe averages the replicas' gradients every step, not "
                               "their parameters every k_steps; set it to 1"),
    "adaptive-localsgd-with-replicas": (dict(adaptive_localsgd=True, **TWO_REPLICAS), SGD,
                                        "strategy.adaptive_localsgd = True with 2 data-parallel replicas: staticpipe "
                                        "averages the replicas' gradients every step, not their parameters every few "
                                        "steps; unset it"),
    "sync-batch-norm-with-replicas": (dict(sync_batch_norm=True, **TWO_REPLICAS), SGD,
                                      "strategy.sync_batch_norm = True with 2 data-parallel replicas: staticpipe does "
                                      "not synchronise batch-norm statistics across replicas; unset it"),
    "asp": (dict(asp=True), SGD, "strategy.asp = True: staticpipe does not implement asp; unset it"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_feature_on_where_it_changes_training_is_refused_naming_the_option_and_value(case):
    settings, make_opt, message = REFUSED[case]
    assert refusal(switched(**settings), optimizer=make_opt) == message


def test_one_stage_ignores_fleets_default_micro_batch_size_and_fetches_per_micro_batch_on_request():
    """Paddle ignores micro_batch_size (default 1) where nothing crosses stages: loader batches of 2 train.
    ``return_merged=False`` hands out each micro-batch's loss (Paddle's pipeline fetches the last one's)."""
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": 2}
    main, startup, loss = fc_chain(("gpu:0",))
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


@pytest.mark.parametrize("settings, replicas, shards", [
    (dict(sharding=True, sharding_configs={"sharding_degree": 2, "pp_degree": 2, "dp_degree": 2}), 4, 2),
    (dict(sharding=True, sharding_configs={"sharding_degree": 4, "pp_degree": 2}), 4, 4),  # dp_degree 1
    (dict(hybrid_configs={"sharding_degree": 2, "dp_degree": 3, "pp_degree": 2}), 6, 2),
    (dict(sharding=True, sharding_configs={"sharding_degree": 1, "pp_degree": 2, "dp_degree": 2,
                                           "_dp_as_optimizer_sharding": True}), 2, 2),
    (dict(sharding=True), 8, 8),  # Paddle's defaults: sharding_degree 8, dp_degree 1
], ids=["sharding2-dp2", "sharding4", "hybrid-sharding2-dp3", "dp-as-optimizer-sharding", "defaults"])
def test_fleet_sharding_configs_give_the_replicas_and_the_sharding_groups(settings, replicas, shards):
    """Paddle's static sharding: processes = pp x dp x sharding_degree, every sharding member a replica of its
    own data; the plan runs dp x sharding_degree replicas in groups of sharding_degree (tests/test_sharding.py
    trains them launched)."""
    main, startup, loss = fc_chain(["gpu:0", "gpu:1"])
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": 2, "micro_batch_size": 4}
    for key, value in settings.items():
        setattr(strategy, key, value)
    with paddle.static.program_guard(main, startup):
        fleet.distributed_optimizer(paddle.optimizer.Adam(0.01), strategy).minimize(loss)
    plan = staticpipe.plan_of(main)
    assert (plan.dp_degree, plan.sharding_degree, plan.replica_batches) == (replicas, shards, "own")
    assert all(len(st.shard_optimize) == shards for st in plan.stages)


def test_build_strategy_and_other_plain_properties_set_as_on_paddles_own_strategy():
    """Paddle 2.6's build_strategy setter asks protobuf 7 for ``label``: here it sets what Paddle 3.3's sets."""
    build = paddle.static.BuildStrategy()
    build.enable_addto, build.fuse_elewise_add_act_ops = True, True
    ours = fleet.DistributedStrategy()
    ours.build_strategy = build
    assert (ours.build_strategy.enable_addto, ours.build_strategy.fuse_elewise_add_act_ops) == (True, True)
    if PADDLE_MAJOR >= 3:  # Paddle's own setter works with today's protobuf there: the same message
        paddles = paddle.distributed.fleet.DistributedStrategy()
        paddles.build_strategy = build
        assert str(ours.strategy.build_strategy) == str(paddles.strategy.build_strategy)
    else:
        execution = paddle.static.ExecutionStrategy()
        execution.num_threads = 2
        ours.execution_strategy = execution
        assert ours.execution_strategy.num_threads == 2
    # a name Paddle's strategy lacks (its property is _calc_comm_same_stream) fares as on Paddle's own class
    outcomes = []
    for strategy in (fleet.DistributedStrategy(), paddle.distributed.fleet.DistributedStrategy()):
        try:
            strategy.calc_comm_same_stream = True
            outcomes.append(("set", strategy._calc_comm_same_stream))
        except TypeError as err:
            outcomes.append(("refused", str(err)))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("degree", [0, -1])
def test_a_sharding_degree_below_one_is_refused_naming_it(degree):
    def configure(s):
        s.sharding = True
        s.sharding_configs = {"sharding_degree": degree, "pp_degree": 2}
    assert refusal(configure) == (
        f"strategy.sharding_configs['sharding_degree'] = {degree} (strategy.sharding = True): sharding_degree must "
        "be an integer >= 1 (the replicas that share one copy of the optimizer state; 1: not sharded)")
    assert refusal(lambda s: setattr(s, "hybrid_configs", {"dp_degree": 0, "pp_degree": 2})) == (
        "strategy.hybrid_configs['dp_degree'] = 0: dp_degree must be an integer >= 1 (the data-parallel replicas; "
        "-1: the launched processes over the others)")


def test_get_loss_scaling_is_the_amp_decorators_variable_as_in_paddle(tmp_path):
    fleet.init(is_collective=True)
    strategy = fleet.DistributedStrategy()
    strategy.pipeline, strategy.amp = True, True
    strategy.pipeline_configs = {"accumulate_steps": 2, "micro_batch_size": 2}
    strategy.amp_configs = {"init_loss_scaling": 1024.0}
    main, startup, loss = fc_chain()
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), strategy)
    with pytest.raises(AssertionError, match=r"^Please call minimize\(\) before calling get_loss_scaling\(\)\.$"):
        opt.get_loss_scaling()  # Paddle's decorator's own check
    with paddle.static.program_guard(main, startup):
        opt.minimize(loss)
    scaling = opt.get_loss_scaling()
    assert opt._get_applied_meta_list() == fleet._get_applied_meta_list() == ["AMPOptimizer", "PipelineOptimizer"]
    assert scaling is opt._inner._loss_scaling and scaling.persistable and main.global_block().has_var(scaling.name)
    exe = staticpipe.Executor()
    exe.run(startup)
    feed = {"x": np.ones((4, 4), np.float32), "y": np.zeros((4, 1), np.int64)}
    assert exe.run(main, feed=feed, fetch_list=[scaling])[0].tolist() == [1024.0]
    exe.close()
    plain = fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), fleet.DistributedStrategy())
    for call, name in ((plain.get_loss_scaling, "get_loss_scaling"), (lambda: plain.qat_init(None), "qat_init")):
        with pytest.raises(AssertionError) as err:  # Paddle's type; a ValueError too
            call()
        assert isinstance(err.value, ValueError)
    assert str(err.value) == ("qat_init can only be used when the qat(quantization aware training) strategy is turned "
                              "on (strategy.qat = True), which staticpipe does not implement")
    with pytest.raises(ValueError, match=r"^get_loss_scaling can only be used when the amp\(auto mixed precision\) "
                       r"strategy is turned on \(strategy.amp = True\), as in Paddle's fleet$"):
        plain.get_loss_scaling()
    assert (plain.user_defined_optimizer, plain._user_defined_strategy) == (plain.inner_opt,
                                                                            plain.user_defined_strategy)


class _PaddlesRoles:
    def __init__(self, index, num):
        self._worker_index, self._worker_num = (lambda: index), (lambda: num)


def test_fleet_module_functions_in_one_process_as_paddles(monkeypatch, caplog, capsys):
    for name in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)
    names = [n for n in ("util", "UtilBase", "all_reduce", "worker_endpoints", "node_num", "is_worker", "is_server",
                         "rank", "nranks", "world_size", "rank_in_node", "init_worker", "stop_worker",
                         "save_persistables", "minimize", "barrier_worker", "is_first_worker")]
    assert [n for n in names if not hasattr(paddle.distributed.fleet, n)] == []  # all Paddle's names
    fleet.init(is_collective=True)
    assert (fleet.worker_endpoints(), fleet.worker_endpoints(to_string=True), fleet.node_num()) == (
        ["127.0.0.1:6170"], "127.0.0.1:6170", 1)  # Paddle's non-distributed role maker's
    assert (fleet.is_worker(), fleet.is_server(), fleet.rank(), fleet.nranks(), fleet.world_size()) == (
        True, False, 0, 1, 1)
    assert fleet.util.all_reduce((1, 2)) == (1, 2) and fleet.all_reduce(3) == 3 and fleet.util.all_gather(5) == 5
    fleet.util.barrier()
    fleet.util.print_on_rank("rank 0 here", 0)
    fleet.util.print_on_rank("rank 1 here", 1)
    assert capsys.readouterr().out == "rank 0 here\n"
    with pytest.raises(ValueError, match=r"^all_reduce mode='mean': Paddle's fleet reduces with one of "):
        fleet.util.all_reduce([1], "mean")
    with pytest.raises(TypeError, match="^files should be a list of file need to be read.$"):
        fleet.util.get_file_shard("a")
    files = [f"part-{i}" for i in range(7)]
    paddles = paddle.distributed.fleet.UtilBase()
    for num in (1, 2, 3, 4, 9):
        for index in range(num):
            monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(num))
            monkeypatch.setenv("PADDLE_TRAINER_ID", str(index))
            paddles._set_role_maker(_PaddlesRoles(index, num))
            assert fleet.util.get_file_shard(files) == paddles.get_file_shard(files), (num, index)
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170")
    assert (fleet.worker_endpoints(), fleet.node_num()) == (
        ["10.0.0.1:6170", "10.0.0.1:6171", "10.0.0.2:6170"], 2)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    caplog.set_level("WARNING", logger="staticpipe")
    for call, name in ((fleet.init_worker, "init_worker"), (fleet.stop_worker, "stop_worker"),
                       (lambda: fleet.save_persistables(None, "d"), "save_persistables")):
        caplog.clear()
        assert call() is None
        assert caplog.messages == [f"{name}() function doesn't work when use non_distributed fleet."]
    with pytest.raises(ValueError, match=r"^fleet.minimize before fleet.distributed_optimizer"):
        fleet.minimize(None)
    main, startup, loss = fc_chain(("gpu:0",))
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")  # launched: Paddle's runtime is made by minimize
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    with pytest.raises(ValueError, match=r"^fleet.stop_worker before minimize: Fleet can not find suitable runtime"):
        fleet.stop_worker()
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "1")
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(0.1))
    with paddle.static.program_guard(main, startup):
        assert fleet.minimize(loss) is not None and staticpipe.plan_of(main) is opt.plan
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    caplog.clear()
    fleet.init_worker()
    fleet.save_persistables(None, "d")
    assert caplog.messages == [
        "You should not call 'init_worker' method for collective mode.",
        "fleet.save_persistables(dirname='d') saves nothing in a collective job, as Paddle's fleet; save with "
        "paddle.static.save_persistables(executor, dirname, main_program) or staticpipe.save"]


UTIL_SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
import numpy as np
from staticpipe import fleet
fleet.init(is_collective=True)
rank = fleet.worker_index()
got = dict(sum=fleet.util.all_reduce([rank + 1, 10 * rank], "sum").tolist(),
           max=fleet.all_reduce(np.array([[rank, -rank]], np.float32), "max").tolist(),
           min=fleet.util.all_reduce((rank + 1.5,), mode="min").tolist(),
           gathered=fleet.util.all_gather(rank * 3), shard=fleet.util.get_file_shard(["a", "b", "c"]),
           endpoints=fleet.worker_endpoints(), nodes=fleet.node_num())
fleet.util.barrier()
fleet.util.print_on_rank("printed by " + str(rank), 1)
json.dump(got, open({out!r} + "/util_%d.json" % rank, "w"))
"""


def test_fleet_util_over_a_launched_job(tmp_path):
    script = tmp_path / "util.py"
    script.write_text(UTIL_SCRIPT.format(repo=REPO, out=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", str(script)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import json
    got = [json.load(open(tmp_path / f"util_{r}.json")) for r in range(2)]
    for rank, mine in enumerate(got):
        assert mine["sum"] == [3, 10] and mine["max"] == [[1.0, 0.0]] and mine["min"] == [1.5]
        assert mine["gathered"] == [0, 3] and mine["shard"] == [["a", "b"], ["c"]][rank]
        assert len(mine["endpoints"]) == 2 and mine["nodes"] == 1
    assert "printed by 1" in done.stdout + done.stderr and "printed by 0" not in done.stdout + done.stderr
