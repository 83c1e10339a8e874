"""The runtime: startup placement, the loader flow, state, progress, and failures that must not hang."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import dense_layers, learning_rate_var, minimize
from staticpipe._paddle import np, paddle
from staticpipe.runtime.devices import Devices

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pipelined_mlp(stages=2, microbatches=4, worker_threads="auto", **kw):
    net = build_mlp(num_stages=stages, **kw)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9), dict(num_microbatches=microbatches))
    exe = staticpipe.Executor(worker_threads=worker_threads)
    exe.run(net.startup)
    return net, exe


def loader_for(net, samples=64, batch_size=4, iterable=False):
    """A loader of micro-batches (Paddle's convention): 64 samples make 4 steps of 4 x 4."""
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=4, iterable=iterable)
    loader.set_sample_generator(net.sample_reader(samples), batch_size=batch_size)
    return loader


def test_startup_puts_each_parameter_on_its_stage_only():
    net, exe = pipelined_mlp()
    plan = staticpipe.plan_of(net.main)
    for stage in plan.stages:
        scope = exe.scope_of(stage.device)
        for other in plan.stages:
            for name in other.parameters:
                assert (scope.find_var(name) is not None) == (other is stage), (name, stage.device)
    rate = learning_rate_var(net.main)
    assert exe.scope_of("gpu:0").find_var(rate) is not None
    assert exe.scope_of("gpu:1").find_var(rate) is not None


def test_train_from_dataset_equals_step_by_step_runs(capsys):
    net, exe = pipelined_mlp()
    twin_net, twin_exe = pipelined_mlp()
    loader = loader_for(net)
    loader.start()
    history = exe.train_from_dataset(net.main, loader, fetch_list=[net.loss, net.outputs["accuracy"]],
                                     print_period=2)
    loader.reset()
    batches = [dict(zip(["features", "label"], b)) for b in _batches(net, 64, 16)]
    expected = [twin_exe.run(twin_net.main, feed=b, fetch_list=[twin_net.loss, twin_net.outputs["accuracy"]])
                for b in batches]
    assert len(history) == 4
    np.testing.assert_array_equal(np.array(history, dtype=object).astype(float),
                                  np.array(expected, dtype=object).astype(float))
    out = capsys.readouterr().err
    accuracy = re.escape(net.outputs["accuracy"].name)
    assert re.search(rf"^step 1: loss=[\d.]+, {accuracy}=[\d.]+, [\d.]+ samples/s$", out, re.M)
    assert re.search(r"^step 4: loss=", out, re.M) and not re.search(r"^step 3:", out, re.M)
    assert re.search(r"^trained 4 steps, 64 samples in [\d.]+ s \([\d.]+ samples/s\)$", out, re.M)


def _batches(net, samples, batch_size):
    rows = list(net.sample_reader(samples)())
    for i in range(0, samples, batch_size):
        chunk = rows[i:i + batch_size]
        yield [np.stack([r[k] for r in chunk]) for k in range(len(net.feeds))]


def test_fetch_info_names_the_printed_values(capsys):
    net, exe = pipelined_mlp()
    loader = loader_for(net, iterable=True)
    exe.train_from_dataset(net.main, loader, fetch_list=[net.loss], fetch_info=["xent"], print_period=1)
    assert re.search(r"^step 2: xent=[\d.]+, ", capsys.readouterr().err, re.M)


def test_fetched_batched_values_are_concatenated_over_microbatches():
    net, exe = pipelined_mlp()
    batch = net.random_batch(16)
    logits, = exe.run(net.main, feed=batch, fetch_list=[net.outputs["logits"]])
    assert logits.shape == (16, 10)


def test_state_dict_round_trip_and_unknown_names():
    net, exe = pipelined_mlp()
    exe.run(net.main, feed=net.random_batch(16), fetch_list=[net.loss])
    state = exe.state_dict(net.main)
    assert f"{dense_layers(net.main)[0][0]}_velocity_0" in state and not any(k.endswith("@MERGED") for k in state)
    changed = {k: (v + 1).astype(v.dtype) for k, v in state.items()}
    exe.set_state_dict(net.main, changed)
    for k, v in exe.state_dict(net.main).items():
        np.testing.assert_array_equal(v, changed[k])
    with pytest.raises(KeyError, match=re.escape("set_state_dict: no stage holds ['nope']")):
        exe.set_state_dict(net.main, {"nope": np.zeros(1)})


