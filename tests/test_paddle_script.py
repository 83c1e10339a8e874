"""Paddle's own pipeline script, literally: ``loader.start(); exe.train_from_dataset(main)``, a loader batch
per micro-batch, Paddle's signatures, and the errors a user of that script can run into."""
from __future__ import annotations

import re

import pytest

import staticpipe
from models import build_mlp, build_resnet
from pipeline_util import evaluation_net, minimize, parameter_names
from staticpipe._paddle import core, np, paddle

pytestmark = pytest.mark.timeout(120)
M, MBS = 4, 4  # micro-batches per step, samples per loader batch


def momentum():
    return paddle.optimizer.Momentum(0.1, momentum=0.9)


def pipelined(**pipeline):
    net = build_mlp(num_stages=2)
    minimize(net, momentum(), dict(num_microbatches=M, **pipeline))
    return net


def started_loader(net, samples=4 * M * MBS, batch_size=MBS, drop_last=True, **kw):
    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=8, iterable=False, **kw)
    loader.set_sample_generator(net.sample_reader(samples), batch_size=batch_size, drop_last=drop_last)
    loader.start()
    return loader


def reference(samples: int, steps: int):
    """Single-device Paddle training, one step per ``M * MBS`` samples of the same reader: the global
    batch is the concatenation of a step's loader batches."""
    net = build_mlp(num_stages=2, guarded=False)
    minimize(net, momentum(), None)
    exe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    exe.run(net.startup, scope=scope)
    rows = list(net.sample_reader(samples)())
    losses = []
    for k in range(steps):
        chunk = rows[k * M * MBS:(k + 1) * M * MBS]
        feed = {name: np.stack([r[i] for r in chunk]) for i, name in enumerate(["features", "label"])}
        losses.append(float(exe.run(net.main, feed=feed, fetch_list=[net.loss], scope=scope)[0]))
    params = {name: np.array(scope.find_var(name).get_tensor()) for name in parameter_names(net.main)}
    return losses, params


def assert_equal_training(history, exe, net, samples, steps):
    losses, params = reference(samples, steps)
    assert len(history) == steps
    np.testing.assert_allclose([float(h[0]) for h in history], losses, rtol=1e-5)
    state = exe.state_dict(net.main)
    for name, value in params.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_seed_script_trains_on_micro_batch_loader_batches(capsys, program_ir):
    """``train_from_dataset(main)`` with no dataset reads the started loader; each loader batch is one
    micro-batch, so a step is single-device training on M concatenated loader batches."""
    net = pipelined()
    loader = started_loader(net)
    exe = staticpipe.Executor(paddle.CPUPlace())
    exe.run(net.startup)
    history = exe.train_from_dataset(net.main, fetch_list=[net.loss], print_period=1)
    assert_equal_training(history, exe, net, 4 * M * MBS, 4)
    err = capsys.readouterr().err
    assert err.count("staticpipe: a loader batch is one micro-batch") == 1
    assert (f"staticpipe: a loader batch is one micro-batch: micro-batch size {MBS}, {M} micro-batches per "
            f"step, global batch {M * MBS}") in err
    assert re.search(rf"^trained 4 steps, {4 * M * MBS} samples in ", err, re.M)
    with pytest.raises(core.EOFException):
        loader.next_batch()  # the epoch was read to its end; reset() stays the caller's, as in Paddle
    loader.reset()


def test_paddle_signature_and_the_default_main_program():
    net = pipelined()
    started_loader(net)
    exe = staticpipe.Executor("cpu")
    exe.run(net.startup)
    with paddle.static.program_guard(net.main, net.startup):
        history = exe.train_from_dataset(None, None, None, 0, False, [net.loss], ["xent"], 100, None)
    assert len(history) == 4


def test_an_epoch_that_does_not_fill_its_last_step_says_so(capsys):
    net = pipelined()
    started_loader(net, samples=10 * MBS)  # 10 loader batches: 2 steps, 2 batches left
    exe = staticpipe.Executor()
    exe.run(net.startup)
    history = exe.train_from_dataset(net.main, fetch_list=[net.loss])
    assert_equal_training(history, exe, net, 10 * MBS, 2)
    assert ("the epoch's last 2 loader batches (of 10) do not fill a step of num_microbatches=4 micro-batches: "
            "they were not trained on") in capsys.readouterr().err


