"""Misuse of the executor and optimizer: nothing hangs, nothing is silent, a failed call leaves nothing behind."""
from __future__ import annotations

import re
import threading

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import dense_layers, minimize, op_vars
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(120)


def pipelined(microbatches=2, **kw):
    net = build_mlp(num_stages=2, **kw)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9), dict(num_microbatches=microbatches))
    return net


def started(net, **kw):
    exe = staticpipe.Executor(**kw)
    exe.run(net.startup)
    return exe


def test_two_threads_on_one_executor_run_one_after_the_other():
    """Steps of two threads are whole steps, one after the other: six steps on one batch from two threads
    end exactly where six steps in a row do, and nothing hangs."""
    net, twin = pipelined(), pipelined()
    exe, reference = started(net), started(twin)
    batch = net.random_batch(8, seed=0)
    losses: list = []

    def train() -> None:
        for _ in range(3):
            losses.append(exe.run(net.main, feed=batch, fetch_list=[net.loss])[0])

    threads = [threading.Thread(target=train) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and len(losses) == 6 and exe.global_step == 6
    for _ in range(6):
        reference.run(twin.main, feed=batch, fetch_list=[twin.loss])
    want = reference.state_dict(twin.main)
    for name, value in exe.state_dict(net.main).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_an_empty_batch_is_refused_and_leaves_nothing_behind():
    net = pipelined()
    exe = started(net)
    empty = {k: v[:0] for k, v in net.random_batch(8).items()}
    with pytest.raises(ValueError, match=re.escape("empty micro-batches: the batch has no samples (feed variables "
                                                   "['features', 'label'])")):
        exe.run(net.main, feed=empty, fetch_list=[net.loss])
    assert exe.global_step == 0
    exe.run(net.main, feed=net.random_batch(8), fetch_list=[net.loss])  # the next batch trains
    fresh = started(net)  # and a new executor is unaffected
    fresh.run(net.main, feed=net.random_batch(12), fetch_list=[net.loss])


def test_state_before_the_startup_program_is_refused():
    net = pipelined()
    exe = staticpipe.Executor()
    weight = dense_layers(net.main)[0][0]
    with pytest.raises(ValueError, match=re.escape(
            "set_state_dict before the startup program: stage 0 (gpu:0) has no value for")):
        exe.set_state_dict(net.main, {weight: np.zeros((64, 256), "float32")})
    with pytest.raises(ValueError, match=r"^stage 0 \(gpu:0\) has no value for '.+' and \d+ more: run the startup "
                                         r"program \(exe.run\(startup\)\) before the first step$"):
        exe.run(net.main, feed=net.random_batch(8))


def test_a_value_of_another_dtype_is_refused_unless_it_converts_exactly():
    net = pipelined()
    exe = started(net)
    name = dense_layers(net.main)[0][0]
    weight = exe.state_dict(net.main)[name]
    with pytest.raises(ValueError, match=re.escape(
            f"set_state_dict: '{name}' is float32 in the program, but the value given is float64 and does not "
            "convert exactly")):
        exe.set_state_dict(net.main, {name: weight.astype("float64") + 1e-12})
    exe.set_state_dict(net.main, {name: weight.astype("float64")})  # exact: stored as float32
    assert exe.state_dict(net.main)[name].dtype == np.float32


class DoesNothing(paddle.optimizer.SGD):
    def minimize(self, loss, **kwargs):
        return [], []


def test_an_optimizer_that_adds_no_updates_and_a_second_minimize_are_refused():
    net = build_mlp(num_stages=2)
    with pytest.raises(ValueError, match=re.escape(
            "the inner optimizer's minimize (DoesNothing) added no update ops to the program: nothing would ever "
            "train; wrap a paddle.optimizer.Optimizer")):
        minimize(net, DoesNothing(0.1), dict(num_microbatches=2))
    net = pipelined()
    with pytest.raises(ValueError, match=re.escape("minimize was already called on this program")):
        minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2))


