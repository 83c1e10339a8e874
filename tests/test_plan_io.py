"""Saved plans (staticpipe.save_plan / load_plan): a loaded plan trains exactly like the original program,
in this process, in a process without the model code, and as one process per stage that holds only its
own stage's files; on both program IRs (``program_ir``), and a plan of one IR is refused by a process that
builds the other's programs."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping
from functools import partial

import pytest

import staticpipe
from models import build_gpt, build_mlp
from pipeline_util import assert_same_training, minimize, train_twins
from staticpipe._paddle import PADDLE_MAJOR, np, paddle
from staticpipe.ir import ALLREDUCE_SUM, is_pir_program
from staticpipe.pickled_arrays import digest
from staticpipe.pir_ir import FEEDS, HANDED_OVER, VALUES, VIEW
from staticpipe.plan import OPTIMIZE, SUM, WEIGHT, plan_of
from staticpipe.saved_plan.manifest import field_digests
from staticpipe.schedule import Kind

pytestmark = pytest.mark.timeout(300)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "mlp-1F1B-lr-scheduler": dict(model="mlp", stages=2, schedule="1F1B", scheduler=True, micro_batch_size=2),
    "mlp-3-stages-ZB-H1": dict(model="mlp", stages=3, schedule="ZB-H1"),
    "mlp-interleaved-4-stages-on-2-devices": dict(model="mlp", stages=4, schedule="interleaved",
                                                  devices=["gpu:0", "gpu:1", "gpu:0", "gpu:1"]),
    "gpt-tied-embedding-global-norm-clip": dict(model="gpt", stages=2, schedule="1F1B", clip=True),
    "mlp-DualPipeV-paired-actions": dict(model="mlp", stages=4, schedule="DualPipeV",
                                         devices=["gpu:0", "gpu:1", "gpu:1", "gpu:0"]),
}


def network(model: str = "mlp", stages: int = 2, devices: list[str] | None = None, **_):
    """The builder of a case's network (``guarded=False``: its single-device twin)."""
    return partial(build_gpt, num_stages=stages) if model == "gpt" else partial(build_mlp, num_stages=stages,
                                                                                 hidden=32, stage_devices=devices)


def optimizer(scheduler: bool = False, clip: bool = False, **_):
    lr = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5) if scheduler else 0.1
    grad_clip = paddle.nn.ClipGradByGlobalNorm(0.5) if clip else None
    return paddle.optimizer.Momentum(lr, momentum=0.9, grad_clip=grad_clip)


def build(model: str = "mlp", stages: int = 2, schedule: str = "1F1B", scheduler: bool = False,
          clip: bool = False, devices: list[str] | None = None, micro_batch_size: int | None = None):
    net = network(model, stages, devices)()
    minimize(net, optimizer(scheduler, clip), dict(num_microbatches=4, schedule=schedule,
                                                   micro_batch_size=micro_batch_size))
    return net


def saved(net, tmp_path, name: str = "plan") -> str:
    directory = str(tmp_path / name)
    staticpipe.save_plan(net.main, directory, net.startup)
    return directory


def batches(net, steps: int = 3) -> list[dict]:
    return [net.random_batch(8, seed=step) for step in range(steps)]


def train(main, startup, feeds: list[dict]) -> tuple[list, dict]:
    """Losses and final state of training ``main`` from ``startup`` on ``feeds``, one step each, advancing
    the learning-rate scheduler after every step."""
    exe = staticpipe.Executor()
    exe.run(startup)
    losses = []
    for batch in feeds:
        losses.append(exe.run(main, feed=batch, fetch_list=[plan_of(main).loss])[0])
        if hasattr(main, "lr_scheduler"):
            main.lr_scheduler.step()
    state = exe.state_dict(main)
    exe.close()
    return losses, state


def assert_same_run(got: tuple[list, dict], want: tuple[list, dict]) -> None:
    """Bit for bit: every loss, parameter and optimizer state."""
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
    assert sorted(got[1]) == sorted(want[1])
    for name, value in want[1].items():
        np.testing.assert_array_equal(got[1][name], value, err_msg=name)


