"""staticpipe.fleet's wider surface, against Paddle's meanings: local_rank, local/world device ids,
barrier_worker, get_hybrid_communicate_group (pipeline x data x sharding ranks from staticpipe's process
layout), _final_strategy / _get_applied_meta_list, ``main._pipeline_opt`` after minimize with Paddle's keys
(section_program holding this rank's ops), in one process and launched as 2 replicas x 2 stages; and the
learning rate held 0-D as Paddle holds it (state, fetch, checkpoints; an old (1,) value still loads)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import staticpipe
from staticpipe import fleet
from pipeline_util import fc_chain
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_ENV = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_RANK_IN_NODE", "PADDLE_LOCAL_DEVICE_IDS",
              "PADDLE_WORLD_DEVICE_IDS", "FLAGS_selected_gpus", "PADDLE_LOCAL_SIZE")


def paddles_pipeline_opt_keys() -> set[str]:
    """The keys Paddle's own fleet pipeline sets on the main program after minimize, read from its source."""
    import paddle.incubate.optimizer.pipeline as pipeline

    source = open(pipeline.__file__, encoding="utf-8").read()
    block = source[source.rindex("main_program._pipeline_opt = {"):]
    return set(re.findall(r'^\s*"(\w+)":', block[:block.index("}")], re.M))


def pipeline_strategy(pp=2, accumulate=2, **settings):
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {"accumulate_steps": accumulate, "micro_batch_size": 2}
    strategy.hybrid_configs = {"dp_degree": 1, "pp_degree": pp}
    for name, value in settings.items():
        setattr(strategy, name, value)
    return strategy


def batch(seed=0, size=4):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((size, 4)).astype(np.float32), "y": rng.integers(0, 4, (size, 1))}


@pytest.fixture
def one_process(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def test_ranks_and_device_ids_in_one_process_and_from_the_launchers_variables(one_process, monkeypatch):
    fleet.init(is_collective=True)
    assert (fleet.local_rank(), fleet.worker_index(), fleet.worker_num()) == ("0", 0, 1)
    gpus = ",".join(str(i) for i in range(staticpipe.placement.cuda_device_count()))
    assert fleet.local_device_ids() == gpus and fleet.world_device_ids() == gpus.replace(",", ":")
    fleet.barrier_worker()  # nothing to wait for
    # staticpipe.launch on one machine (no PADDLE_RANK_IN_NODE): the job rank, as a string like Paddle's
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "3")
    assert (fleet.local_rank(), fleet.worker_index(), fleet.worker_num()) == ("3", 3, 4)
    monkeypatch.setenv("FLAGS_selected_gpus", "3")
    assert (fleet.local_device_ids(), fleet.world_device_ids()) == ("3", "0,1,2,3")
    # Paddle's launchers' own variables win, as Paddle's role maker reads them
    for name, value in (("PADDLE_RANK_IN_NODE", "1"), ("PADDLE_LOCAL_DEVICE_IDS", "5"),
                        ("PADDLE_WORLD_DEVICE_IDS", "4,5,4,5")):
        monkeypatch.setenv(name, value)
    assert (fleet.local_rank(), fleet.local_device_ids(), fleet.world_device_ids()) == ("1", "5", "4,5,4,5")


