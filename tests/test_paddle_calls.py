"""Paddle's calls that read or write ``global_scope()`` without the executor, on a pipelined program
(``checkpoint.front_paddle_calls``), and an evaluation clone run by ``exe.run`` in a launched job.

- ``paddle.static.set_program_state`` and ``paddle.static.load`` (with or without an executor) would write a
  ``global_scope()`` no stage reads: refused, before and after ``exe.flush()``, naming what to use, and
  the stages keep their state;
- ``paddle.static.save`` writes ``global_scope()``: refused before any flush and once the stages changed
  since the last flush, naming ``exe.flush()``; right after a flush it writes the current state;
- launched (pp=2): ``exe.run(main.clone(for_test=True), feed=...)`` gives the single-device evaluation
  of the trained state on the rank computing it, as ``exe.evaluate`` runs it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from pipeline_util import launch_script
from test_paddle_io import BATCH, STEPS, TRAINED, assert_same, one_device, pipeline

import staticpipe
from staticpipe._paddle import paddle
from staticpipe.checkpoint import LOAD, SAVE, SET_PROGRAM_STATE

pytestmark = pytest.mark.timeout(300)


def test_set_program_state_and_load_are_refused_naming_what_restores_a_pipeline(tmp_path, program_ir):
    net, _, exe = pipeline()
    state = exe.state_dict(net.main)
    other = {n: v + 1 for n, v in state.items()}
    with paddle.static.scope_guard(paddle.static.Scope()):
        for flushed in (False, True):
            if flushed:
                assert exe.flush()
            with pytest.raises(RuntimeError) as e:
                paddle.static.set_program_state(net.main, other)
            assert str(e.value) == SET_PROGRAM_STATE
            for args in ((), (exe,)):
                with pytest.raises(RuntimeError) as e:
                    paddle.static.load(net.main, str(tmp_path / "model"), *args)
                assert str(e.value) == LOAD
            assert_same(exe.state_dict(net.main), state, "after the refused calls")
    assert "exe.set_state_dict(program, state_dict)" in SET_PROGRAM_STATE and "staticpipe.load(program" in LOAD


def test_paddle_static_save_is_refused_unless_the_last_flush_holds_the_current_state(tmp_path, program_ir):
    net, _, exe = pipeline()
    path = str(tmp_path / "model")
    with paddle.static.scope_guard(paddle.static.Scope()):
        with pytest.raises(RuntimeError) as e:
            paddle.static.save(net.main, path)
        assert str(e.value) == SAVE.format(path=path, why="no staticpipe.Executor flushed this pipelined "
                                                            "program's state there")
        assert exe.flush()
        exe.run(net.main, feed=net.random_batch(BATCH, seed=STEPS), fetch_list=[net.loss])  # a step after it
        with pytest.raises(RuntimeError, match=r"writes what paddle.static.global_scope\(\) holds, not the stages "
                                               r"of a pipelined program, and the stages changed since the last "
                                               r"exe.flush\(\) \("):
            paddle.static.save(net.main, path)
        assert not os.path.exists(path + ".pdparams")
        assert exe.flush()
        try:
            paddle.static.save(net.main, path)
        except ValueError as e:  # PIR: the state is written, then the device guards are refused (test_paddle_io)
            assert program_ir == "pir" and "op_device" in str(e)
    assert_same(dict(paddle.static.load_program_state(path)), exe.state_dict(net.main), "saved after the flush")


SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import staticpipe
from test_paddle_io import BATCH, build
out = {out!r}
net, test = build()
""" + TRAINED + """batch = net.random_batch(BATCH, seed=9)
for run in range(2):  # the clone's plan is made once, and it sees the state of every step
    logits, = exe.run(test.main, feed=batch, fetch_list=[test.outputs["logits"]])
    if logits is not None:
        np.save(os.path.join(out, f"eval_{{run}}_rank{{os.environ['PADDLE_TRAINER_ID']}}.npy"), logits)
exe.close()
"""