def test_a_short_last_batch_of_drop_last_false_is_not_trained_on(capsys):
    net = pipelined()
    started_loader(net, samples=8 * MBS + 3, drop_last=False)  # 8 full batches and one of 3 samples
    exe = staticpipe.Executor()
    exe.run(net.startup)
    history = exe.train_from_dataset(net.main, fetch_list=[net.loss])
    assert_equal_training(history, exe, net, 8 * MBS + 3, 2)
    assert ("the last loader batch has 3 samples, not the micro-batch size 4 (drop_last=False): it and the 0 "
            "batches before it in its step were not trained on") in capsys.readouterr().err


def test_exe_run_with_no_feed_takes_a_step_from_the_started_loader():
    net = pipelined()
    loader = started_loader(net, samples=2 * M * MBS + MBS)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    history = [exe.run(net.main, fetch_list=[net.loss]) for _ in range(2)]
    assert_equal_training(history, exe, net, 2 * M * MBS, 2)
    with pytest.raises(core.EOFException, match=re.escape(
            "the epoch ended 1 loader batches into a step of num_microbatches=4: they were not trained on")):
        exe.run(net.main, fetch_list=[net.loss])
    loader.reset()


def test_a_global_batch_feed_is_still_split():
    net = pipelined()
    exe = staticpipe.Executor()
    exe.run(net.startup)
    loss_dict = exe.run(net.main, feed=net.random_batch(M * MBS, seed=0), fetch_list=[net.loss])
    twin = pipelined()
    other = staticpipe.Executor()
    other.run(twin.startup)
    loss_list = other.run(twin.main, feed=[twin.random_batch(M * MBS, seed=0)], fetch_list=[twin.loss])  # Paddle's per-place list
    np.testing.assert_array_equal(loss_dict, loss_list)
    with pytest.raises(ValueError, match=re.escape("a list feed holds one dict per place; a pipeline takes one "
                                                   "global batch, got a list of 2")):
        exe.run(net.main, feed=[net.random_batch(16), net.random_batch(16)])


def test_the_loader_a_program_trains_on_must_be_there_alone_and_fit():
    net = pipelined()
    exe = staticpipe.Executor()
    exe.run(net.startup)
    with pytest.raises(ValueError, match=re.escape(
            "train_from_dataset has no dataset and no started loader feeds this program (no loader at all)")):
        exe.train_from_dataset(net.main)
    idle = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=False)
    with pytest.raises(ValueError, match=re.escape(
            "no started loader feeds this program (a loader of ['features', 'label'] (not started))")):
        exe.train_from_dataset(net.main)
    first, second = started_loader(net), started_loader(net)
    with pytest.raises(ValueError, match=re.escape(
            "train_from_dataset: 2 started loaders feed this program (['features', 'label']; "
            "['features', 'label']); reset all but one")):
        exe.train_from_dataset(net.main)
    first.reset(), second.reset(), idle.reset()
    partial = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds[:1], iterable=False)
    partial.set_sample_generator(lambda: iter([]), batch_size=1)
    partial.start()
    with pytest.raises(ValueError, match=re.escape(
            "the loader's feed_list ['features'] does not match the program's data variables ['features', "
            "'label']: missing ['label'], not data variables of the program []")):
        exe.train_from_dataset(net.main)
    partial.reset()