def test_a_custom_schedule_may_be_written_as_text_per_rank():
    text = {0: ["0F0", "0F1", "0B0", "0B1", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1", "1OPT"]}
    net = build_mlp(num_stages=2)
    minimize(net, paddle.optimizer.SGD(0.1), dict(num_microbatches=2, schedule=text))
    exe = started(net)
    assert np.isfinite(exe.run(net.main, feed=net.random_batch(8), fetch_list=[net.loss])[0])
    for bad, message in (({0: "0F0 0B0"}, "rank 0 of the custom schedule must map to a list of actions, got str"),
                         ({0: [3]}, "rank 0 of the custom schedule holds 3: actions are Action objects or their text"),
                         ({"a": []}, "a custom schedule's keys are ranks (integers >= 0), got 'a'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), 1, bad)


def test_a_closed_executor_refuses_every_call():
    net = pipelined()
    exe = started(net)
    exe.close()
    message = "this staticpipe.Executor was closed"
    for call in (lambda: exe.run(net.main, feed=net.random_batch(8)), lambda: exe.run(net.startup),
                 lambda: exe.state_dict(net.main), lambda: exe.set_state_dict(net.main, {})):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()


def test_check_finite_names_the_first_non_finite_value():
    net = pipelined()
    exe = started(net, check_finite=True)
    batch = net.random_batch(8)
    batch["features"][5, 3] = np.nan  # row 5: micro-batch 1 of 2
    product = op_vars(net.main, "mul", "Out")[0]  # the first layer's
    with pytest.raises(staticpipe.NonFiniteError, match=re.escape(
            "stage 0 (gpu:0) failed in action 0F1: the first non-finite value: op 'mul' wrote 256 NaN and 0 Inf "
            f"into '{product}'")) as err:
        exe.run(net.main, feed=batch, fetch_list=[net.loss])
    assert (err.value.stage, str(err.value.action), err.value.op, err.value.variable) == (0, "0F1", "mul", product)
    assert not paddle.get_flags("FLAGS_check_nan_inf")["FLAGS_check_nan_inf"]  # put back after the step
    before = exe.state_dict(net.main)
    exe.run(net.main, feed=net.random_batch(8), fetch_list=[net.loss])  # the failed step left nothing behind
    assert all(np.isfinite(v).all() for v in exe.state_dict(net.main).values())
    assert any(not np.array_equal(v, before[k]) for k, v in exe.state_dict(net.main).items())


def test_without_check_finite_a_non_finite_loss_gets_a_hint(capsys):
    """(An Inf in an input does not always show: this MLP's ReLU turns the NaN of inf * w into 0 and the loss
    looks normal; check_finite catches that case. A NaN weight reaches the loss.)"""
    net = pipelined()
    exe = started(net)
    last = net.main.all_parameters()[-2].name  # the classifier's weight, on the last stage
    weight = exe.state_dict(net.main)[last]
    exe.set_state_dict(net.main, {last: np.full_like(weight, np.nan)})
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    loader.set_sample_generator(net.sample_reader(16), batch_size=4)
    exe.train_from_dataset(net.main, loader, fetch_list=[net.loss])
    err = capsys.readouterr().err
    assert err.count("is not finite") == 1
    assert ("step 1: loss is not finite: a NaN or Inf reached it; staticpipe.Executor(check_finite=True) stops at "
            "the first op that writes one") in err


def test_exe_run_gives_the_same_hint_once(caplog):
    net = pipelined()
    exe = started(net)
    last = net.main.all_parameters()[-2].name
    exe.set_state_dict(net.main, {last: np.full_like(exe.state_dict(net.main)[last], np.nan)})
    with caplog.at_level("WARNING", logger="staticpipe"):
        for _ in range(2):
            [loss] = exe.run(net.main, feed=net.random_batch(8), fetch_list=[net.loss])
    assert np.isnan(loss)
    hints = [r.getMessage() for r in caplog.records if "is not finite" in r.getMessage()]
    assert hints == [f"staticpipe: step 1: {net.loss.name} is not finite: a NaN or Inf reached it; "
                     "staticpipe.Executor(check_finite=True) stops at the first op that writes one, naming the "
                     "stage, micro-batch, op and variable"]


def test_one_executors_check_finite_never_reaches_another_executors_steps():
    """Paddle's NaN/Inf check is one process-wide flag. An executor that checks (its steps failing on a NaN
    weight) and one that does not (its steps making an Inf on the way, which it does not ask about) step
    at once from two threads: every unchecked step trains, every checked one stops with NonFiniteError."""
    import threading

    checked, unchecked = pipelined(), pipelined()
    exe_checked, exe_unchecked = started(checked, check_finite=True), started(unchecked)
    last = checked.main.all_parameters()[-2].name
    exe_checked.set_state_dict(checked.main, {last: np.full_like(exe_checked.state_dict(checked.main)[last], np.nan)})
    inf_batch = unchecked.random_batch(8)
    inf_batch["features"][0, 0] = np.inf  # ReLU turns inf * w into inf or 0: an Inf inside, never fetched
    errors: dict[str, list] = {"checked": [], "unchecked": []}

    def steps(exe, net, batch, key):
        for _ in range(15):
            try:
                exe.run(net.main, feed=batch)
            except Exception as exc:  # noqa: BLE001 -- collected and asserted below
                errors[key].append(type(exc).__name__)

    threads = [threading.Thread(target=steps, args=(exe_checked, checked, checked.random_batch(8), "checked")),
               threading.Thread(target=steps, args=(exe_unchecked, unchecked, inf_batch, "unchecked"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors["unchecked"] == []
    assert errors["checked"] == ["NonFiniteError"] * 15
    assert not paddle.get_flags("FLAGS_check_nan_inf")["FLAGS_check_nan_inf"]  # put back after the steps
