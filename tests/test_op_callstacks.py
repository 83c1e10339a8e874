"""staticpipe.op_callstacks: ops created under ``fast_callstacks()`` record exactly the call stack Paddle's
own ``traceback.extract_stack()`` gives, and the switch restores Paddle's module after the block."""
from __future__ import annotations

import contextlib
import traceback

import pytest

from models import build_mlp
from staticpipe._paddle import framework, paddle
from staticpipe.op_callstacks import fast_callstacks

RECORDS_STACKS = getattr(framework, "traceback", None) is traceback


def callstacks(switch) -> list[list[str]]:
    """Every op's recorded call stack of an MLP minimized with ``switch`` held (built by the same lines
    either way, so that the stacks can only differ by how they were taken)."""
    with switch():
        net = build_mlp(num_stages=1, guarded=False)
        with paddle.static.program_guard(net.main, net.startup):
            paddle.optimizer.Adam(1e-3).minimize(net.loss)
    return [list(op.attr("op_callstack")) for program in (net.main, net.startup)
            for op in program.global_block().ops if op.has_attr("op_callstack")]


@pytest.mark.skipif(not RECORDS_STACKS, reason="this Paddle's Operator takes no call stack through traceback")
def test_the_recorded_call_stacks_are_paddles_own():
    ours, paddles = (callstacks(switch) for switch in (fast_callstacks, contextlib.nullcontext))
    assert len(ours) == len(paddles) > 10
    assert sum(1 for stack in ours if stack) > 10  # real stacks (the backward's ops record none)
    assert any(line.strip().startswith("paddle.optimizer.Adam(1e-3).minimize") for line in ours[-1] + ours[-2])
    assert ours == paddles


def test_the_switch_restores_paddles_traceback_and_leaves_other_functions():
    before = getattr(framework, "traceback", None)
    with fast_callstacks():
        inside = getattr(framework, "traceback", None)
        if RECORDS_STACKS:
            assert inside is not traceback
            assert inside.format_exc is traceback.format_exc  # everything else is Python's own
        else:
            assert inside is before
    assert getattr(framework, "traceback", None) is before


@pytest.mark.skipif(not RECORDS_STACKS, reason="this Paddle's Operator takes no call stack through traceback")
def test_a_source_edited_before_the_hold_is_read_again(tmp_path, monkeypatch):
    """Python's ``extract_stack`` re-reads a source file edited since ``linecache`` cached it; so does ours,
    once per file and hold."""
    import importlib
    import linecache
    import os

    source = tmp_path / "edited_layer.py"
    source.write_text("import paddle\n\ndef layer(x):\n    return paddle.nn.functional.relu(x)  # FIRST\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_layer")
    assert "FIRST" in linecache.getline(str(source), 4)  # cached, as an earlier traceback would have
    source.write_text("import paddle\n\ndef layer(x):\n    return paddle.nn.functional.relu(x)  # SECOND\n")
    os.utime(source, (os.path.getmtime(source) + 5,) * 2)

    def recorded(switch):
        program = paddle.static.Program()
        with switch(), paddle.static.program_guard(program, paddle.static.Program()):
            module.layer(paddle.static.data("x", [None, 2], "float32"))
        return [line for line in program.global_block().ops[-1].attr("op_callstack") if "relu(x)" in line]

    assert recorded(fast_callstacks) == recorded(contextlib.nullcontext) == [
        "    return paddle.nn.functional.relu(x)  # SECOND"]
