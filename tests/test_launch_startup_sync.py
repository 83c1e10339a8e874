"""Launched ranks start from one state whatever their seeds (``runtime/startup_sync.py``).

Each process of a launched job runs the startup program itself. Here every rank builds its GPT with its
own initializer seeds (and ``paddle.seed``), 100 + rank, so each initialises every parameter differently,
as a GPU script that seeds only the CUDA generator does on CPUs. After ``exe.run(startup)`` every rank
must hold, for every parameter and optimizer state, the value of its owner in the first replica: the rank
of the first stage that holds it (the tied token embedding, read on the first and the last stage: rank
0's, on the last stage's rank too). Checked against single-device Paddle, on both IRs, for pp=2 and
dp=2 x pp=2:
- the initial state of every rank is, bit for bit, the owner's single-device startup with the owner's
  seed (the seeds differ: checked);
- AdamW with a learning-rate schedule trained 3 steps from that state equals single-device training
  from it, every parameter and optimizer moment on every rank (replicas and the tied copy alike);
- every rank fetches the learning rate (every stage holds it) and the tied embedding (its owner's and
  the last stage's copy) with the single-device values of each step (``runtime/step.py``);
- running the startup program again gives the same state again.
And a rank whose program declares a variable in another shape stops the job with an error naming it; a
rank whose startup program fails stops the others waiting in the broadcast within seconds.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from models import build_gpt
from pipeline_util import minimize

import staticpipe
from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH, MICRO = 3, 8, 2
GPT = dict(num_stages=2, vocab=16, seq_len=4, d_model=8, n_heads=2, n_layers=2)
RTOL, ATOL = 1e-5, 1e-7  # float32 summation order of micro-batches and replicas (tests/test_distributed.py)


def build(seed: int, guarded: bool = True, **changes):
    """The job's GPT, its initializers seeded by ``seed``."""
    return build_gpt(guarded=guarded, seed=seed, **{**GPT, **changes})


def make_optimizer():
    return paddle.optimizer.AdamW(paddle.optimizer.lr.StepDecay(0.01, step_size=1, gamma=0.5), weight_decay=0.01)


SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    import numpy as np
    import staticpipe
    from pipeline_util import minimize
    from staticpipe._paddle import paddle
    from staticpipe.ir import is_pir_program
    from test_launch_startup_sync import BATCH, MICRO, STEPS, build, make_optimizer
    rank, out = int(os.environ["PADDLE_TRAINER_ID"]), os.environ["OUT"]
    paddle.seed(100 + rank)  # deliberately different on every rank, as the initializers' seeds below
    net = build(100 + rank, **({{"vocab": 17}} if os.environ.get("ODD_RANK") == str(rank) else {{}}))
    assert is_pir_program(net.main) == (os.environ["IR"] == "pir")
    inner = make_optimizer()
    minimize(net, inner, dict(num_microbatches=MICRO, dp_degree=int(os.environ["DP"])))
    with paddle.static.program_guard(net.main, net.startup):
        rate = inner._global_learning_rate()  # the learning rate's variable (its name is Paddle's to choose)
    exe = staticpipe.Executor()
    if os.environ.get("FAIL_RANK") == str(rank):  # its startup program fails: the others wait in the broadcast
        import staticpipe.runtime.state as state
        def fail(*args):
            raise RuntimeError(f"the startup program failed on rank {{rank}}")
        state.run_startup = fail
    exe.run(net.startup)
    np.savez(os.path.join(out, f"init_{{rank}}.npz"), **exe.state_dict(net.main))
    fetched = {{}}
    for step in range(STEPS):
        got = exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss, rate, "tok_embedding"])
        for name, value in zip(("loss", "rate", "table"), got):
            fetched[f"{{name}}_{{step}}"] = np.array(np.nan) if value is None else np.asarray(value)
        net.main.lr_scheduler.step()
    np.savez(os.path.join(out, f"fetched_{{rank}}.npz"), **fetched)
    np.savez(os.path.join(out, f"state_{{rank}}.npz"), **exe.state_dict(net.main))
    exe.run(net.startup)  # again: the first replica's owners' values again
    np.savez(os.path.join(out, f"again_{{rank}}.npz"), **exe.state_dict(net.main))
    exe.close()
""")


def launch(tmp_path, ir: str, nprocs: int, dp: int, **env: str) -> subprocess.CompletedProcess:
    """SCRIPT on ``nprocs`` processes building ``ir`` programs (PIR: Paddle 3's default, no flags)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(repo=REPO, tests=os.path.join(REPO, "tests")))
    env = {**{k: v for k, v in os.environ.items() if k not in ("FLAGS_enable_pir_api", "STATICPIPE_LEGACY_IR")},
           **({"STATICPIPE_LEGACY_IR": "1"} if ir == "legacy" else {}), "OUT": str(tmp_path), "DP": str(dp), "IR": ir,
           **env}
    return subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", str(nprocs), str(script)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=240)


def per_rank(tmp_path, kind: str) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(p)) for p in sorted(glob.glob(str(tmp_path / f"{kind}_[0-9].npz")))]