def canonical(program) -> bytes | tuple:
    """``program`` serialized as Paddle parses it back: parsing moves an op's extra (runtime) attributes,
    such as ``use_mkldnn`` at its default, out of the serialized form, so only parsed programs compare.
    A PIR program: ``pir_form``."""
    if is_pir_program(program):
        return pir_form(program)
    return paddle.static.deserialize_program(program.desc.serialize_to_string()).desc.serialize_to_string()


def pir_form(program) -> tuple:
    """A PIR program printed (ops, attributes, values in order) as Paddle reads it back from its own format,
    which writes a parameter's flags in full (an absent ``need_clip`` as false, ...) and no ``op_device``;
    the devices; and the names staticpipe gives its values, each by its position (op index, result index), as
    PIR values have no names of their own: a section's (what the runtime feeds, keeps and hands over), the
    main program's view's (and each viewed op's forward op), the learning rate's."""
    ops = list(program.global_block().ops)
    index = {op: i for i, op in enumerate(ops)}

    def at(value) -> tuple[int, int]:
        return index[value.get_defining_op()], value.index()

    twin, parsed = program.clone(), paddle.pir.Program()
    for op in twin.global_block().ops:
        if op.has_attr("op_device"):
            op.erase_attr("op_device")  # Paddle's writer refuses it on parameters
    with tempfile.TemporaryDirectory() as tmp:
        paddle.base.core.serialize_pir_program(twin, os.path.join(tmp, "program.json"), True, False, True)
        paddle.base.core.deserialize_pir_program(os.path.join(tmp, "program.json"), parsed, -1)
    view = getattr(program, VIEW, None)
    return (str(parsed), [op.str_attr("op_device") if op.has_attr("op_device") else None for op in ops],
            {name: at(v) for name, v in getattr(program, VALUES, {}).items()},
            getattr(program, FEEDS, None), getattr(program, HANDED_OVER, None),
            None if view is None else ({name: at(v.value) for name, v in view.vars.items()},
                                       [None if op.forward is None else index[op.forward] for op in view.ops]),
            getattr(program, "lr_name", None))