def test_the_hybrid_group_follows_fleets_process_layout():
    """pp 2 x dp 2 x sharding 2 = 8 processes, laid out as fleet lays them out (outermost first: data, pipe,
    sharding): the same coordinates as Paddle's own topology for every process and a grid of degrees, so a
    script that works out its data shard from its process rank as Paddle's do is fed its replica's batches."""
    from paddle.distributed.fleet.base.topology import CommunicateTopology, ParallelMode

    got = [fleet.HybridCommunicateGroup(g, 8, pp=2, dp=2, sharding=2) for g in range(8)]
    assert [h.get_stage_id() for h in got] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [h.get_data_parallel_rank() for h in got] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [h.get_sharding_parallel_rank() for h in got] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [(h.is_first_stage, h.is_last_stage) for h in got[:3]] == [(True, False), (True, False), (False, True)]
    assert [h.get_rank_from_stage(0) for h in got] == [0, 1, 0, 1, 4, 5, 4, 5]
    assert got[5].get_rank_from_stage(1, data=0) == 3 and got[5].get_rank_from_stage(0, sharding=0) == 4
    with pytest.raises(ValueError, match=r"get_rank_from_stage: \{'model': 1\} names no process of this job"):
        got[5].get_rank_from_stage(0, model=1)
    for dp, pp, sharding in [(1, 2, 2), (2, 2, 2), (1, 4, 2), (2, 2, 4), (3, 2, 1), (2, 3, 2)]:
        n = dp * pp * sharding
        paddles = CommunicateTopology(["data", "pipe", "sharding", "sep", "model"], [dp, pp, sharding, 1, 1])
        for g in range(n):
            h, coord = fleet.HybridCommunicateGroup(g, n, pp=pp, dp=dp, sharding=sharding), paddles.get_coord(g)
            where = (dp, pp, sharding, g)
            assert (h.get_data_parallel_rank(), h.get_stage_id(), h.get_sharding_parallel_rank()) \
                == (coord.data, coord.pipe, coord.sharding), where
            assert [h.get_rank_from_stage(s) for s in range(pp)] \
                == [paddles.get_rank_from_stage(g, pipe=s) for s in range(pp)], where
    h = got[5]
    assert (h.get_global_rank(), h.get_data_parallel_world_size(), h.get_pipe_parallel_world_size(),
            h.get_sharding_parallel_world_size(), h.get_model_parallel_world_size(), h.get_model_parallel_rank(),
            h.get_parallel_mode()) == (5, 2, 2, 2, 1, 0, ParallelMode.PIPELINE_PARALLEL)
    assert fleet.HybridCommunicateGroup(1, 4, pp=1, dp=2, sharding=2).get_parallel_mode() \
        == ParallelMode.SHARDING_PARALLEL
    assert fleet.HybridCommunicateGroup(1, 2, pp=1, dp=2).get_parallel_mode() == ParallelMode.DATA_PARALLEL
    assert fleet.HybridCommunicateGroup(0, 1, pp=1, dp=1).get_parallel_mode() is None  # as Paddle's: no branch


def test_before_minimize_the_group_comes_from_the_strategy_given_to_init(one_process, monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "8")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "5")
    strategy = fleet.DistributedStrategy()
    strategy.sharding = True  # Paddle's static fleet reads the degrees from sharding_configs then
    strategy.sharding_configs = {"sharding_degree": 2, "pp_degree": 2, "dp_degree": 2}
    fleet.init(is_collective=True, strategy=strategy)
    h = fleet.get_hybrid_communicate_group()
    assert (h.get_stage_id(), h.get_data_parallel_rank(), h.get_sharding_parallel_rank(),
            h.get_data_parallel_world_size(), h.get_sharding_parallel_world_size()) == (0, 1, 1, 2, 2)  # fleet's layout
    hybrid = fleet.DistributedStrategy()
    hybrid.hybrid_configs = {"pp_degree": 4}  # dp_degree -1: the processes over the pipeline
    fleet.init(is_collective=True, strategy=hybrid)
    h = fleet.get_hybrid_communicate_group()
    assert (h.get_stage_id(), h.get_data_parallel_rank(), h.get_data_parallel_world_size()) == (1, 1, 2)