def test_micro_batch_sizes_must_agree():
    net = pipelined(micro_batch_size=MBS)
    exe = staticpipe.Executor()
    exe.run(net.startup)
    loader = started_loader(net, batch_size=MBS + 1)
    with pytest.raises(ValueError, match=re.escape(
            "micro-batch size 5 differs from micro_batch_size=4 the plan runs; every micro-batch must have the same "
            "size: feed micro-batches (loader batches) of 4 samples, or global batches of 16 (num_microbatches=4), "
            "or build the plan with micro_batch_size=5")):
        exe.train_from_dataset(net.main)
    loader.reset()
    odd = [net.random_batch(MBS), net.random_batch(MBS), net.random_batch(MBS + 2), net.random_batch(MBS)]
    with pytest.raises(ValueError, match=re.escape("the micro-batches of a step must have one size; got sizes "
                                                   "[4, 4, 6, 4]")):
        exe.step(net.main, odd)
    rows = list(net.sample_reader(8 * MBS)())
    batches = [rows[i:i + MBS] for i in range(0, 8 * MBS, MBS)]
    batches[1] = batches[1][:2]  # a small batch in the middle of an epoch is a data error, not an end
    mixed = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, iterable=True)
    mixed.set_sample_list_generator(lambda: iter(batches))
    with pytest.raises(ValueError, match=re.escape(
            "loader batch 1 has 2 samples, but the micro-batch size is 4 (the epoch's first batch); only the "
            "last batch of an epoch may be smaller (drop_last=False)")):
        exe.train_from_dataset(net.main, mixed)


@pytest.mark.parametrize("builder", [lambda guarded=True: build_mlp(num_stages=2, guarded=guarded),
                                     lambda guarded=True: build_resnet(num_stages=2, guarded=guarded, width=8,
                                                                       image_size=16)],
                         ids=["mlp", "resnet-batchnorm"])
def test_infer_from_dataset_runs_the_forward_in_test_mode_and_updates_nothing(capsys, builder, program_ir):
    """A training program runs its forward as its test-mode twin (a legacy ``clone(for_test=True)``; on PIR,
    which has none, its forward ops cloned with ``is_test`` set): batch norm reads the trained running
    statistics and leaves them. Each step's values are what the network computes in test mode on one
    device from the trained state, on the step's loader batches (each one micro-batch)."""
    net = builder()
    minimize(net, momentum(), dict(num_microbatches=M))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(M * MBS, seed=7))  # running statistics that are not the initial ones
    before = exe.state_dict(net.main)
    started_loader(net, samples=2 * M * MBS)
    history = exe.infer_from_dataset(net.main, fetch_list=[net.loss])
    assert re.search(rf"^inferred 2 steps, {2 * M * MBS} samples in ", capsys.readouterr().err, re.M)
    test = evaluation_net(builder(guarded=False), builder, guarded=False)
    plain, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    plain.run(test.startup, scope=scope)
    for name, value in before.items():
        scope.var(name).get_tensor().set(value, paddle.CPUPlace())
    rows = list(net.sample_reader(2 * M * MBS)())
    names = [v.name for v in net.feeds]
    for k, values in enumerate(history):
        chunk = rows[k * M * MBS:(k + 1) * M * MBS]
        feed = {name: np.stack([r[i] for r in chunk]) for i, name in enumerate(names)}
        want = plain.run(test.main, feed=feed, fetch_list=[test.loss], scope=scope)[0]
        np.testing.assert_allclose(values[0], want, rtol=1e-5)
    assert len(history) == 2 and exe.global_step == 1
    for name, value in exe.state_dict(net.main).items():  # nothing updated, running statistics neither
        np.testing.assert_array_equal(value, before[name], err_msg=name)


class Recorder(paddle.base.executor.FetchHandler):
    def __init__(self, var_dict):
        super().__init__(var_dict=var_dict, period_secs=0)
        self.calls = []

    def handler(self, res_dict):
        self.calls.append(res_dict)


def test_fetch_handler_gets_its_variables_as_paddle_calls_it():
    net = pipelined()
    exe = staticpipe.Executor()
    exe.run(net.startup)
    started_loader(net)
    weight = net.main.all_parameters()[0]
    recorder = Recorder({"loss": net.loss, "w": weight})
    history = exe.train_from_dataset(net.main, fetch_list=[net.loss], fetch_handler=recorder)
    assert len(recorder.calls) == 4 and all(set(c) == {"loss", "w"} for c in recorder.calls)
    np.testing.assert_allclose([float(c["loss"]) for c in recorder.calls], [float(h[0]) for h in history])
    np.testing.assert_array_equal(recorder.calls[-1]["w"], exe.state_dict(net.main)[weight.name])
    with pytest.raises(ValueError, match="fetch_handler must be a paddle.static FetchHandler"):
        exe.train_from_dataset(net.main, fetch_handler=print)