def test_bad_feeds_are_named():
    net, exe = pipelined_mlp()
    batch = net.random_batch(16)
    with pytest.raises(ValueError, match=re.escape(
            "feed does not match the program's data variables: missing ['label'], unknown []; "
            "expected ['features', 'label']")):
        exe.run(net.main, feed={"features": batch["features"]}, fetch_list=[net.loss])
    with pytest.raises(ValueError, match=re.escape(
            "batch size 18 of feed variable 'features' is not divisible by num_microbatches=4; "
            "use a batch size that is a multiple of 4 (e.g. 16 or 20)")):
        exe.run(net.main, feed=net.random_batch(18), fetch_list=[net.loss])
    with pytest.raises(ValueError, match=re.escape(
            "feed variable 'features': expected shape [-1, 64] (batch, ...), received shape (16, 65)")):
        exe.run(net.main, feed={"features": np.zeros((16, 65), "float32"), "label": batch["label"]})
    exe.run(net.main, feed=batch)
    with pytest.raises(ValueError, match=re.escape(
            "micro-batch size 2 differs from the first step's micro-batch size 4 the plan runs; every micro-batch "
            "must have the same size: feed micro-batches (loader batches) of 4 samples, or global batches of 16 "
            "(num_microbatches=4)")):
        exe.run(net.main, feed=net.random_batch(8))


def test_bad_arguments_are_named():
    net, exe = pipelined_mlp()
    with pytest.raises(ValueError, match=re.escape("threads_per_stage must be an integer >= 1 or a dict device -> integer >= 1, got 0")):
        staticpipe.Executor(threads_per_stage=0)
    with pytest.raises(ValueError, match="this program has no pipeline plan"):
        exe.train_from_dataset(paddle.static.Program(), loader_for(net))
    with pytest.raises(ValueError, match=re.escape("scope must be None: staticpipe keeps one scope per device")):
        exe.train_from_dataset(net.main, loader_for(net), scope=paddle.static.Scope())
    with pytest.raises(ValueError, match=re.escape("cannot fetch 'nope': it is not computed by the pipelined")):
        exe.run(net.main, feed=net.random_batch(16), fetch_list=["nope"])


def test_a_failing_stage_stops_the_pipeline_with_its_error_and_the_next_step_is_clean():
    net, exe = pipelined_mlp()
    twin_net, twin = pipelined_mlp()
    bad = net.random_batch(16)
    bad["label"][9] = 99  # out of range for 10 classes: stage 1's cross entropy fails on micro-batch 2
    start = time.monotonic()
    with pytest.raises(staticpipe.StageError, match=r"^stage 1 \(gpu:1\) failed in action 1F2: IndexError") as err:
        exe.run(net.main, feed=bad, fetch_list=[net.loss])
    assert time.monotonic() - start < 10
    assert err.value.stage == 1 and str(err.value.action) == "1F2"
    assert isinstance(err.value.__cause__, IndexError)
    # the failed step's partial gradients were discarded: the next step equals a clean executor's
    good = net.random_batch(16, seed=3)
    exe.run(net.main, feed=good)
    twin.run(twin_net.main, feed=good)
    for name, value in twin.state_dict(twin_net.main).items():
        np.testing.assert_array_equal(exe.state_dict(net.main)[name], value, err_msg=name)


def test_first_stage_failure_wakes_the_waiting_stage():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        with staticpipe.device_guard("gpu:0"):
            ids = paddle.static.data("ids", [None, 1], "int64")
            emb = paddle.static.nn.embedding(ids, size=[8, 4])
            h = paddle.reshape(emb, [-1, 4])
        with staticpipe.device_guard("gpu:1"):
            loss = paddle.mean(paddle.static.nn.fc(h, 1))
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
    exe = staticpipe.Executor()
    exe.run(startup)
    ids = np.array([[1], [2], [3], [42]], "int64")  # 42 is outside the 8-row table: micro-batch 1 fails
    with pytest.raises(staticpipe.StageError, match=r"^stage 0 \(gpu:0\) failed in action 0F1: "):
        exe.run(main, feed={"ids": ids}, fetch_list=[loss])