def test_one_process_after_minimize_hybrid_group_final_strategy_and_pipeline_opt(one_process, program_ir):
    fleet.init(is_collective=True)
    assert fleet._final_strategy() == {} and fleet._get_applied_meta_list() == []  # Paddle's, before minimize
    main, startup, loss = fc_chain(seed=7)
    strategy = pipeline_strategy(lamb=True)  # LAMB with SGD: Paddle's fleet does not apply it, nor does this
    with paddle.static.program_guard(main, startup):
        fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), strategy).minimize(loss)
    h = fleet.get_hybrid_communicate_group()
    assert (h.get_stage_id(), h.get_pipe_parallel_world_size(), h.get_data_parallel_world_size(),
            h.get_data_parallel_rank(), h.is_first_stage, h.is_last_stage, h.nranks) == (0, 2, 1, 0, True, True, 1)
    assert fleet._get_applied_meta_list() == ["PipelineOptimizer"]
    final = fleet._final_strategy()
    assert isinstance(final, paddle.distributed.fleet.DistributedStrategy)
    assert final.pipeline and not final.lamb and strategy.lamb  # the user's strategy unchanged
    opt = main._pipeline_opt
    assert set(opt) == paddles_pipeline_opt_keys() | {"section_programs"}
    assert {k: opt[k] for k in ("trainer", "device_worker", "pipeline_stage", "num_pipeline_stages", "schedule_mode",
                                "inner_parallelism", "num_microbatches", "sync_steps", "start_cpu_core_id")} == {
        "trainer": "PipelineTrainer", "device_worker": "Section", "pipeline_stage": 0, "num_pipeline_stages": 2,
        "schedule_mode": "1F1B", "inner_parallelism": 2, "num_microbatches": 2, "sync_steps": -1,
        "start_cpu_core_id": 0}
    plan = staticpipe.plan_of(main)
    assert sorted(opt["section_programs"]) == [0, 1]  # one process runs both stages
    for s in (0, 1):
        assert opt["section_programs"][s]["forward"] is plan.stages[s].sections["forward"].program
    if program_ir == "legacy":
        section = opt["section_program"]
        assert isinstance(section, paddle.static.Program)
        want = [op.type for s in (0, 1) for kind in ("forward", "backward", "optimize")
                for op in plan.stages[s].sections[kind].program.global_block().ops]
        assert [op.type for op in section.global_block().ops] == want
        assert {"send_v2", "recv_v2"} <= set(want)  # the stages' messages, as Paddle's section program has them
        names = {v.name for v in section.list_vars() if v.persistable}
        assert {p.name for p in main.all_parameters()} <= names and any("@GRAD" in n for n in names)  # buffers
        assert sorted(p.name for p in section.all_parameters()) == sorted(p.name for p in main.all_parameters())
        assert "fc_1.w_0" in str(section)  # a program description scripts write to a file
    else:
        assert opt["section_program"] is plan.stages[0].sections["forward"].program


def test_data_parallelism_alone_leaves_no_pipeline_opt_as_paddle(one_process):
    fleet.init(is_collective=True)
    main, startup, loss = fc_chain(("gpu:0",), seed=7)
    with paddle.static.program_guard(main, startup):
        fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), fleet.DistributedStrategy()).minimize(loss)
    assert main._pipeline_opt is None and fleet._get_applied_meta_list() == []


