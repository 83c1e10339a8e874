"""Paddle's own save and load calls on a pipelined program (``runtime/paddle_io.py``), issue 41 item 3.

A 2-stage MLP trained 2 steps with Adam by staticpipe; its state is put into the unguarded single-device
program, which plain Paddle saves with the same call. Checked on both IRs where Paddle has the call (on
PIR, ``save_persistables`` fails in Paddle for any program and the saves read ``global_scope()`` only,
after ``exe.flush()``: ``docs/checkpoints.md``):
- ``save_persistables`` (PIR: ``paddle.static.save_vars``), one file per variable and ``filename=``, writes
  byte for byte the files one device writes; ``load_persistables`` (legacy) loads them into a pipeline
  started from other values (every stage's state equal, and it trains on equal to the original), and
  ``load_vars`` into plain Paddle;
- ``exe.flush()`` then ``paddle.static.save`` writes the parameters and optimizer state one device
  writes (PIR: then fails on the device guards, as for any guarded program), and ``staticpipe.load`` loads
  them into a pipeline (``paddle.static.load`` asserts that its executor is Paddle's own class);
- ``save_inference_model`` of the evaluation program writes the parameters one device writes, and plain
  ``load_inference_model`` + ``paddle.static.Executor`` computes what it computes on the trained stages;
- with ``_pipeline_opt`` set as Paddle's fleet sets it, Paddle's ``sharding.utils.save_persistables`` (the
  section program, gradient buffers included) writes the one-device files, and they load back;
- launched (pp=2, dp=2 x pp=2): every rank calls ``save_persistables`` (main program, ``filename=``, and
  each rank's section program) and ``exe.flush()``, and ``paddle.static.save`` where it returns True; the
  whole model is written once, the files one device writes from the gathered state; every rank loads each
  back and the job then trains equal to the job that was not saved and loaded.
"""
from __future__ import annotations

import os
from functools import partial

import numpy as np
import paddle.distributed.io as dio
import pytest
from models import build_mlp
from pipeline_util import evaluation_net, launch_script, minimize

import staticpipe
from staticpipe._paddle import paddle
from staticpipe.ir import is_pir_program

pytestmark = pytest.mark.timeout(300)
STEPS, BATCH = 2, 8


def build(seed: int = 1, guarded: bool = True, dp: int = 1, sharding: int = 1):
    """The network minimized with Adam (a 2-stage pipeline when ``guarded``) and its evaluation program: the
    clone taken before minimize (PIR, which has none: built again in test mode, ``evaluation_net``)."""
    builder = partial(build_mlp, num_stages=2, guarded=guarded, in_dim=8, hidden=16, depth=2, seed=seed)
    net = builder()
    test = evaluation_net(net, builder)
    minimize(net, paddle.optimizer.Adam(0.01),
             dict(num_microbatches=2, dp_degree=dp, sharding_degree=sharding) if guarded else None)
    return net, test


def pipeline(seed: int = 1, steps: int = STEPS):
    net, test = build(seed)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(steps):
        exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss])
    return net, test, exe


def one_device(state: dict[str, np.ndarray] | None = None, seed: int = 1):
    """The unguarded program minimized alike, in a scope of its own holding ``state``."""
    net, test = build(seed, guarded=False)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        exe.run(net.startup)
    for name, value in (state or {}).items():  # (the learning rate: PIR makes it at the first run)
        scope.find_var(name).get_tensor().set(value, paddle.CPUPlace())
    return net, test, exe, scope


def files(root) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def scope_values(scope, names) -> dict[str, np.ndarray]:
    return {n: np.array(scope.find_var(n).get_tensor()) for n in names}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{what}: {name}")


