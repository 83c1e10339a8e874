"""ZeRO stage 1 (``sharding_degree``): each rank of a sharding group keeps its shard's optimizer state
and trains exactly what one device trains (``rewrite/sharding.py``, ``runtime/sharding.py``).

A GPT with a tied token table (first and last stage) and a global-norm clip, 2 stages, launched over
gloo with 2 or 4 replicas sharing one copy of the optimizer state, for Adam, AdamW and Momentum:
- after 3 steps every rank's parameters and the optimizer state it holds equal single-device Paddle
  training on the same global batches;
- each rank holds exactly its shard's optimizer state (the shards together are the whole state, no
  state twice), and its bytes are what the plan's memory model says for that rank;
- a checkpoint written by the sharded job holds the whole state and loads into a job of another
  sharding degree (and into one process), which then trains on equal to one device.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from models import build_gpt
from pipeline_util import minimize

import staticpipe
from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH, MICRO = 3, 16, 2
GPT = dict(num_stages=2, vocab=16, seq_len=4, d_model=8, n_heads=2, n_layers=2)
RTOL, ATOL = 1e-5, 1e-6  # float32 summation order of micro-batches and replicas (tests/test_distributed.py)


def build(guarded: bool = True):
    return build_gpt(guarded=guarded, seed=7, **GPT)


def make_optimizer(kind: str):
    clip = paddle.nn.ClipGradByGlobalNorm(0.05)  # small: the clip scales every step
    if kind == "Momentum":
        return paddle.optimizer.Momentum(0.1, momentum=0.9, grad_clip=clip)
    if kind == "AdamW":
        return paddle.optimizer.AdamW(paddle.optimizer.lr.StepDecay(0.01, step_size=1, gamma=0.5), weight_decay=0.01,
                                      grad_clip=clip)
    return paddle.optimizer.Adam(0.01, grad_clip=clip)


SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    import numpy as np
    import staticpipe
    from pipeline_util import minimize
    from staticpipe._paddle import paddle
    from staticpipe.ir import is_pir_program
    from test_sharding import BATCH, MICRO, STEPS, build, make_optimizer
    rank, out, env = int(os.environ["PADDLE_TRAINER_ID"]), os.environ["OUT"], os.environ
    net = build()
    minimize(net, make_optimizer(env["OPT"]), dict(num_microbatches=MICRO, dp_degree=int(env["DP"]),
                                                   sharding_degree=int(env["SHARDS"])))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    first = int(env.get("FIRST", "0"))
    if env.get("LOAD"):
        staticpipe.load(net.main, env["LOAD"], exe)
    plan = staticpipe.plan_of(net.main)
    moment = sorted(n for s in plan.stages for n in s.state_shards)[0]  # one member's optimizer state
    for step in range(first, first + STEPS):
        _, fetched = exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss, moment])
        if hasattr(net.main, "lr_scheduler"):
            net.main.lr_scheduler.step()
    state = exe.state_dict(net.main)
    np.savez(os.path.join(out, f"state_{{rank}}.npz"), **state)
    if fetched is not None:  # the member holding it: its value after the step; the others None
        np.save(os.path.join(out, f"fetched_{{rank}}.npy"), fetched)
    shard = plan.shard_of_process((rank, int(env["PADDLE_TRAINERS_NUM"])))
    stages = plan.stages_of_process((rank, int(env["PADDLE_TRAINERS_NUM"])))
    predicted = sum(plan.memory.stages[s.index].held_state_bytes(shard) for s in stages)
    measured = sum(v.nbytes for n, v in state.items() if any(
        n in s.persistables and n not in s.parameters for s in stages))
    with open(os.path.join(out, f"memory_{{rank}}.json"), "w") as f:
        json.dump(dict(predicted=predicted, measured=measured, shard=shard), f)
    if env.get("SAVE"):
        staticpipe.save(net.main, env["SAVE"], exe)
        if not is_pir_program(net.main):  # Paddle's, a file a variable (Paddle 3 has none for PIR programs)
            paddle.distributed.io.save_persistables(exe, env["SAVE"] + "-paddle", net.main)
    exe.close()
""")