def test_pipeline_opt_changes_nothing_that_runs_the_program(one_process, tmp_path):
    """Training, evaluation clones, staticpipe's checkpoints and saved plans, and Paddle's save of the main
    program, with ``_pipeline_opt`` set, as without it (the same program minimized without fleet)."""
    results = []
    for how in ("fleet", "staticpipe"):
        fleet.init(is_collective=True)
        main, startup, loss = fc_chain(seed=7)
        with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
            test = main.clone(for_test=True)
            if how == "fleet":
                fleet.distributed_optimizer(paddle.optimizer.Adam(0.01), pipeline_strategy()).minimize(loss)
            else:
                staticpipe.PipelineOptimizer(paddle.optimizer.Adam(0.01), num_microbatches=2,
                                             loss_reduction="mean").minimize(loss)
        assert (main._pipeline_opt is not None) == (how == "fleet") and test._pipeline_opt is None
        exe = staticpipe.Executor()
        exe.run(startup)
        losses = [exe.run(main, feed=batch(step), fetch_list=[loss])[0] for step in range(3)]
        assert main.clone()._pipeline_opt is main._pipeline_opt  # Paddle's clone copies it, as for Paddle's
        evaluated = exe.run(test, feed=batch(9), fetch_list=[loss.name])[0]
        staticpipe.save(main, str(tmp_path / how / "ckpt"), exe)
        staticpipe.load(main, str(tmp_path / how / "ckpt"), exe)
        staticpipe.save_plan(main, str(tmp_path / how / "plan"))
        saved = _outcome(lambda: paddle.static.save(main, str(tmp_path / how / "paddle" / "model")))
        results.append((losses, evaluated, saved, exe.state_dict(main)))
        exe.close()
    (losses, evaluated, saved, state), (want_losses, want_evaluated, want_saved, want_state) = results
    np.testing.assert_array_equal(losses, want_losses)
    np.testing.assert_array_equal(evaluated, want_evaluated)
    assert saved == want_saved
    for name, value in want_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def _outcome(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001  (what Paddle raises, compared between the two programs)
        return type(error).__name__
    return "ok"


def _lr_program(pir: bool):
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with staticpipe.device_guard("gpu:0"):
            x = paddle.static.data("x", [-1, 4], "float32")
            h = paddle.static.nn.fc(x, 4)
        with staticpipe.device_guard("gpu:1"):
            loss = paddle.mean(paddle.static.nn.fc(h, 1))
        sched = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.1, 10), 2, 0.0, 0.1)
        opt = paddle.optimizer.AdamW(sched)
    return main, startup, loss, sched, opt


def test_the_learning_rate_is_held_0d_as_paddle_holds_it(one_process, program_ir, tmp_path):
    """Paddle 2.6 and 3.3 (legacy IR and PIR) hold and fetch the scheduled rate as a 0-D tensor; so does
    the pipeline (state_dict, fetch, checkpoints), and a rate saved as [1] before still loads."""
    pir = program_ir == "pir"
    main, startup, loss, sched, opt = _lr_program(pir)
    with paddle.static.program_guard(main, startup):
        opt.minimize(loss)
        rate = opt._global_learning_rate()
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):  # PIR's executor sets the rate in the global scope only
        exe.run(startup)
        [paddles_fetch] = exe.run(main, feed={"x": np.ones((4, 4), np.float32)}, fetch_list=[rate])
    name = sched._var_name if not pir else main.lr_name
    paddles = np.array(scope.find_var(name).get_tensor())
    assert paddles.shape == np.asarray(paddles_fetch).shape == ()

    fleet.init(is_collective=True)
    main, startup, loss, sched, opt = _lr_program(pir)
    with paddle.static.program_guard(main, startup):
        fleet.distributed_optimizer(opt, pipeline_strategy()).minimize(loss)
        rate = opt._global_learning_rate()
    name = sched._var_name if not pir else main.lr_name
    exe = staticpipe.Executor()
    exe.run(startup)
    for step in range(3):
        [got] = exe.run(main, feed={"x": np.ones((4, 4), np.float32)}, fetch_list=[rate])
        assert np.asarray(got).shape == () and float(got) == pytest.approx(sched())
        sched.step()
    state = exe.state_dict(main)
    assert state[name].shape == paddles.shape
    staticpipe.save(main, str(tmp_path / "ckpt"), exe)
    exe.set_state_dict(main, {**state, name: np.array([0.5], state[name].dtype)})  # a rate saved as [1] before
    assert exe.state_dict(main)[name].shape == () and float(exe.state_dict(main)[name]) == 0.5
    staticpipe.load(main, str(tmp_path / "ckpt"), exe)
    assert exe.state_dict(main)[name].shape == () and float(exe.state_dict(main)[name]) == float(state[name])
    exe.close()