def test_launched_exe_run_of_the_evaluation_clone_gives_the_single_device_values(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launch_script(tmp_path, SCRIPT, 2)
    ref, ref_test, ref_exe, ref_scope = one_device(dict(np.load(tmp_path / "trained.npz")))
    with paddle.static.scope_guard(ref_scope):
        want, = ref_exe.run(ref_test.main, feed=ref.random_batch(BATCH, seed=9),
                            fetch_list=[ref_test.outputs["logits"]])
    got = sorted(p for p in os.listdir(tmp_path) if p.startswith("eval_"))
    assert got == ["eval_0_rank1.npy", "eval_1_rank1.npy"]  # the last stage's rank computes the logits
    for name in got:
        np.testing.assert_allclose(np.load(tmp_path / name), want, rtol=1e-6, atol=1e-7, err_msg=name)
    assert np.abs(want).max() > 0


SHARDED = """
import os, sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
import numpy as np
import staticpipe
from test_paddle_io import BATCH, build
out = {out!r}
net, test = build(dp=2, sharding=2)  # ZeRO-1: fleet's process layout, which the evaluation must follow
""" + TRAINED + """loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
loader.set_sample_generator(net.sample_reader(16, seed=9), batch_size=8)
loss, = exe.evaluate(test.main, loader, [test.loss], like=net.main)
if loss is not None:
    np.save(os.path.join(out, f"loss_rank{{os.environ['PADDLE_TRAINER_ID']}}.npy"), loss)
exe.close()
"""


def test_launched_evaluation_follows_the_sharded_process_layout(tmp_path, monkeypatch):
    """pp 2 x 2 replicas sharing their optimizer state (4 processes, fleet's layout: process 1 is stage 0 of
    the second replica): the evaluation's forward-only plan lays the processes out as training does (it
    ran each rank on the other rank's stages, which it had no values for), and gives one device's loss."""
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launch_script(tmp_path, SHARDED, 4)
    ref, ref_test, ref_exe, ref_scope = one_device(dict(np.load(tmp_path / "trained.npz")))
    with paddle.static.scope_guard(ref_scope):
        want, = ref_exe.run(ref_test.main, feed=ref.random_batch(16, seed=9), fetch_list=[ref_test.loss])
    got = sorted(p for p in os.listdir(tmp_path) if p.startswith("loss_"))
    assert got == ["loss_rank2.npy", "loss_rank3.npy"]  # the last stage's ranks: g // 2 % 2 == 1
    for name in got:
        np.testing.assert_allclose(np.load(tmp_path / name), want, rtol=1e-6, err_msg=name)


def test_paddle_static_save_after_a_flush_of_a_closed_executor_of_an_evaluation_clone_and_of_a_nan(
        tmp_path, program_ir):
    """Saves the flush covers are not refused: the evaluation clone's program (its forward-only plan holds
    no state: the training plan's flush counts), after the flushing executor is closed (nothing can change
    since), and a state holding a NaN (equal to itself there)."""
    net, test, exe = pipeline()
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    loader.set_sample_generator(net.sample_reader(8), batch_size=8)
    exe.evaluate(test.main, loader, [test.loss], like=net.main)  # the clone now has a plan of its own
    name = sorted(exe.state_dict(net.main))[0]
    exe.set_state_dict(net.main, {name: np.full_like(exe.state_dict(net.main)[name], np.nan)})
    with paddle.static.scope_guard(paddle.static.Scope()):
        assert exe.flush()
        state = exe.state_dict(net.main)
        saves = [(test.main, str(tmp_path / "clone")), (net.main, str(tmp_path / "nan"))]
        if program_ir == "legacy":  # PIR: Paddle refuses the device guards after writing (test_paddle_io)
            for program, path in saves:
                paddle.static.save(program, path)
            exe.close()
            paddle.static.save(net.main, str(tmp_path / "closed"))
            assert_same(dict(paddle.static.load_program_state(str(tmp_path / "closed"))), state, "after close")
            assert np.isnan(paddle.static.load_program_state(str(tmp_path / "nan"))[name]).all()
        else:
            from staticpipe.runtime.paddle_io import stale
            assert [stale(staticpipe.plan_of(p), paddle.static.global_scope()) for p, _ in saves] == [None, None]
            exe.close()
            assert stale(staticpipe.plan_of(net.main), paddle.static.global_scope()) is None


def test_paddle_static_load_with_a_staticpipe_executor_on_a_plain_program_names_paddles_executor(tmp_path):
    net, _, exe = pipeline()
    plain = paddle.static.Program()
    with pytest.raises(TypeError) as e:
        paddle.static.load(plain, str(tmp_path / "model"), exe)
    assert str(e.value) == ("paddle.static.load(program, path, executor) takes Paddle's own executor "
                            "(paddle.static.Executor), got staticpipe.executor.Executor: for a program a "
                            "staticpipe.Executor pipelines, use staticpipe.load(program, dir, exe)")