def startup_state(seed: int, names) -> tuple[dict[str, np.ndarray], object, object, object]:
    """(``names``' values after the single-device startup of the model seeded ``seed``, the model, its
    executor and scope), the model minimized with the job's optimizer."""
    net = build(seed, guarded=False)
    minimize(net, make_optimizer(), None)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        exe.run(net.startup)
    return {n: np.array(scope.find_var(n).get_tensor()) for n in names
            if scope.find_var(n) is not None and scope.find_var(n).get_tensor()._is_initialized()}, net, exe, scope


def single_device(seeds: dict[str, int]) -> tuple[dict, list[dict], dict]:
    """(the initial state: each name's value after the single-device startup seeded ``seeds[name]``; each
    step's loss, learning rate and tied table after the step, and the final state of single-device Paddle
    training from it on the job's global batches)."""
    initial = {}
    for seed in sorted(set(seeds.values())):
        initial.update({n: v for n, v in startup_state(seed, seeds)[0].items() if seeds[n] == seed})
    _, net, exe, scope = startup_state(0, ())
    for name, value in initial.items():
        scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
    steps = []
    for step in range(STEPS):
        with paddle.static.scope_guard(scope):  # PIR's executor keeps a scheduled learning rate in the global scope
            loss, = exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss])
        steps.append(dict(loss=float(loss), rate=net.main.lr_scheduler(),
                          table=np.array(scope.find_var("tok_embedding").get_tensor())))
        net.main.lr_scheduler.step()
    return initial, steps, {n: np.array(scope.find_var(n).get_tensor()) for n in initial}


def owners_seeds(dp: int) -> dict[str, int]:
    """Every state name -> the seed its owner (the first replica's rank of the first stage that holds
    it) built with: 100 + that rank."""
    net = build(100)
    minimize(net, make_optimizer(), dict(num_microbatches=MICRO, dp_degree=dp))
    plan = staticpipe.plan_of(net.main)
    return {n: 100 + plan.stages[plan.stage_of_var(n)[0]].rank
            for st in plan.stages for n in st.persistables if n not in st.grad_buffers}


@pytest.mark.parametrize("nprocs, dp", [(2, 1), (4, 2)], ids=["pp2", "dp2xpp2"])
def test_every_rank_starts_from_the_first_replicas_owners_values_and_trains_like_one_device(
        tmp_path, program_ir, nprocs, dp):
    done = launch(tmp_path, program_ir, nprocs, dp)
    assert done.returncode == 0, done.stderr[-3000:]
    seeds = owners_seeds(dp)
    assert {seeds["tok_embedding"], max(seeds.values())} == {100, 101}  # the tied table: rank 0's, not 1's
    initial, steps, final = single_device(seeds)
    other = startup_state(101, ["tok_embedding"])[0]  # what the last stage's rank made of the tied table itself
    assert not np.array_equal(other["tok_embedding"], initial["tok_embedding"])
    inits, states, agains = per_rank(tmp_path, "init"), per_rank(tmp_path, "state"), per_rank(tmp_path, "again")
    assert len(inits) == len(states) == len(agains) == nprocs
    for rank in range(nprocs):
        held = sorted(inits[rank])
        assert held and set(held) <= set(initial) and sorted(states[rank]) == sorted(agains[rank]) == held
        for name in held:
            np.testing.assert_array_equal(inits[rank][name], initial[name], err_msg=f"rank {rank}: initial {name}")
            np.testing.assert_array_equal(agains[rank][name], initial[name], err_msg=f"rank {rank}: again {name}")
            np.testing.assert_allclose(states[rank][name], final[name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {rank}: {name} after {STEPS} steps")
    assert set().union(*inits) == set(initial)  # every state of the model is held somewhere
    for rank, fetched in enumerate(per_rank(tmp_path, "fetched")):
        for step, want in enumerate(steps):
            np.testing.assert_allclose(fetched[f"rate_{step}"], want["rate"], rtol=1e-7, err_msg=f"rank {rank}")
            np.testing.assert_allclose(fetched[f"table_{step}"], want["table"], rtol=RTOL, atol=ATOL,
                                       err_msg=f"rank {rank}: the tied table fetched at step {step}")
            if rank % 2:  # the last stage's ranks compute the loss (the global batch's)
                np.testing.assert_allclose(fetched[f"loss_{step}"], want["loss"], rtol=RTOL)


def test_a_rank_holding_a_variable_in_another_shape_stops_the_job_naming_it(tmp_path):
    done = launch(tmp_path, "legacy", 2, 1, ODD_RANK="1")  # rank 1's vocabulary is 17, rank 0's 16
    assert done.returncode != 0
    assert ("the ranks' startup states differ, rank 1: 'tok_embedding' is float32 [16, 8] on pipeline rank 0 "
            "(its owner) but float32 [17, 8] here; every rank must build the same program") in done.stderr


def test_a_rank_failing_in_its_startup_program_stops_the_others_waiting_in_the_broadcast(tmp_path):
    started = time.monotonic()
    done = launch(tmp_path, "legacy", 2, 1, FAIL_RANK="1")
    assert done.returncode != 0
    assert "RuntimeError: the startup program failed on rank 1" in done.stderr
    # the launcher or rank 0's watchdog, whichever sees it first, stops rank 0 naming rank 1
    assert "staticpipe.launch: rank 1 exited with code 1; stopping the other ranks" in done.stderr
    assert time.monotonic() - started < 60  # not gloo's timeout: measured 9 s on 2 cores