LAUNCHED = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, os.path.join({repo!r}, "tests"))
    import numpy as np
    import staticpipe
    from staticpipe import fleet
    from staticpipe._paddle import paddle
    paddle.enable_static()
    from pipeline_util import fc_chain
    strategy = fleet.DistributedStrategy()
    strategy.pipeline = True
    strategy.pipeline_configs = {{"accumulate_steps": 2, "micro_batch_size": 2}}
    strategy.hybrid_configs = {{"dp_degree": 2, "pp_degree": 2}}
    fleet.init(is_collective=True, strategy=strategy)
    before = fleet.get_hybrid_communicate_group()
    main, startup, loss = fc_chain(seed=7)
    with paddle.static.program_guard(main, startup):
        fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), strategy).minimize(loss)
    exe = staticpipe.Executor()
    exe.run(startup)
    import time
    time.sleep(3 if fleet.worker_index() == 0 else 0)  # the others wait for it at the barrier
    start = time.time()
    fleet.barrier_worker()
    waited = time.time() - start
    exe.run(main, feed={{"x": np.ones((2 * 2, 4), np.float32), "y": np.zeros((2 * 2, 1), np.int64)}}, fetch_list=[loss])
    h, opt = fleet.get_hybrid_communicate_group(), main._pipeline_opt
    section = opt["section_program"]
    got = dict(local_rank=fleet.local_rank(), worker_index=fleet.worker_index(), worker_num=fleet.worker_num(),
               first=fleet.is_first_worker(),
               before=[before.get_stage_id(), before.get_data_parallel_rank(), before.get_data_parallel_world_size()],
               hcg=[h.get_global_rank(), h.get_stage_id(), h.get_data_parallel_rank(), h.get_data_parallel_world_size(),
                    h.get_pipe_parallel_world_size(), h.get_sharding_parallel_rank(),
                    h.get_sharding_parallel_world_size(), h.get_model_parallel_rank(),
                    h.get_model_parallel_world_size(), h.is_first_stage, h.is_last_stage],
               stage=opt["pipeline_stage"], stages=opt["num_pipeline_stages"], held=sorted(opt["section_programs"]),
               params=sorted(p.name for p in section.all_parameters()),
               ops=[op.type for op in section.global_block().ops], device_ids=fleet.local_device_ids(),
               waited=waited)
    fleet.barrier_worker()
    exe.close()
    with open(os.path.join({out!r}, "surface_%d.json" % fleet.worker_index()), "w") as f:
        json.dump(got, f)
""")


def test_launched_two_replicas_of_two_stages_every_rank_has_its_place(tmp_path):
    script = tmp_path / "surface.py"
    script.write_text(LAUNCHED.format(repo=REPO, out=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])  # staticpipe.launch
    done = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "4", str(script)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for g in range(4):
        got = json.loads((tmp_path / f"surface_{g}.json").read_text())
        stage, replica = g % 2, g // 2
        assert (got["local_rank"], got["worker_index"], got["worker_num"], got["first"]) == (str(g), g, 4, g == 0)
        assert got["before"] == [stage, replica, 2]  # from hybrid_configs, before minimize
        assert got["hcg"] == [g, stage, replica, 2, 2, 0, 1, 0, 1, stage == 0, stage == 1]
        assert (got["stage"], got["stages"], got["held"]) == (stage, 2, [stage])
        assert got["params"] == [f"fc_{stage}.b_0", f"fc_{stage}.w_0"]  # this rank's stage, not the other's
        assert ("send_v2" if stage == 0 else "recv_v2") in got["ops"]
        assert any("cross_entropy" in op for op in got["ops"]) == (stage == 1)  # the loss: the last stage's
        assert got["device_ids"] == ""  # gloo on CPU: no accelerator
        assert g == 0 or got["waited"] > 1.5  # barrier_worker waited for rank 0's 3 s
