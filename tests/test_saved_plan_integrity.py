"""A saved plan is checked like a checkpoint before anything is built (``staticpipe/saved_plan/manifest.py``):
plan.json records every other file's size and sha256 and each of its own fields' sha256. Every tamper case
of issue 40 is refused naming the file (and plan.json's field), on both program IRs: a truncated plan.json, a
hand-edited field (``num_microbatches`` 4 -> 8), a stage program edited (relu -> sigmoid) or corrupted, stage
folders swapped, a file the manifest does not list, a plan of the format before the manifest. An edit that
also rewrites the digests reaches the checks of the fields against each other and against the programs."""
from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import ExitStack
from unittest import mock

import pytest

import staticpipe
from staticpipe._paddle import paddle
from staticpipe.pickled_arrays import digest
from staticpipe.plan import plan_of
from test_plan_io import CASES, assert_same_run, batches, build, edited_copy, rewrite_plan_json, saved, train

pytestmark = pytest.mark.timeout(300)
EDITED = "the file was edited after it was saved (a saved plan is written whole: save it again)"


@pytest.fixture
def plan_dir(tmp_path, program_ir) -> str:
    """A 2-stage MLP plan (1F1B, 4 micro-batches, a scheduler) saved on this test's IR."""
    return saved(build(**CASES["mlp-1F1B-lr-scheduler"]), tmp_path)


def refused(directory: str, error: type, message: str, built: bool = False) -> None:
    """``load_plan(directory)`` raises ``error`` with exactly ``message``; unless ``built``, before it reads any
    program (of either IR)."""
    def read(*args, **kwargs):
        raise AssertionError("a program was read before the refusal")

    with ExitStack() as stack:
        if not built:
            stack.enter_context(mock.patch.object(paddle.static, "deserialize_program", read))
            if hasattr(paddle.base.core, "deserialize_pir_program"):
                stack.enter_context(mock.patch.object(paddle.base.core, "deserialize_pir_program", read))
        stack.enter_context(pytest.raises(error, match=f"^{re.escape(message)}$"))
        staticpipe.load_plan(directory)


def ext(program_ir: str) -> str:
    return ".json" if program_ir == "pir" else ".pdmodel"


def recorded(directory: str, name: str) -> dict:
    with open(os.path.join(directory, "plan.json")) as f:
        return json.load(f)["files"][name]


def corrupt_message(directory: str, name: str, record: dict) -> str:
    path = os.path.join(directory, name)
    found = digest(path)
    return (f"{path!r} is corrupt: it has {found['bytes']} bytes with sha256 {found['sha256']}, but plan.json "
            f"recorded {record['bytes']} bytes with sha256 {record['sha256']}")


def swap_stage_folders(directory: str) -> None:
    os.rename(os.path.join(directory, "stage-0"), os.path.join(directory, "stage-x"))
    os.rename(os.path.join(directory, "stage-1"), os.path.join(directory, "stage-0"))
    os.rename(os.path.join(directory, "stage-x"), os.path.join(directory, "stage-1"))


def test_a_truncated_or_foreign_plan_json_is_named(plan_dir):
    plan_file = os.path.join(plan_dir, "plan.json")
    text = open(plan_file).read()
    truncated = text[:text.index('"loss"') + 3]  # in the middle of a string, as the issue's
    with open(plan_file, "w") as f:
        f.write(truncated)
    with pytest.raises(json.JSONDecodeError, match="^Unterminated string starting at") as parse:
        json.loads(truncated)  # what Python's parser says of it
    refused(plan_dir, ValueError, f"{plan_file!r} is corrupt: JSONDecodeError: {parse.value}")
    with open(plan_file, "w") as f:
        json.dump(["a", "list"], f)
    refused(plan_dir, ValueError, f"{plan_file!r} is corrupt: it holds a JSON list, not an object")


def test_a_hand_edited_field_is_named(plan_dir, tmp_path, program_ir):
    """num_microbatches 4 -> 8 loaded and trained another computation: now it, and any other field edited,
    added or removed, is refused naming the field."""
    seeds = json.load(open(os.path.join(plan_dir, "plan.json")))["random_seeds"]
    for name, edit, field, shown in [  # the value is shown where it is short
            ("m8", lambda d: d["plan"].update(num_microbatches=8), "plan.num_microbatches", " (8)"),
            ("mbs", lambda d: d["plan"].update(micro_batch_size=4), "plan.micro_batch_size", " (4)"),
            ("seeds", lambda d: d["random_seeds"].update(main=7), "random_seeds",
             f" ({json.dumps({**seeds, 'main': 7})})"),
            ("stages", lambda d: d["plan"]["stages"][1].update(device="gpu:0"), "plan.stages", "")]:
        copy = edited_copy(plan_dir, str(tmp_path / name), edit)
        refused(copy, ValueError, f"{os.path.join(copy, 'plan.json')!r}: its field {field!r}{shown} is not what "
                                  f"save_plan wrote: {EDITED}")
    copy = edited_copy(plan_dir, str(tmp_path / "lossless"), lambda d: d["plan"].pop("loss"))
    refused(copy, ValueError, f"{os.path.join(copy, 'plan.json')!r} lacks the field 'plan.loss', which save_plan "
                              f"wrote: {EDITED}")
    copy = edited_copy(plan_dir, str(tmp_path / "added"), lambda d: d.update(comment="mine"))
    refused(copy, ValueError, f"{os.path.join(copy, 'plan.json')!r} has the field 'comment', which save_plan did "
                              f"not write: {EDITED}")
    if program_ir == "pir":  # what Paddle's PIR format leaves out is a field of its own
        copy = edited_copy(plan_dir, str(tmp_path / "pir"), lambda d: d["pir"]["main"]["devices"].pop())
        refused(copy, ValueError, f"{os.path.join(copy, 'plan.json')!r}: its field 'pir.main' is not what save_plan "
                                  f"wrote: {EDITED}")


