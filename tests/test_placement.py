"""staticpipe.placement: parsing device strings and tagging ops with the normalised device."""
from __future__ import annotations

import re

import pytest

import staticpipe
from staticpipe import Device, device_guard, parse_device
from staticpipe import placement
from staticpipe._paddle import paddle

pytestmark = pytest.mark.timeout(120)

FORMS = '"cpu", "gpu", "gpu:k" (k = 0, 1, ...)'


@pytest.mark.parametrize("text, kind, index, normal", [
    ("cpu", "cpu", 0, "cpu"),
    ("cpu:0", "cpu", 0, "cpu"),
    ("gpu", "gpu", 0, "gpu:0"),
    ("gpu:0", "gpu", 0, "gpu:0"),
    ("gpu:1", "gpu", 1, "gpu:1"),
    ("gpu:12", "gpu", 12, "gpu:12"),
    ("gpu:01", "gpu", 1, "gpu:1"),
    ("GPU:3", "gpu", 3, "gpu:3"),
    ("Gpu", "gpu", 0, "gpu:0"),
    ("CPU", "cpu", 0, "cpu"),
    ("  gpu:2\t", "gpu", 2, "gpu:2"),
    ("\ncpu ", "cpu", 0, "cpu"),
])
def test_parse_device_accepts_and_normalises(text, kind, index, normal):
    dev = parse_device(text)
    assert dev == Device(kind, index)
    assert (dev.kind, dev.index) == (kind, index)
    assert str(dev) == normal


def test_device_is_frozen_and_ordered():
    assert sorted([Device("gpu", 2), Device("cpu"), Device("gpu", 0)]) == [
        Device("cpu", 0), Device("gpu", 0), Device("gpu", 2)]
    with pytest.raises(AttributeError):
        Device("gpu", 1).index = 2  # type: ignore[misc]


@pytest.mark.parametrize("text", [
    "tpu", "xpu", "gpu:x", "cpu:1", "CPU:2", "gpu:-1", "gpu:", "gpu:1:2", "gpu1", "gpu :1", "gpu: 1", "", "  ",
    "cuda:0", "gpu:1.0",
])
def test_parse_device_rejects_bad_strings(text):
    with pytest.raises(ValueError, match=re.escape(f"invalid device {text!r}: accepted forms are {FORMS}")) as err:
        parse_device(text)
    assert str(err.value) == f"invalid device {text!r}: accepted forms are {FORMS}"


@pytest.mark.parametrize("value", [3, None, 0, 1.5, b"gpu", ["gpu"], Device("gpu", 0)])
def test_parse_device_rejects_non_strings(value):
    message = f"device must be a string such as {FORMS}, got {value!r}"
    with pytest.raises(ValueError) as err:
        parse_device(value)
    assert str(err.value) == message


def _new_op_device(x) -> str:
    """Create one op now and return its op_device attribute."""
    out = paddle.scale(x, 2.0)
    return out.block.ops[-1].attr("op_device")


@pytest.fixture
def x():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        yield paddle.static.data("x", [None, 4], "float32")


@pytest.mark.parametrize("text, tag", [
    ("cpu", "cpu"), ("cpu:0", "cpu"), ("gpu", "gpu:0"), ("gpu:3", "gpu:3"), (" GPU:1 ", "gpu:1"), ("gpu:02", "gpu:2"),
])
def test_device_guard_tags_ops_with_the_normalised_device(x, text, tag):
    assert _new_op_device(x) == ""
    with device_guard(text) as dev:
        assert dev == parse_device(text)
        assert _new_op_device(x) == tag
    assert _new_op_device(x) == ""


@pytest.mark.parametrize("text", ["tpu", "gpu:x", "cpu:1", "gpu:-1", 3, None])
def test_device_guard_rejects_before_tagging_anything(x, text):
    message = (f"invalid device {text!r}: accepted forms are {FORMS}" if isinstance(text, str)
               else f"device must be a string such as {FORMS}, got {text!r}")
    with pytest.raises(ValueError, match=re.escape(message)):
        with device_guard(text):
            pytest.fail("the block must not run")  # pragma: no cover
    assert _new_op_device(x) == ""