def launch(tmp_path, ir: str, opt: str, dp: int, shards: int, **env: str) -> tuple[list, list, object]:
    """SCRIPT on 2 x ``dp`` processes: (each rank's state after its steps, its memory figures, the output directory)."""
    out = tmp_path / f"out-{dp}-{shards}"
    out.mkdir(exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests")))
    env = {**{k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")},
           **({"STATICPIPE_LEGACY_IR": "1"} if ir == "legacy" else {}), "OUT": str(out), "OPT": opt, "DP": str(dp),
           "SHARDS": str(shards), **env}
    done = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", str(2 * dp), str(script)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    return [dict(np.load(p)) for p in sorted(glob.glob(str(out / "state_*.npz")))], [
        json.load(open(p)) for p in sorted(glob.glob(str(out / "memory_*.json")))], out


def single_device(opt: str, steps: range) -> dict[str, np.ndarray]:
    """The state after single-device Paddle trains the GPT ``steps`` (the job's global batches)."""
    net = build(guarded=False)
    minimize(net, make_optimizer(opt), None)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        exe.run(net.startup)
        for step in steps:
            exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss])
            if hasattr(net.main, "lr_scheduler"):
                net.main.lr_scheduler.step()
    names = [v.name for v in net.main.list_vars() if v.persistable]
    return {n: np.array(scope.find_var(n).get_tensor()) for n in names
            if scope.find_var(n) is not None and scope.find_var(n).get_tensor()._is_initialized()}


def sharded_plan(opt: str, dp: int, shards: int):
    net = build()
    minimize(net, make_optimizer(opt), dict(num_microbatches=MICRO, dp_degree=dp, sharding_degree=shards))
    return staticpipe.plan_of(net.main)


def check_ranks(states, memory, want, plan, dp: int, shards: int, out) -> None:
    pipeline = len(plan.ranks)
    assert len(states) == pipeline * dp
    for rank, state in enumerate(states):
        replica, pipeline_rank = plan.place_of_process(rank)  # fleet's layout: test_fleet_surface checks it
        shard = replica % shards
        stages = [s for s in plan.stages if s.rank == pipeline_rank]
        sharded = {n: j for s in stages for n, j in s.state_shards.items()}
        assert sharded and {n for n in state if n in sharded} == {n for n, j in sharded.items() if j == shard}, \
            f"rank {rank} (shard {shard}) holds another shard's state or lacks its own"
        for name, value in state.items():
            np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL, err_msg=f"rank {rank}: {name}")
        assert memory[rank]["shard"] == shard and memory[rank]["measured"] == memory[rank]["predicted"], memory[rank]
    moment = sorted(n for s in plan.stages for n in s.state_shards)[0]
    fetched = [np.load(p) if os.path.exists(p) else None for p in (
        os.path.join(out, f"fetched_{rank}.npy") for rank in range(len(states)))]
    for rank, value in enumerate(fetched):  # fetched where held (the state saved after it), None elsewhere
        assert (value is None) == (moment not in states[rank]), f"rank {rank} fetched {moment}"
        if value is not None:
            np.testing.assert_array_equal(value, states[rank][moment])
    for r in range(pipeline):  # a group's shards together: the whole state of its stages, each name once
        held = [n for k in range(shards) for n in states[plan.process_of(k, r)] if n in {
            n for s in plan.stages if s.rank == r for n in s.state_shards}]
        assert len(held) == len(set(held)) and set(held) == {n for s in plan.stages if s.rank == r
                                                              for n in s.state_shards}


@pytest.mark.parametrize("opt, dp, shards", [("Adam", 2, 2), ("AdamW", 4, 4), ("Momentum", 4, 2)],
                         ids=["Adam-sharding2", "AdamW-sharding4", "Momentum-dp2xsharding2"])