def paddle_pipeline_opt(main, rank: int | None = None) -> dict:
    """A ``_pipeline_opt`` as Paddle's fleet pipeline leaves it on the main program: its ``section_program``
    declares every persistable variable of the sections of ``rank``'s stages (all stages: None), gradient
    buffers included, as Paddle's section program does."""
    plan, params = staticpipe.plan_of(main), {p.name for p in main.all_parameters()}
    section = paddle.static.Program()
    block = section.global_block()
    for stage in plan.stages:
        for sec in stage.sections.values() if rank is None or stage.rank == rank else ():
            for v in sec.program.list_vars() if sec is not None and sec.program is not None else ():
                if v.name in params and not block.has_var(v.name):  # a Parameter, as in Paddle's
                    block.create_parameter(name=v.name, shape=v.shape, dtype=v.dtype)
                elif v.persistable and not block.has_var(v.name):
                    block.create_var(name=v.name, shape=v.shape, dtype=v.dtype, type=v.type, persistable=True)
    return {"trainer": "PipelineTrainer", "device_worker": "Section", "pipeline_stage": rank or 0,
            "num_pipeline_stages": len(plan.ranks), "section_program": section,
            "num_microbatches": plan.num_microbatches}


def test_with_pipeline_opt_set_scripts_save_the_section_program_as_one_device(tmp_path):
    """A script's checkpoint line under fleet: Paddle's ``sharding.utils.save_persistables`` saves
    ``main._pipeline_opt['section_program']`` (it holds gradient buffers too); and ``save_persistables`` of
    the main program is unchanged by ``_pipeline_opt``."""
    from paddle.distributed.fleet.meta_optimizers.sharding import utils as sharding_utils
    net, _, exe = pipeline()
    state = exe.state_dict(net.main)
    net.main._pipeline_opt = paddle_pipeline_opt(net.main)
    section = net.main._pipeline_opt["section_program"]
    assert any("@GRAD@MERGED" in v.name for v in section.list_vars())
    ref, _, ref_exe, ref_scope = one_device(state)
    with paddle.static.scope_guard(ref_scope):
        dio.save_persistables(ref_exe, str(tmp_path / "one"), ref.main)
    with paddle.static.scope_guard(paddle.static.Scope()):
        sharding_utils.save_persistables(exe, str(tmp_path / "section"), net.main)
        dio.save_persistables(exe, str(tmp_path / "main"), net.main)
    assert files(tmp_path / "section") == files(tmp_path / "one") == files(tmp_path / "main")
    other, _, exe2 = pipeline(seed=7, steps=0)
    with paddle.static.scope_guard(paddle.static.Scope()):
        dio.load_persistables(exe2, str(tmp_path / "section"), section)  # the section's buffers are not read
    assert_same(exe2.state_dict(other.main), state, "loaded through the section program")


def save_vars(exe, path, program, filename):
    """What a script calls: ``save_persistables`` (legacy IR); on PIR, where it fails on any program (a PIR
    program has no ``_is_distributed``), ``paddle.static.save_vars``, which reads ``global_scope()`` only."""
    if is_pir_program(program):
        return paddle.static.save_vars(exe, str(path), program, filename=filename)
    return dio.save_persistables(exe, str(path), program, filename=filename)


@pytest.mark.parametrize("filename", [None, "persistables"])
def test_save_persistables_writes_what_one_device_writes_and_loads_into_either(tmp_path, program_ir, filename):
    net, _, exe = pipeline()
    state = exe.state_dict(net.main)
    ref, _, ref_exe, ref_scope = one_device(state)
    with paddle.static.scope_guard(paddle.static.Scope()):
        if program_ir == "pir":
            assert exe.flush()  # PIR's save_vars never calls the executor: it reads what flush put there
        save_vars(exe, tmp_path / "pipe", net.main, filename)
    with paddle.static.scope_guard(ref_scope):
        save_vars(ref_exe, tmp_path / "one", ref.main, filename)
    written = files(tmp_path / "pipe")
    assert written == files(tmp_path / "one")  # the same files, byte for byte
    assert len(written) == (1 if filename else len(state)) and len(state) == 31  # 6 parameters, 24 moments, lr

    plain, _, plain_exe, plain_scope = one_device(seed=7)
    with paddle.static.scope_guard(plain_scope):
        paddle.static.load_vars(plain_exe, str(tmp_path / "pipe"), plain.main, filename=filename,
                                predicate=lambda v: v.persistable)  # (PIR: the parameters and optimizer state)
    assert_same(scope_values(plain_scope, state), state, "loaded into plain Paddle")
    if program_ir == "pir":
        return  # PIR's load_vars asserts that its executor is Paddle's own class
    other, _, exe2 = pipeline(seed=7, steps=0)  # another initialisation: every value differs first
    assert all(not np.array_equal(v, state[n]) for n, v in exe2.state_dict(other.main).items() if "pow_acc" not in n
               and "learning_rate" not in n)
    with paddle.static.scope_guard(paddle.static.Scope()):
        dio.load_persistables(exe2, str(tmp_path / "pipe"), other.main, filename=filename)
    assert_same(exe2.state_dict(other.main), state, "loaded into the pipeline")
    batch = net.random_batch(BATCH, seed=STEPS)  # and it trains on as the saved pipeline does
    assert exe2.run(other.main, feed=batch, fetch_list=[other.loss]) == exe.run(net.main, feed=batch,
                                                                                 fetch_list=[net.loss])
    assert_same(exe2.state_dict(other.main), exe.state_dict(net.main), "trained on after the load")