def test_a_damaged_or_edited_file_is_named(plan_dir, tmp_path, program_ir):
    """A stage program corrupted (legacy: Paddle's "Failed to parse program_desc from binary string", PIR: a
    parse error deep in Paddle's JSON) or edited (relu -> sigmoid, which trained), a truncated main program, a
    missing scheduler: each named, nothing read."""
    stage_1 = f"stage-1/forward{ext(program_ir)}"
    copy = str(tmp_path / "flipped")
    shutil.copytree(plan_dir, copy)
    with open(os.path.join(copy, stage_1), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x40]))
    refused(copy, ValueError, corrupt_message(copy, stage_1, recorded(copy, stage_1)))

    copy = str(tmp_path / "sigmoid")
    shutil.copytree(plan_dir, copy)
    stage_0 = f"stage-0/forward{ext(program_ir)}"
    path = os.path.join(copy, stage_0)
    text = open(path, "rb").read()
    if program_ir == "pir":  # the op's name in Paddle's PIR JSON: "<dialect>.relu"
        edited, count = re.subn(rb'("#":"\d+\.)relu"', rb'\1sigmoid"', text, count=1)
        assert count == 1
    else:  # as Paddle edits a program: an op's type changed, the program serialized again
        program = paddle.static.deserialize_program(text)
        next(op for op in program.global_block().ops if op.type == "relu").desc.set_type("sigmoid")
        edited = program.desc.serialize_to_string()
    with open(path, "wb") as f:
        f.write(edited)
    refused(copy, ValueError, corrupt_message(copy, stage_0, recorded(copy, stage_0)))

    main = "main" + ext(program_ir)
    copy = str(tmp_path / "truncated")
    shutil.copytree(plan_dir, copy)
    with open(os.path.join(copy, main), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(copy, main)) // 2)
    refused(copy, ValueError, corrupt_message(copy, main, recorded(copy, main)))

    copy = str(tmp_path / "no-scheduler")
    shutil.copytree(plan_dir, copy)
    os.remove(os.path.join(copy, "lr_scheduler.pkl"))
    refused(copy, FileNotFoundError, f"{os.path.join(copy, 'lr_scheduler.pkl')!r} does not exist: it holds the "
                                     "learning-rate scheduler")


def test_a_rank_needs_only_its_own_stages_files_whole(plan_dir, program_ir):
    name = f"stage-1/forward{ext(program_ir)}"
    with open(os.path.join(plan_dir, name), "ab") as f:
        f.write(b"appended")
    main, _ = staticpipe.load_plan(plan_dir, stages=[0])
    assert [st.loaded for st in plan_of(main).stages] == [True, False]
    refused(plan_dir, ValueError, corrupt_message(plan_dir, name, recorded(plan_dir, name)))


def test_swapped_stage_folders_are_named(plan_dir, tmp_path, program_ir):
    """They failed with "communication ops [3]" (legacy) naming no file."""
    swap_stage_folders(plan_dir)
    forward = f"forward{ext(program_ir)}"  # the first file read
    refused(plan_dir, ValueError, f"{os.path.join(plan_dir, 'stage-0', forward)!r} is not the file plan.json "
                                  f"records as stage-0/{forward}: it has the size and sha256 plan.json records for "
                                  f"stage-1/{forward} (files moved or swapped)")