def test_sharded_optimizer_state_trains_like_one_device(tmp_path, program_ir, opt, dp, shards):
    states, memory, out = launch(tmp_path, program_ir, opt, dp, shards)
    check_ranks(states, memory, single_device(opt, range(STEPS)), sharded_plan(opt, dp, shards), dp, shards, out)


@pytest.mark.parametrize("shards", [2, 4])
def test_each_shard_section_holds_only_its_own_state_and_the_shards_balance(program_ir, shards):
    from staticpipe.ir import declared

    plan = sharded_plan("AdamW", 4, shards)
    for stage in plan.stages:
        state = set(stage.persistables) - set(stage.parameters) - set(stage.grad_buffers)
        sharded = dict(stage.state_shards)
        # every moment and beta power of every parameter updated here is sharded; the learning rate is not
        assert len(sharded) >= 4 * len(stage.parameters) and set(sharded) < state
        assert sorted(set(stage.param_shards) & set(stage.parameters)) == sorted(stage.parameters)
        assert len(stage.shard_optimize) == shards
        for j, section in enumerate(stage.shard_optimize):
            names = {n for p in section.programs for n, _ in declared(p)}
            assert not names & stage.unheld(j), f"stage {stage.index} shard {j} declares another shard's state"
            assert {n for n, k in sharded.items() if k == j} <= names
        sizes = [plan.memory.stages[stage.index].held_state_bytes(j) for j in range(shards)]
        whole = plan.memory.stages[stage.index].state_bytes
        assert max(sizes) < whole and sum(sizes) - (shards - 1) * (whole - sum(
            plan.memory.stages[stage.index].shard_state_bytes)) == whole
    text = str(plan)
    assert f"4 data-parallel replicas (optimizer state sharded over groups of {shards})" in text
    assert text.count("optimizer state per rank of a sharding group: ") == len(plan.stages)


def test_sharding_degree_must_divide_the_replicas():
    with pytest.raises(ValueError, match=r"^sharding_degree must be an integer >= 1 that divides dp_degree \(2\): groups "
                                         r"of that many replicas share one copy of the optimizer state; got 4$"):
        staticpipe.PipelineOptimizer(paddle.optimizer.Adam(0.1), dp_degree=2, sharding_degree=4)


def test_a_sharded_checkpoint_holds_the_whole_state_and_loads_into_another_degree_and_one_process(
        tmp_path, program_ir):
    checkpoint = str(tmp_path / "ckpt")
    launch(tmp_path, program_ir, "AdamW", 2, 2, SAVE=checkpoint)
    if program_ir == "legacy":  # Paddle's save_persistables of the sharded job: one device's files (PIR has none)
        net = build(guarded=False)
        minimize(net, make_optimizer("AdamW"), None)
        exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            exe.run(net.startup)
            paddle.distributed.io.load_persistables(exe, checkpoint + "-paddle", net.main)
        for name, value in single_device("AdamW", range(STEPS)).items():
            np.testing.assert_allclose(np.array(scope.find_var(name).get_tensor()), value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"save_persistables: {name}")
    states, memory, out = launch(tmp_path, program_ir, "AdamW", 4, 4, LOAD=checkpoint, FIRST=str(STEPS))
    final = single_device("AdamW", range(2 * STEPS))
    check_ranks(states, memory, final, sharded_plan("AdamW", 4, 4), 4, 4, out)
    # one process, no replicas: the whole state from the sharded job's checkpoint (load refuses a checkpoint
    # that lacks any variable of the program, so a shard missing from it fails here)
    net = build()
    minimize(net, make_optimizer("AdamW"), dict(num_microbatches=MICRO))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    staticpipe.load(net.main, checkpoint, exe)
    for step in range(STEPS, 2 * STEPS):
        exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss])
        net.main.lr_scheduler.step()
    state = exe.state_dict(net.main)
    assert set(state) == set(final)
    for name, value in state.items():
        np.testing.assert_allclose(value, final[name], rtol=RTOL, atol=ATOL, err_msg=name)
    exe.close()
