"""The runtime: startup placement, the loader flow, state, progress, and failures that must not hang."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import dense_layers, learning_rate_var, minimize
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(120)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pipelined_mlp(stages=2, microbatches=4, **kw):
    net = build_mlp(num_stages=stages, **kw)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9), dict(num_microbatches=microbatches))
    exe = staticpipe.Executor()
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
            "micro-batch size 2 differs from the plan's compiled micro-batch size 4 (global batch 16 with "
            "num_microbatches=4); every batch must have the same size")):
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


def test_keyboard_interrupt_stops_training_cleanly(tmp_path):
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
        print("training", flush=True)
        try:
            exe.train_from_dataset(net.main, loader, fetch_list=[net.loss], print_period=10**6)
        except KeyboardInterrupt:
            print("interrupted cleanly", flush=True)
            exe.close()
            sys.exit(3)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    assert proc.stdout.readline().strip() == "training"
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "interrupted cleanly" in out