def test_paddle_static_save_after_flush_writes_what_one_device_writes(tmp_path, program_ir):
    net, _, exe = pipeline()
    state = exe.state_dict(net.main)
    ref, _, _, ref_scope = one_device(state)
    with paddle.static.scope_guard(paddle.static.Scope()):
        assert exe.flush()  # Paddle's "flush trainer params to the root scope": what paddle.static.save reads
        if program_ir == "legacy":
            paddle.static.save(net.main, str(tmp_path / "pipe" / "model"))
        else:  # the parameters and optimizer state are written, then PIR refuses to serialize device guards
            with pytest.raises(ValueError, match="attr name op_device not supposed be serialized"):
                paddle.static.save(net.main, str(tmp_path / "pipe" / "model"))
    with paddle.static.scope_guard(ref_scope):
        paddle.static.save(ref.main, str(tmp_path / "one" / "model"))
    for suffix in (".pdparams", ".pdopt"):
        got, want = (paddle.static.load_program_state(str(tmp_path / d / "model") + suffix) for d in ("pipe", "one"))
        assert_same(got, want, suffix)
    assert_same({**paddle.static.load_program_state(str(tmp_path / "pipe" / "model"))}, state, "saved state")
    other, _, exe2 = pipeline(seed=7, steps=0)  # paddle.static.load refuses any executor but Paddle's own:
    staticpipe.load(other.main, str(tmp_path / "pipe"), exe2)  # staticpipe.load reads paddle.static.save's files
    assert_same(exe2.state_dict(other.main), state, "paddle.static.save's files loaded into the pipeline")


def test_save_inference_model_of_the_evaluation_clone_runs_in_plain_paddle(tmp_path, program_ir):
    net, test, exe = pipeline()
    batch = net.random_batch(BATCH, seed=9)
    expected, = exe.run(test.main, feed=batch, fetch_list=[test.outputs["logits"]])  # on the trained stages
    ref, ref_test, ref_exe, ref_scope = one_device(exe.state_dict(net.main))
    with paddle.static.scope_guard(paddle.static.Scope()):
        if program_ir == "pir":  # PIR's saver reads global_scope() only, and serializes no device guard:
            assert exe.flush()  # the unguarded evaluation program (the same names) with the pipeline's state
            test = ref_test
        paddle.static.save_inference_model(str(tmp_path / "pipe" / "model"), [test.feeds[0]],
                                           [test.outputs["logits"]], exe, program=test.main)
    with paddle.static.scope_guard(ref_scope):
        paddle.static.save_inference_model(str(tmp_path / "one" / "model"), [ref_test.feeds[0]],
                                           [ref_test.outputs["logits"]], ref_exe, program=ref_test.main)
    assert files(tmp_path / "pipe")["model.pdiparams"] == files(tmp_path / "one")["model.pdiparams"]
    plain = paddle.static.Executor(paddle.CPUPlace())
    with paddle.static.scope_guard(paddle.static.Scope()):
        program, feeds, fetches = paddle.static.load_inference_model(str(tmp_path / "pipe" / "model"), plain)
        got, = plain.run(program, feed={feeds[0]: batch["features"]}, fetch_list=fetches)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(expected).max() > 0