def test_generator_errors_reach_the_caller():
    net, exe = pipelined_mlp()

    def broken_reader():
        yield from net.sample_reader(16)()
        raise OSError("disk gone")

    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    loader.set_sample_generator(broken_reader, batch_size=16)
    with pytest.raises(OSError, match="disk gone"):
        exe.train_from_dataset(net.main, loader, fetch_list=[net.loss])


@pytest.mark.parametrize("delay_s", [0.0, 3.0], ids=["at-once", "mid-training"])
def test_keyboard_interrupt_stops_training_cleanly(tmp_path, delay_s):
    """Ctrl-C at once (the loader starting, the first step handing out its jobs and starting the stage
    threads) or in the middle of training; the process is killed if it does not stop."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        import staticpipe
        from staticpipe._paddle import paddle
        from models import build_mlp
        net = build_mlp(num_stages=2, hidden=512, depth=4)
        with paddle.static.program_guard(net.main, net.startup):
            staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=4).minimize(net.loss)
        exe = staticpipe.Executor(); exe.run(net.startup)
        loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
        loader.set_sample_generator(net.sample_reader(10**7), batch_size=64)
        try:
            print("training", flush=True)
            exe.train_from_dataset(net.main, loader, fetch_list=[net.loss], print_period=10**6)
        except KeyboardInterrupt:
            print("interrupted cleanly", flush=True)
            exe.close()
            sys.exit(3)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "training"
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 3 and "interrupted cleanly" in out, err[-3000:]
    finally:
        if proc.poll() is None:  # hung: no process outlives its test
            proc.kill()
            proc.communicate()


def finishes(call, timeout_s=30.0):
    """``call()`` on a helper thread: its result, or the exception it raised; a failure, not a hang, if it
    has not returned within ``timeout_s``."""
    outcome = {}

    def run():
        try:
            outcome["result"] = call()
        except BaseException as exc:  # noqa: BLE001 -- the test looks at it
            outcome["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still running after {timeout_s} s"
    return outcome


def stage_threads():
    return [t for t in threading.enumerate() if t.name.startswith("staticpipe-gpu") and t.is_alive()]


@pytest.mark.parametrize("where", ["starting a stage thread", "handing out a job", "before the calling rank runs"])
def test_an_interrupt_anywhere_in_a_step_stops_every_job_it_handed_out(monkeypatch, where):
    """Ctrl-C raises ``KeyboardInterrupt`` wherever the main thread is, also between handing a stage's job
    to its worker thread and the code that aborts the step: right after the first step starts a stage
    thread (the thread pool waited there for the new thread to run, seconds on a loaded machine), right
    after a job is queued, or as the calling thread's own rank begins. Each is injected here at that exact
    point. The step must raise it with no job left running (one left waited in ``recv`` for ever, took the
    next step's messages, and kept ``close()`` and interpreter exit waiting); the next step trains and
    ``close()`` ends every stage thread."""
    others = set(stage_threads())  # of executors of earlier tests, not closed
    net, exe = pipelined_mlp(worker_threads=None)  # every step hands a job to a stage thread
    batch = net.random_batch(16)
    if where == "starting a stage thread":  # the first step starts the thread
        start = threading.Thread.start

        def interrupted_start(thread):
            start(thread)
            if thread.name.startswith("staticpipe-gpu"):
                raise KeyboardInterrupt
        monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    else:
        finishes(lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss]))
        name = "submit" if where == "handing out a job" else "run_lane"
        original = getattr(Devices, name)

        def interrupted(self, *args):
            if name == "submit":
                original(self, *args)
            elif threading.current_thread().name.startswith("staticpipe-"):  # another lane's: runs as it is
                return original(self, *args)
            raise KeyboardInterrupt
        monkeypatch.setattr(Devices, name, interrupted)
    assert isinstance(finishes(lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss])).get("error"),
                      KeyboardInterrupt)
    monkeypatch.undo()
    (loss,) = finishes(lambda: exe.run(net.main, feed=batch, fetch_list=[net.loss]))["result"]
    assert np.isfinite(loss)
    finishes(exe.close)
    deadline = time.monotonic() + 10
    while set(stage_threads()) - others and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(stage_threads()) - others == set()