def test_swapped_stages_with_their_digests_rewritten_are_refused_by_their_programs(plan_dir, program_ir):
    """Past the manifest (a deliberate edit), the programs are checked against the plan: a legacy section's
    communication ops against its routes, a PIR program's ops against plan.json's record of them."""
    swap_stage_folders(plan_dir)
    rewrite_plan_json(plan_dir, lambda d: None, rehash=True)
    forward = os.path.join(plan_dir, "stage-0", f"forward{ext(program_ir)}")  # the first program read
    if program_ir == "pir":
        refused(plan_dir, ValueError, f"{forward!r} holds other ops than plan.json records for it (Paddle "
                                      f"{paddle.__version__} reads it back otherwise than it was saved, or the file "
                                      "was replaced with its digest), so the plan's names would point at other "
                                      "values; save the plan again with this Paddle", built=True)
        return
    # stage 0's forward sends to stage 1; stage 1's, swapped in, has another op where that send was
    found = r"\[\([^]]*\]"  # the ops of stage 1's forward where stage 0's has its send
    with pytest.raises(ValueError, match=re.escape(f"{forward!r} is not the stage 0 forward section of its plan: "
                                                   "its communication ops (type, peer stage) are ") + found +
                       re.escape(", but plan.json's routes and exchanges make them [('send_v2', 1)]") + "$"):
        staticpipe.load_plan(plan_dir)


def test_fields_that_disagree_are_refused_even_with_their_digests_rewritten(plan_dir, tmp_path):
    plan_file = lambda copy: os.path.join(copy, "plan.json")  # noqa: E731
    copy = edited_copy(plan_dir, str(tmp_path / "m8"), lambda d: d["plan"].update(num_microbatches=8), rehash=True)
    refused(copy, ValueError, f"{plan_file(copy)!r}: its action lists are no schedule of its num_microbatches (8) "
                              "through its 2 stages: stage 0 lacks F of micro-batches 4, 5, 6, 7")
    copy = edited_copy(plan_dir, str(tmp_path / "index"), lambda d: d["plan"]["stages"][1].update(index=0),
                       rehash=True)
    refused(copy, ValueError, f"{plan_file(copy)!r}: its stages[1] (index 0 on gpu:1, rank 1 of ['gpu:0', 'gpu:1'], "
                              "sections [(1, 'forward'), (1, 'backward'), (1, 'optimize'), (1, 'init')]) is not stage "
                              "1 of its plan")

    def no_stage_1(description: dict) -> None:
        description["files"] = {n: r for n, r in description["files"].items() if not n.startswith("stage-1/")}

    copy = edited_copy(plan_dir, str(tmp_path / "stages"), no_stage_1)
    refused(copy, ValueError, f"{plan_file(copy)!r} lists the files of stages [0], but its plan has stages 0..1")


def test_a_file_the_manifest_does_not_list_is_refused(plan_dir, tmp_path, program_ir):
    name = f"stage-1/forward{ext(program_ir)}"
    copy = edited_copy(plan_dir, str(tmp_path / "unlisted"), lambda d: d["files"].pop(name))
    refused(copy, ValueError, f"{os.path.join(copy, 'plan.json')!r} lists no size and sha256 for {name}, which holds "
                              "the stage 1 forward section")


def test_a_plan_saved_before_the_manifest_is_refused(plan_dir, tmp_path, program_ir):
    old = "pir-2" if program_ir == "pir" else 2

    def format_2(description: dict) -> None:
        description.update(format=old)
        del description["files"], description["fields"]

    copy = edited_copy(plan_dir, str(tmp_path / "old"), format_2)
    refused(copy, ValueError, f"{os.path.join(copy, 'plan.json')!r} has plan format {old!r}, written by an older "
                              "staticpipe without the sizes and sha256 of its files, which load_plan checks before it "
                              "builds anything: save the plan again with this staticpipe")
    copy = edited_copy(plan_dir, str(tmp_path / "bare"), lambda d: d.pop("fields"))
    version = "'pir-3'" if program_ir == "pir" else "3"
    refused(copy, ValueError, f"{os.path.join(copy, 'plan.json')!r} has no manifest of format {version}: 'files' "
                              "must give each file's sha256 and bytes, and 'fields' each field's sha256")


def test_save_plan_takes_a_loaded_plans_own_startup_program(plan_dir, tmp_path, program_ir):
    """save_plan(main, path) without the startup program: a loaded plan's is the one load_plan gave."""
    main, startup = staticpipe.load_plan(plan_dir)
    staticpipe.save_plan(main, str(tmp_path / "again"))
    again, again_startup = staticpipe.load_plan(str(tmp_path / "again"))
    feeds = batches(build(**CASES["mlp-1F1B-lr-scheduler"]))
    assert_same_run(train(again, again_startup, feeds), train(main, startup, feeds))


def test_save_plan_takes_a_minimized_plans_own_startup_program(tmp_path, program_ir):
    """save_plan(main, path) right after minimize, its startup program not Paddle's default: minimize's."""
    net = build(**CASES["mlp-1F1B-lr-scheduler"])
    assert net.startup is not paddle.static.default_startup_program()
    staticpipe.save_plan(net.main, str(tmp_path / "plan"))
    main, startup = staticpipe.load_plan(str(tmp_path / "plan"))
    feeds = batches(build(**CASES["mlp-1F1B-lr-scheduler"]))
    assert_same_run(train(main, startup, feeds), train(*staticpipe.load_plan(saved(net, tmp_path, "given")), feeds))