def test_nested_guards_innermost_wins_and_outer_is_restored(x):
    seen = [("before", _new_op_device(x))]
    with device_guard("gpu:1"):
        seen.append(("outer", _new_op_device(x)))
        with device_guard("cpu"):
            seen.append(("inner", _new_op_device(x)))
            with device_guard("gpu"):
                seen.append(("innermost", _new_op_device(x)))
            seen.append(("inner again", _new_op_device(x)))
        seen.append(("outer again", _new_op_device(x)))
        with device_guard("gpu:2"):
            seen.append(("second inner", _new_op_device(x)))
        seen.append(("outer last", _new_op_device(x)))
    seen.append(("after", _new_op_device(x)))
    assert seen == [("before", ""), ("outer", "gpu:1"), ("inner", "cpu"), ("innermost", "gpu:0"),
                    ("inner again", "cpu"), ("outer again", "gpu:1"), ("second inner", "gpu:2"),
                    ("outer last", "gpu:1"), ("after", "")]
    # every op of the program carries the tag it was created under
    ops = x.block.ops
    assert [op.attr("op_device") for op in ops] == ["", "gpu:1", "cpu", "gpu:0", "cpu", "gpu:1", "gpu:2", "gpu:1", ""]


def test_outer_guard_restored_when_inner_block_raises(x):
    with device_guard("gpu:1"):
        with pytest.raises(RuntimeError, match="boom"):
            with device_guard("gpu:0"):
                assert _new_op_device(x) == "gpu:0"
                raise RuntimeError("boom")
        assert _new_op_device(x) == "gpu:1"
    assert _new_op_device(x) == ""


def test_invalid_inner_guard_keeps_outer_device(x):
    with device_guard("gpu:1"):
        with pytest.raises(ValueError):
            with device_guard("gpu:x"):
                pass  # pragma: no cover
        assert _new_op_device(x) == "gpu:1"


def test_staticpipe_and_paddle_guards_nest(x):
    with paddle.static.device_guard("gpu:1"):
        with staticpipe.device_guard("GPU:0"):
            assert _new_op_device(x) == "gpu:0"
        assert _new_op_device(x) == "gpu:1"
    with staticpipe.device_guard("gpu:2"):
        with paddle.static.device_guard("cpu"):
            assert _new_op_device(x) == "cpu"
        assert _new_op_device(x) == "gpu:2"


@pytest.mark.parametrize("world, selected, device", [
    (None, None, "gpu:0"),  # one process: GPU 0 (the CPU without CUDA)
    (None, 3, "gpu:0"),  # a selection without a launched job changes nothing
    ((1, 4), 1, "gpu:1"),  # a launched rank: the GPU its launcher selected, not everyone's GPU 0
    ((1, 4), None, "gpu:0"),  # launched on a CPU machine: nothing selected
])
def test_the_default_place_of_a_launched_rank_is_its_own_gpu(world, selected, device):
    assert placement.default_device(world, selected) == device


def test_messages_travel_from_the_ranks_gpu_under_nccl_and_from_host_memory_under_gloo():
    """A "cpu" stage in an NCCL job too sends from its rank's GPU (NCCL moves device memory only)."""
    assert placement.transfer_device("NCCL", 2) == "gpu:2"
    assert placement.transfer_device("nccl", 0) == "gpu:0"
    assert placement.transfer_device("GLOO", 2) == "cpu"
    with pytest.raises(ValueError, match=r"^an NCCL job's rank has no GPU of its own: its launcher sets "
                                         r"FLAGS_selected_gpus"):
        placement.transfer_device("NCCL", None)


def test_only_lazily_connecting_groups_are_warmed_up_where_they_are_made():
    assert placement.connects_lazily("NCCL") and not placement.connects_lazily("GLOO")