def test_a_save_program_naming_state_no_stage_holds_is_refused_naming_it(tmp_path):
    net, _, exe = pipeline(steps=0)
    stranger = paddle.static.Program()
    with paddle.static.program_guard(stranger):
        paddle.static.create_parameter([2], "float32", name="not_in_the_pipeline")
    with paddle.static.scope_guard(paddle.static.Scope()), pytest.raises(ValueError, match="not_in_the_pipeline"):
        dio.save_persistables(exe, str(tmp_path / "x"), stranger)


# a launched script's first lines after it builds ``net``: two steps, and the state they trained in trained.npz
TRAINED = """
exe = staticpipe.Executor()
exe.run(net.startup)
for step in range(2):
    exe.run(net.main, feed=net.random_batch(BATCH, seed=step), fetch_list=[net.loss])
gathered = exe.gathered_state_dict(net.main)
if gathered is not None:
    np.savez(os.path.join(out, "trained.npz"), **gathered)
"""

SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import paddle.distributed.io as dio
import staticpipe
from staticpipe._paddle import paddle
from test_paddle_io import BATCH, build, paddle_pipeline_opt
rank, out, dp = int(os.environ["PADDLE_TRAINER_ID"]), {out!r}, int(os.environ["DP"])
net, _ = build(dp=dp)
""" + TRAINED + """dio.save_persistables(exe, os.path.join(out, "vars"), net.main)
dio.save_persistables(exe, os.path.join(out, "comb"), net.main, filename="all")
if exe.flush():  # rank 0: the whole model
    paddle.static.save(net.main, os.path.join(out, "static", "model"))
plan = staticpipe.plan_of(net.main)
net.main._pipeline_opt = paddle_pipeline_opt(net.main, rank % len(plan.ranks))  # this rank's section program
from paddle.distributed.fleet.meta_optimizers.sharding import utils as sharding_utils
sharding_utils.save_persistables(exe, os.path.join(out, "section"), net.main)
exe.run(net.main, feed=net.random_batch(BATCH, seed=2), fetch_list=[net.loss])  # every rank past the writes
after = exe.gathered_state_dict(net.main)
section = net.main._pipeline_opt["section_program"]
loads = {{"vars": lambda path: dio.load_persistables(exe, path, net.main),
         "comb": lambda path: dio.load_persistables(exe, path, net.main, filename="all"),
         "section": lambda path: dio.load_persistables(exe, path, section),
         "static": lambda path: staticpipe.load(net.main, path, exe)}}  # paddle.static.load takes Paddle's executor only
for source, load in loads.items():
    exe.run(net.startup)  # the initial state again, then the saved one
    load(os.path.join(out, source))
    exe.run(net.main, feed=net.random_batch(BATCH, seed=2), fetch_list=[net.loss])
    again = exe.gathered_state_dict(net.main)
    if again is not None:
        assert sorted(again) == sorted(after)
        for n in after:
            np.testing.assert_array_equal(again[n], after[n], err_msg=n)
        open(os.path.join(out, f"trained_equal_{{source}}"), "w").close()
exe.close()
"""


@pytest.mark.parametrize("nprocs, dp", [(2, 1), (4, 2)], ids=["pp2", "dp2xpp2"])
def test_launched_ranks_save_the_whole_model_once_and_load_it_back(tmp_path, monkeypatch, nprocs, dp):
    monkeypatch.setenv("DP", str(dp))
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launch_script(tmp_path, SCRIPT, nprocs)
    trained = dict(np.load(tmp_path / "trained.npz"))
    ref, _, ref_exe, ref_scope = one_device(trained)
    with paddle.static.scope_guard(ref_scope):
        dio.save_persistables(ref_exe, str(tmp_path / "one_vars"), ref.main)
        dio.save_persistables(ref_exe, str(tmp_path / "one_comb"), ref.main, filename="all")
    assert files(tmp_path / "vars") == files(tmp_path / "one_vars") and len(files(tmp_path / "vars")) == 31
    assert files(tmp_path / "comb") == files(tmp_path / "one_comb")
    assert files(tmp_path / "section") == files(tmp_path / "one_vars")  # every rank its section's, whole
    assert_same(paddle.static.load_program_state(str(tmp_path / "static" / "model")), trained, "paddle.static.save")
    assert all((tmp_path / f"trained_equal_{source}").exists() for source in ("vars", "comb", "section", "static"))