def comparable(value):
    """A plan as nested plain data, each program (sections and their runs) in its canonical serialized
    form: plans, stages, sections and programs are entities that compare by identity."""
    if isinstance(value, paddle.static.Program) or is_pir_program(value):
        return canonical(value)
    if dataclasses.is_dataclass(value):
        return {f.name: comparable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    return value


@pytest.mark.parametrize("case", CASES)
def test_a_loaded_plan_trains_exactly_like_the_original(tmp_path, case, program_ir):
    net = build(**CASES[case])
    main, startup = staticpipe.load_plan(saved(net, tmp_path))
    plan = plan_of(main)
    if CASES[case]["schedule"] == "ZB-H1":  # the case covers what it is named for
        assert all(WEIGHT in st.sections for st in plan.stages)
    if CASES[case]["schedule"] == "DualPipeV":
        assert all(any(a.kind is Kind.FB for a in acts) for acts in plan.actions.values())
    if CASES[case].get("clip"):
        assert plan.shared and [ex.kind for ex in plan.exchanges].count(SUM) == 1
        if program_ir == "legacy":  # its optimize sections show the exchange as Paddle's all-reduce op
            optimize_ops = [[op.type for op in st.sections[OPTIMIZE].program.global_block().ops]
                            for st in plan.stages]
            assert all(ALLREDUCE_SUM[0] in ops for ops in optimize_ops)
    assert is_pir_program(main) == is_pir_program(plan.stages[0].sections[OPTIMIZE].program) == (program_ir == "pir")
    feeds = batches(net)
    assert_same_run(train(main, startup, feeds), train(net.main, net.startup, feeds))


@pytest.mark.parametrize("case", ["mlp-1F1B-lr-scheduler", "gpt-tied-embedding-global-norm-clip"])
def test_a_loaded_plan_trains_like_one_device(tmp_path, case, program_ir):
    """The loaded plan against the same network trained on one device from the same initial values."""
    def reload(main, startup):
        staticpipe.save_plan(main, str(tmp_path / "plan"), startup)
        return staticpipe.load_plan(str(tmp_path / "plan"))

    c = CASES[case]
    twin = train_twins(network(**c), partial(optimizer, **c), steps=4, batch_size=8, reload=reload,
                       num_microbatches=4, schedule=c["schedule"], micro_batch_size=c.get("micro_batch_size"))
    assert is_pir_program(twin.plan.stages[0].sections["forward"].program) == (program_ir == "pir")
    assert_same_training(twin)


@pytest.mark.parametrize("case", CASES)
def test_the_round_trip_keeps_every_field_of_the_plan_and_the_programs(tmp_path, case, program_ir):
    net = build(**CASES[case])
    original = plan_of(net.main)
    main, startup = staticpipe.load_plan(saved(net, tmp_path))
    loaded = plan_of(main)
    assert str(loaded) == str(original)
    assert comparable(loaded) == comparable(original)
    assert plan_of(startup) is loaded
    for got, want in ((main, net.main), (startup, net.startup)):
        assert canonical(got) == canonical(want)
        assert got.random_seed == want.random_seed
    if CASES[case].get("scheduler"):
        assert type(main.lr_scheduler) is type(net.main.lr_scheduler)
        assert main.lr_scheduler.state_dict() == net.main.lr_scheduler.state_dict()
        assert main.lr_scheduler._var_name == net.main.lr_scheduler._var_name
    else:
        assert not hasattr(main, "lr_scheduler")


def test_the_loaded_main_program_is_the_single_device_reference(tmp_path, program_ir):
    net = build(**CASES["mlp-1F1B-lr-scheduler"])
    main, startup = staticpipe.load_plan(saved(net, tmp_path))
    report = staticpipe.verify(main, batches(net), startup, steps=3)
    assert report.ok, str(report)


def test_checkpoints_move_between_the_original_and_the_loaded_program(tmp_path, program_ir):
    net = build(**CASES["mlp-1F1B-lr-scheduler"])
    main, startup = staticpipe.load_plan(saved(net, tmp_path))
    feeds = batches(net)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for batch in feeds[:2]:
        exe.run(net.main, feed=batch)
        net.main.lr_scheduler.step()
    staticpipe.save(net.main, str(tmp_path / "ck"), exe)
    loaded_exe = staticpipe.Executor()
    loaded_exe.run(startup)
    assert staticpipe.load(main, str(tmp_path / "ck"), loaded_exe)["step"] == 2
    assert main.lr_scheduler.state_dict() == net.main.lr_scheduler.state_dict()
    loss = plan_of(main).loss
    np.testing.assert_array_equal(exe.run(net.main, feed=feeds[2], fetch_list=[loss])[0],
                                  loaded_exe.run(main, feed=feeds[2], fetch_list=[loss])[0])
    staticpipe.save(main, str(tmp_path / "ck-loaded"), loaded_exe)
    staticpipe.load(net.main, str(tmp_path / "ck-loaded"), exe)
    assert_same_run(([], exe.state_dict(net.main)), ([], loaded_exe.state_dict(main)))
    exe.close()
    loaded_exe.close()


WITHOUT_MODEL_CODE = textwrap.dedent("""
    import sys
    import numpy as np
    import staticpipe
    from staticpipe.ir import fetch_target, is_pir_program
    directory, data, out, ir = sys.argv[1:]
    main, startup = staticpipe.load_plan(directory)
    assert is_pir_program(main) == (ir == "pir")
    plan = staticpipe.plan_of(main)
    saved = np.load(data)
    steps = sorted({key.split("/")[0] for key in saved})
    # the data variables: a PIR program's values have no names of their own, the plan's view names them
    feed_list = [fetch_target(main, name) if is_pir_program(main) else main.global_block().var(name)
                 for name in plan.data_specs]
    loader = staticpipe.io.DataLoader.from_generator(feed_list=feed_list, capacity=2, iterable=False)
    global_batches = ({n: saved[f"{s}/{n}"] for n in plan.data_specs} for s in steps)
    # a loader batch is one micro-batch: each saved global batch goes in as its micro-batches
    loader.set_batch_generator(lambda: (mb for batch in global_batches
                                        for mb in staticpipe.io.split_microbatches(batch, plan.num_microbatches)))
    exe = staticpipe.Executor()
    exe.run(startup)
    loader.start()
    history = exe.train_from_dataset(main, loader, fetch_list=[plan.loss], lr_step="step")
    loader.reset()
    assert not [m for m in sys.modules if m.split(".")[0] in ("models", "pipeline_util")]
    np.savez(out, losses=np.array([h[0] for h in history]), **exe.state_dict(main))
""")


def script_env(program_ir: str) -> dict[str, str]:
    """The environment of a script a test starts: staticpipe from this checkout; for PIR, without the suite's
    legacy-IR opt-in (conftest.py), so that the process builds PIR programs as on Paddle 3 by default."""
    env = dict(os.environ, PYTHONPATH=REPO)
    if program_ir == "pir":
        for flag in ("STATICPIPE_LEGACY_IR", "FLAGS_enable_pir_api"):
            env.pop(flag, None)
    return env


def save_batches(feeds: list[dict], path) -> str:
    np.savez(path, **{f"{step}/{name}": value for step, batch in enumerate(feeds) for name, value in batch.items()})
    return str(path)


def test_a_process_without_the_model_code_trains_the_saved_plan(tmp_path, program_ir):
    net = build(**CASES["mlp-1F1B-lr-scheduler"])
    directory, feeds = saved(net, tmp_path), batches(net)
    script = tmp_path / "train_saved.py"
    script.write_text(WITHOUT_MODEL_CODE)
    out = tmp_path / "result.npz"
    env = script_env(program_ir)  # staticpipe only: the script imports nothing of models/ or tests/
    proc = subprocess.run([sys.executable, str(script), directory, save_batches(feeds, tmp_path / "data.npz"),
                           str(out), program_ir], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = dict(np.load(out))
    losses = result.pop("losses")
    assert_same_run((list(losses), result), train(net.main, net.startup, feeds))


def test_a_rank_loads_only_its_own_stages(tmp_path, monkeypatch, program_ir):
    net = build(**CASES["mlp-1F1B-lr-scheduler"])
    directory = saved(net, tmp_path)
    shutil.rmtree(os.path.join(directory, "stage-1"))
    missing = os.path.join(directory, "stage-1", "forward.json" if program_ir == "pir" else "forward.pdmodel")
    with pytest.raises(FileNotFoundError) as err:
        staticpipe.load_plan(directory)
    assert str(err.value) == f"{missing!r} does not exist: it holds the stage 1 forward section"
    main, startup = staticpipe.load_plan(directory, stages=[0])
    plan = plan_of(main)
    assert [st.loaded for st in plan.stages] == [True, False]
    original = str(plan_of(net.main))
    stage_1 = original.split("\n")[4]
    assert stage_1.startswith("  stage 1 on gpu:1: forward ")
    assert str(plan) == original.replace(stage_1, "  stage 1 on gpu:1: sections not loaded in this process")
    exe = staticpipe.Executor()
    with pytest.raises(ValueError) as err:
        exe.run(startup)
    assert str(err.value) == ("this process runs stages [0, 1], but the section programs of stages [1] were not "
                              "loaded (staticpipe.load_plan(..., stages=...))")
    with pytest.raises(ValueError) as err:
        staticpipe.save_plan(main, str(tmp_path / "again"), startup)
    assert str(err.value) == ("save_plan needs every stage's section programs, but stages [1] were not loaded in "
                              "this process")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")  # rank 0 of a launched job: its own stage by default
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    main, _ = staticpipe.load_plan(directory)
    assert [st.loaded for st in plan_of(main).stages] == [True, False]


PER_RANK = textwrap.dedent("""
    import os, sys
    import numpy as np
    import staticpipe
    from staticpipe.ir import is_pir_program
    rank = os.environ["PADDLE_TRAINER_ID"]
    directory, data, out, ir = sys.argv[1:]
    main, startup = staticpipe.load_plan(os.path.join(directory, f"rank-{rank}"))
    assert is_pir_program(main) == (ir == "pir")
    plan = staticpipe.plan_of(main)
    saved = np.load(data)
    exe = staticpipe.Executor()
    exe.run(startup)
    losses = []
    for step in sorted({key.split("/")[0] for key in saved}):
        losses.append(exe.run(main, feed={n: saved[f"{step}/{n}"] for n in plan.data_specs},
                              fetch_list=[plan.loss])[0])
        main.lr_scheduler.step()
    extra = {} if losses[0] is None else {"losses": np.array(losses)}
    np.savez(os.path.join(out, f"state_{rank}.npz"), **extra, **exe.state_dict(main))
""")


def test_each_process_loads_only_its_stage_and_matches_the_threaded_run(tmp_path, program_ir):
    net = build(model="mlp", stages=2, schedule="1F1B", scheduler=True, clip=True)
    directory, feeds = saved(net, tmp_path), batches(net)
    for rank, other in ((0, 1), (1, 0)):  # each rank's directory lacks the other stage's files
        shutil.copytree(directory, tmp_path / "ranks" / f"rank-{rank}")
        shutil.rmtree(tmp_path / "ranks" / f"rank-{rank}" / f"stage-{other}")
    script = tmp_path / "per_rank.py"
    script.write_text(PER_RANK)
    proc = subprocess.run([sys.executable, "-m", "staticpipe.launch", "--nprocs", "2", str(script),
                           str(tmp_path / "ranks"), save_batches(feeds, tmp_path / "data.npz"), str(tmp_path),
                           program_ir], env=script_env(program_ir), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = {}
    for rank in (0, 1):
        merged.update(np.load(tmp_path / f"state_{rank}.npz"))
    losses = merged.pop("losses")
    assert_same_run((list(losses), merged), train(net.main, net.startup, feeds))


def edited_copy(directory: str, copy: str, edit, rehash: bool = False) -> str:
    """A copy of the saved plan ``directory`` whose plan file ``edit`` changed. ``rehash``: the edit is deliberate,
    its manifest rewritten to match (every field's sha256, every file's size and sha256), so what load_plan
    checks beyond the manifest is reached."""
    shutil.copytree(directory, copy)
    rewrite_plan_json(copy, edit, rehash)
    return copy


def rewrite_plan_json(directory: str, edit, rehash: bool = False) -> None:
    """``edit`` the plan.json of ``directory`` in place; ``rehash``: see ``edited_copy``."""
    with open(os.path.join(directory, "plan.json")) as f:
        description = json.load(f)
    edit(description)
    if rehash:
        description["fields"] = field_digests(description)
        description["files"] = {name: digest(os.path.join(directory, name)) for name in description["files"]}
    with open(os.path.join(directory, "plan.json"), "w") as f:
        json.dump(description, f)


def test_errors_name_what_is_wrong(tmp_path, monkeypatch, program_ir):
    net = build(**CASES["mlp-1F1B-lr-scheduler"])
    directory = saved(net, tmp_path)
    plan_file = os.path.join(directory, "plan.json")

    def message(error, call, *args, **kwargs) -> str:
        with pytest.raises(error) as err:
            call(*args, **kwargs)
        return str(err.value)

    assert message(ValueError, staticpipe.save_plan, paddle.static.Program(), str(tmp_path / "x")) == (
        "save_plan needs a program rewritten by staticpipe.PipelineOptimizer.minimize; this program has no "
        "pipeline plan")
    assert message(ValueError, staticpipe.save_plan, net.main, str(tmp_path / "x"), paddle.static.Program()) == (
        "startup_program is not the startup program of this plan: pass the startup program given to minimize")
    nowhere = str(tmp_path / "nowhere")
    assert message(FileNotFoundError, staticpipe.load_plan, nowhere) == (
        f"no saved plan at {nowhere!r}: the directory does not exist")
    os.makedirs(tmp_path / "empty")
    empty_plan = os.path.join(str(tmp_path / "empty"), "plan.json")
    assert message(FileNotFoundError, staticpipe.load_plan, str(tmp_path / "empty")) == (
        f"{empty_plan!r} does not exist: it holds the plan written by staticpipe.save_plan")
    assert message(ValueError, staticpipe.load_plan, directory, stages=[0, 5]) == (
        f"load_plan: stages=[0, 5] names [5], but {plan_file!r} has stages 0..1")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "3")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    assert message(ValueError, staticpipe.load_plan, directory) == (
        f"{plan_file!r} does not fit this job: the job has 3 processes but the plan has 2 devices "
        "['gpu:0', 'gpu:1']; launch 2 processes (one per device)")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    assert message(ValueError, staticpipe.load_plan, directory, stages=[0]) == (
        "load_plan: rank 1 runs stages [1], but stages=[0] leaves out [1]")
    monkeypatch.delenv("PADDLE_TRAINERS_NUM")
    monkeypatch.delenv("PADDLE_TRAINER_ID")

    def unsent(description: dict) -> None:
        actions = description["plan"]["actions"]
        actions[0] = actions[0].replace(" 0SEND_F0>1", "")

    copy = edited_copy(directory, str(tmp_path / "unsent"), unsent, rehash=True)  # a deliberate edit
    assert message(ValueError, staticpipe.load_plan, copy) == (
        f"{os.path.join(copy, 'plan.json')!r}: the sends and receives of the action lists do not match the plan's "
        "routes")
    copy = edited_copy(directory, str(tmp_path / "lossless"), lambda d: d["plan"].pop("loss"), rehash=True)
    assert message(ValueError, staticpipe.load_plan, copy) == (
        f"{os.path.join(copy, 'plan.json')!r} lacks the plan field 'loss'")
    copy = edited_copy(directory, str(tmp_path / "future"), lambda d: d.update(format=99))
    reads = "'pir-3'" if program_ir == "pir" else "3"  # the format of this process's IR
    assert message(ValueError, staticpipe.load_plan, copy) == (
        f"{os.path.join(copy, 'plan.json')!r} has plan format 99; this staticpipe reads format {reads}")
    scheduler_file = os.path.join(directory, "lr_scheduler.pkl")
    os.remove(scheduler_file)  # plan.json lists it
    assert message(FileNotFoundError, staticpipe.load_plan, directory) == (
        f"{scheduler_file!r} does not exist: it holds the learning-rate scheduler")

    lambda_net = build_mlp(num_stages=2, hidden=32)
    minimize(lambda_net, paddle.optimizer.SGD(paddle.optimizer.lr.LambdaDecay(0.1, lambda epoch: 0.9 ** epoch)),
             dict(num_microbatches=2))
    with pytest.raises(Exception) as cause:
        pickle.dumps(lambda_net.main.lr_scheduler, protocol=4)
    assert message(ValueError, staticpipe.save_plan, lambda_net.main, str(tmp_path / "x"), lambda_net.startup) == (
        f"save_plan cannot pickle the learning-rate scheduler LambdaDecay: {cause.value}; use a scheduler without "
        "lambdas or local functions")
    assert not os.path.exists(tmp_path / "x")


def test_the_example_saves_then_trains_from_the_directory(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "run_saved_plan.py"), "--dir",
                           str(tmp_path / "plan"), "--width", "32", "--batch", "32", "--steps", "3"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"trained 3 steps from {tmp_path / 'plan'}: loss " in proc.stdout


class Evil:
    def __reduce__(self):
        return (open, ("/tmp/staticpipe-plan-payload-ran", "w"))


def test_loading_a_saved_plan_runs_no_code(tmp_path, program_ir):
    net = build(**CASES["mlp-1F1B-lr-scheduler"])
    directory = saved(net, tmp_path)
    payload = "/tmp/staticpipe-plan-payload-ran"
    if os.path.exists(payload):
        os.remove(payload)
    with open(os.path.join(directory, "lr_scheduler.pkl"), "wb") as f:
        pickle.dump(Evil(), f, protocol=4)
    path = os.path.join(directory, "lr_scheduler.pkl")
    with pytest.raises(ValueError, match=re.escape(f"{path!r} is corrupt: it has ")):  # not the file saved
        staticpipe.load_plan(directory)
    rewrite_plan_json(directory, lambda d: None, rehash=True)  # as if saved so: the unpickler still refuses it
    with pytest.raises(ValueError, match=re.escape(
            f"{path!r} refers to the Python global io.open, which is not one of Paddle's learning-rate schedulers "
            "(paddle.optimizer.lr): saved plans hold only those, so that loading one never runs code")):
        staticpipe.load_plan(directory)
    assert not os.path.exists(payload)


class MyDecay(paddle.optimizer.lr.StepDecay):
    """A user's own scheduler class: a saved plan could only load it by running its module's code."""


def test_save_plan_refuses_a_scheduler_load_plan_would_refuse(tmp_path, program_ir):
    net = build_mlp(num_stages=2, hidden=32)
    minimize(net, paddle.optimizer.SGD(MyDecay(0.1, step_size=1)), dict(num_microbatches=2))
    with pytest.raises(ValueError, match=re.escape(
            "the learning-rate scheduler MyDecay refers to the Python global test_plan_io.MyDecay, which is not one "
            "of Paddle's learning-rate schedulers")):
        staticpipe.save_plan(net.main, str(tmp_path / "plan"), net.startup)
    assert not os.path.exists(tmp_path / "plan")


@pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")
def test_a_plan_of_one_ir_is_refused_by_a_process_of_the_other(tmp_path):
    """This process builds legacy programs (the suite's opt-in, conftest.py), and PIR ones inside IrGuard."""
    legacy = saved(build(**CASES["mlp-1F1B-lr-scheduler"]), tmp_path, "legacy")
    with paddle.pir_utils.IrGuard():
        pir = saved(build(**CASES["mlp-1F1B-lr-scheduler"]), tmp_path, "pir")
    with pytest.raises(ValueError) as err:
        staticpipe.load_plan(pir)
    assert str(err.value) == (
        f"{os.path.join(pir, 'plan.json')!r} holds a plan of PIR programs (format 'pir-3', Paddle 3's default IR), "
        "but this process builds legacy-IR programs (legacy-IR mode; load it in PIR mode: Paddle 3's default, "
        "without STATICPIPE_LEGACY_IR=1 or staticpipe.use_legacy_ir(), or inside paddle.pir_utils.IrGuard())")
    with paddle.pir_utils.IrGuard(), pytest.raises(ValueError) as err:
        staticpipe.load_plan(legacy)
    assert str(err.value) == (
        f"{os.path.join(legacy, 'plan.json')!r} holds a plan of legacy-IR programs (format 3), but this process "
        "builds PIR programs (Paddle 3's default IR); load it in legacy-IR mode (STATICPIPE_LEGACY_IR=1 or "
        "staticpipe.use_legacy_ir(), see README)")
    with paddle.pir_utils.IrGuard():
        main, _ = staticpipe.load_plan(pir)
        assert is_pir_program(main)
    assert not is_pir_program(staticpipe.load_plan(legacy)[0])


@pytest.mark.skipif(PADDLE_MAJOR >= 3, reason="Paddle 2.x has no PIR")
def test_paddle_2_refuses_a_plan_of_pir_programs(tmp_path):
    """Paddle 2.6 cannot save a PIR plan: the plan file of a legacy one says it holds PIR programs."""
    directory = saved(build(**CASES["mlp-1F1B-lr-scheduler"]), tmp_path)
    copy = edited_copy(directory, str(tmp_path / "pir"), lambda d: d.update(format="pir-3"))
    with pytest.raises(ValueError) as err:
        staticpipe.load_plan(copy)
    assert str(err.value) == (
        f"{os.path.join(copy, 'plan.json')!r} holds a plan of PIR programs (format 'pir-3', Paddle 3's default IR), "
        f"but this process builds legacy-IR programs (Paddle {paddle.__version__} has no PIR; load it with Paddle 3)")


@pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")
def test_a_pir_program_read_back_with_other_ops_is_refused(tmp_path):
    """The plan's names point at values by position: a program Paddle reads back otherwise is not trained."""
    with paddle.pir_utils.IrGuard():
        directory = saved(build(**CASES["mlp-1F1B-lr-scheduler"]), tmp_path)
        copy = edited_copy(directory, str(tmp_path / "other"), lambda d: d["pir"]["main"]["ops"].__setitem__(1, "0"),
                           rehash=True)
        with pytest.raises(ValueError) as err:
            staticpipe.load_plan(copy)
    assert str(err.value) == (
        f"{os.path.join(copy, 'main.json')!r} holds other ops than plan.json records for it (Paddle "
        f"{paddle.__version__} reads it back otherwise than it was saved, or the file was replaced with its digest), "
        "so the plan's names would point at other values; save the plan again with this Paddle")