@pytest.mark.parametrize("place", [None, "cpu", "gpu", "gpu:1", paddle.CPUPlace()])
def test_executor_takes_what_paddle_executor_takes(place):
    exe = staticpipe.Executor(place)
    assert isinstance(exe.place, core.CPUPlace)  # no CUDA here: every place is the CPU


def test_bad_places_and_device_maps_are_named(monkeypatch):
    with pytest.raises(ValueError, match=re.escape("invalid device 'tpu:0': accepted forms are")):
        staticpipe.Executor("tpu:0")
    with pytest.raises(ValueError, match=re.escape("place must be a Paddle place (paddle.CPUPlace(), "
                                                   "paddle.CUDAPlace(k)), a device string ('cpu', 'gpu', 'gpu:k') "
                                                   "or None, got int: 0")):
        staticpipe.Executor(0)
    with pytest.raises(ValueError, match=re.escape("device_map entry 'gpu:1': 'gpu0': invalid device 'gpu0'")):
        staticpipe.Executor(device_map={"gpu:1": "gpu0"})
    monkeypatch.setenv("STATICPIPE_DEVICE_MAP", "gpu:1:gpu:0")
    with pytest.raises(ValueError, match=re.escape("STATICPIPE_DEVICE_MAP='gpu:1:gpu:0': entry 'gpu:1:gpu:0' is "
                                                   "not 'device=device' (e.g. gpu:1=gpu:0)")):
        staticpipe.Executor()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_device_map_keeps_a_worker_per_stage_and_the_same_training(monkeypatch, how):
    """On a CPU machine every stage is a CPU device already, so a map changes no number: it must still
    give every pipeline device its own worker and scope."""
    mapping = {"gpu:1": "gpu:0"}
    if how == "environment":
        monkeypatch.setenv("STATICPIPE_DEVICE_MAP", "gpu:1=gpu:0")
    net = pipelined()
    exe = staticpipe.Executor(device_map=mapping if how == "argument" else None)
    exe.run(net.startup)
    started_loader(net)
    history = exe.train_from_dataset(net.main, fetch_list=[net.loss])
    assert_equal_training(history, exe, net, 4 * M * MBS, 4)
    assert exe.scope_of("gpu:0") is not exe.scope_of("gpu:1")
    plan = staticpipe.plan_of(net.main)
    assert plan.stages[1].parameters and exe.scope_of("gpu:0").find_var(plan.stages[1].parameters[0]) is None


@pytest.mark.parametrize("samples, batch_size, why", [
    (0, MBS, "the loader gave no batch: its data source yielded nothing"),
    (3, MBS, "the loader gave no batch: its data had 3 sample(s), fewer than batch_size=4, and drop_last=True "
             "dropped them"),
    (3 * MBS, MBS, "the loader gave 3 batch(es), fewer than the num_microbatches=4 a step takes"),
])
def test_an_epoch_without_a_step_is_an_error_that_says_why(samples, batch_size, why):
    net = pipelined()
    exe = staticpipe.Executor()
    exe.run(net.startup)
    loader = started_loader(net, samples=samples, batch_size=batch_size)
    with pytest.raises(ValueError, match=re.escape(f"the epoch trained no step: {why}")):
        exe.train_from_dataset(net.main)
    loader.reset()


def test_training_again_without_reset_is_refused():
    net = pipelined()
    exe = staticpipe.Executor()
    exe.run(net.startup)
    loader = started_loader(net)
    exe.train_from_dataset(net.main)
    with pytest.raises(RuntimeError, match=re.escape(
            "the DataLoader's epoch has ended: call loader.reset() and loader.start() before the next one")):
        exe.train_from_dataset(net.main)
    loader.reset()
    loader.start()
    assert len(exe.train_from_dataset(net.main)) == 4
