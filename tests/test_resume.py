"""train/resume.py: every checkpoint ``train_from_dataset`` writes records where each epoch's data stands, and
a run resumed from any of them trains what the uninterrupted run trained after it -- the same fetched losses,
the same bits in every parameter and optimizer state -- whatever feeds it: a generator shuffled with numpy's
global generator (iterable, started as Paddle's scripts do, in a producer process), a shuffled
``paddle.io.Dataset`` with or without worker processes."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe import restarts
from staticpipe._paddle import core, np, paddle

pytestmark = pytest.mark.timeout(300)
SAMPLES, BATCH, MICRO = 40, 4, 2  # 10 loader batches an epoch: 5 steps; a checkpoint every 2 steps and at its end


class Samples(paddle.io.Dataset):
    """The network's samples as a map-style dataset that counts what it loads."""

    def __init__(self, samples):
        self.samples, self.loaded = samples, 0

    def __getitem__(self, index):
        self.loaded += 1
        return self.samples[index]

    def __len__(self):
        return len(self.samples)


def job(kind: str, lr_step: str):
    """(network, executor, the loader, how an epoch starts) of a small 2-stage job fed by ``kind``."""
    net = build_mlp(num_stages=2, in_dim=8, hidden=8, depth=2, seed=1)
    decay = paddle.optimizer.lr.StepDecay(0.01, 1 if lr_step is None else 3, 0.5)  # stepped per epoch: halves each
    minimize(net, paddle.optimizer.Adam(decay), dict(num_microbatches=MICRO))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    samples = list(net.sample_reader(SAMPLES)())
    if kind in ("dataset", "workers"):
        dataset = Samples(samples)
        loader = staticpipe.io.DataLoader(dataset, feed_list=net.feeds, batch_size=BATCH, shuffle=True,
                                          num_workers=2 if kind == "workers" else 0)
        return net, exe, loader, lambda: None

    def reader():  # a new order every epoch, drawn from numpy's global generator as the epoch runs
        for i in np.random.permutation(len(samples)):
            yield samples[i]

    loader = staticpipe.io.DataLoader.from_generator(feed_list=net.feeds, capacity=4, iterable=kind != "started",
                                                     use_multiprocess=kind == "process")
    loader.set_sample_generator(reader, batch_size=BATCH)
    return net, exe, loader, loader.start if kind == "started" else lambda: None


def train(kind: str, directory: str, epochs: int = 2, lr_step: str = "step", resume=None):
    """The script of a job, as a restarted process runs it again from its top: (losses, final state, loader)."""
    np.random.seed(7)
    net, exe, loader, start = job(kind, lr_step)
    losses = []
    for _ in range(epochs):
        start()
        history = exe.train_from_dataset(net.main, None if kind == "started" else loader, fetch_list=[net.loss],
                                         lr_step=lr_step, checkpoint_dir=directory, checkpoint_every=2, keep_last=99,
                                         resume=resume, print_period=10**6)
        losses += [float(np.mean(v[0])) for v in history]
        if kind == "started":
            loader.reset()
        if lr_step is None:  # the script steps its scheduler itself, as Paddle's scripts do
            net.main.lr_scheduler.step()
    return losses, exe.state_dict(net.main), loader


def resumed_from(tmp_path, name: str, directory: str, **kw):
    """A fresh job resumed from the one checkpoint ``name`` of ``directory`` alone."""
    alone = tmp_path / f"from-{name}"
    shutil.copytree(os.path.join(directory, name), alone / name)
    return train(directory=str(alone), resume=True, **kw)


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("kind, lr_step", [("generator", "step"), ("started", "epoch"), ("process", None),
                                           ("dataset", "step"), ("workers", "epoch")])
def test_a_resumed_run_trains_what_the_uninterrupted_one_did(tmp_path, kind, lr_step):
    directory = str(tmp_path / "ckpt")
    losses, state, _ = train(kind, directory, lr_step=lr_step)
    assert sorted(os.listdir(directory)) == [f"step-{s:08d}" for s in (2, 4, 5, 6, 8, 10)]
    for name, step in (("step-00000004", 4), ("step-00000005", 5), ("step-00000008", 8)):
        got, got_state, _ = resumed_from(tmp_path, name, directory, kind=kind, lr_step=lr_step)
        assert got == losses[step:], name
        assert_same_state(got_state, state)


def test_a_dataset_skips_the_trained_batches_unloaded(tmp_path, capsys):
    directory = str(tmp_path / "ckpt")
    losses, _, _ = train("dataset", directory)
    capsys.readouterr()
    got, _, loader = resumed_from(tmp_path, "step-00000008", directory, kind="dataset")
    assert got == losses[8:]
    assert loader.dataset.loaded == SAMPLES - 3 * MICRO * BATCH  # epoch 0 skipped, then epoch 1 after 3 steps
    err = capsys.readouterr().err
    where = os.path.join(str(tmp_path / "from-step-00000008"), "step-00000008")
    assert f"staticpipe: resumed from {where} at step 8: epoch 1 goes on after its first 6 batches\n" in err
    assert "staticpipe: epoch 0 was trained before the checkpoint resumed; nothing to train\n" in err


def test_the_checkpoint_records_every_position(tmp_path):
    directory = str(tmp_path / "ckpt")
    train("generator", directory)
    positions = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        (position,) = meta["data"]
        positions[meta["step"]] = (position["epoch"], position["batches"], position["ended"])
        assert meta["job"] is None and set(position["random"]) == {"numpy", "python"}
    assert positions == {2: (0, 4, False), 4: (0, 8, False), 5: (0, 10, True),
                         6: (1, 2, False), 8: (1, 6, False), 10: (1, 10, True)}


def test_a_restart_resumes_only_its_own_jobs_checkpoints(tmp_path, monkeypatch, capsys):
    directory = str(tmp_path / "ckpt")
    monkeypatch.setenv(restarts.ENV_JOB, "first-job")
    losses, state, _ = train("generator", directory)
    monkeypatch.setenv(restarts.ENV_JOB, "second-job")
    monkeypatch.setenv(restarts.ENV_RESTART, "1")
    fresh = str(tmp_path / "fresh")
    shutil.copytree(directory, fresh)
    capsys.readouterr()
    got, got_state, _ = train("generator", fresh)  # resume=None: a restart of a job with no checkpoint of its own
    assert f"staticpipe: resuming: no checkpoint of this job in {fresh!r} yet; training from the start" in \
        capsys.readouterr().err
    assert got == losses
    assert_same_state(got_state, state)
    monkeypatch.setenv(restarts.ENV_JOB, "first-job")
    shutil.rmtree(os.path.join(directory, "step-00000010"))  # killed before its last checkpoint was in place
    got, got_state, _ = train("generator", directory)
    assert "resumed from" in capsys.readouterr().err and got == losses[8:]
    assert_same_state(got_state, state)


def test_the_newest_checkpoint_is_the_newest_whole_one_of_the_job(tmp_path):
    def checkpoint(name, job=None, meta=True):
        os.makedirs(tmp_path / name)
        if meta:
            (tmp_path / name / "meta.json").write_text(json.dumps({"job": job}))

    assert restarts.newest_checkpoint(str(tmp_path / "missing")) is None
    checkpoint("step-00000003", "a")
    checkpoint("step-00000004", "b")
    checkpoint("step-00000005", "a", meta=False)  # its save died before meta.json: never whole
    checkpoint("step-00000006.staticpipe-save-123-abcdef01", "a")  # a save's staging directory
    checkpoint("step-7", "a")  # steps compare as numbers, not as names
    (tmp_path / "step-00000009").write_text("a file")
    assert restarts.newest_checkpoint(str(tmp_path), "a") == (str(tmp_path / "step-7"), 7)
    assert restarts.newest_checkpoint(str(tmp_path), "b") == (str(tmp_path / "step-00000004"), 4)
    assert restarts.newest_checkpoint(str(tmp_path), "c") is None
    assert restarts.newest_checkpoint(str(tmp_path)) == (str(tmp_path / "step-7"), 7)


def test_keep_last_keeps_only_its_own_jobs_checkpoints(tmp_path, monkeypatch):
    directory = str(tmp_path / "ckpt")
    for job_id, epochs in (("first-job", 2), ("second-job", 1)):  # a new job in the same directory
        monkeypatch.setenv(restarts.ENV_JOB, job_id)
        np.random.seed(7)
        net, exe, loader, _ = job("generator", "step")
        for _ in range(epochs):
            exe.train_from_dataset(net.main, loader, checkpoint_dir=directory, checkpoint_every=2, keep_last=2)
    assert restarts.checkpoints(directory, "first-job") == [(os.path.join(directory, f"step-{s:08d}"), s) for s in (10, 8)]
    assert restarts.checkpoints(directory, "second-job") == [(os.path.join(directory, f"step-{s:08d}"), s) for s in (5, 4)]


def test_resume_errors_name_the_argument_and_the_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    train("generator", directory, epochs=1)
    net, exe, loader, _ = job("generator", "step")
    for resume in (True, 1):
        with pytest.raises(ValueError, match=re.escape(
                f"resume must be None, True or False, and True needs checkpoint_dir; got resume={resume!r}, "
                "checkpoint_dir=None")):
            exe.train_from_dataset(net.main, loader, resume=resume)
    meta_file = os.path.join(directory, "step-00000005", "meta.json")
    with open(meta_file, encoding="utf-8") as f:
        meta = json.load(f)
    meta["data"] = meta["data"] * 2
    with open(meta_file, "w", encoding="utf-8") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match=re.escape(
            f"checkpoint {os.path.join(directory, 'step-00000005')!r} records where the data of 2 process(es) "
            "stood; this job has 1: resume it with as many processes, or load it with staticpipe.load and "
            "continue the data yourself")):
        train("generator", directory, resume=True)
    before = exe.state_dict(net.main)  # a refused resume changes nothing
    with pytest.raises(ValueError, match="records where the data of 2 process"):
        staticpipe.load(net.main, os.path.join(directory, "step-00000005"), exe, loader=loader)
    assert exe.global_step == 0 and loader.position().batches == 0
    assert_same_state(exe.state_dict(net.main), before)


def test_save_and_load_given_the_loader_go_on_where_its_data_stood(tmp_path):
    """A loop of one's own, as Paddle's scripts write it (``exe.run`` takes a step from the started loader
    until ``EOFException``), saving with ``staticpipe.save(..., loader=)``."""
    def loop(resume_from=None, epochs=2):
        np.random.seed(7)
        net, exe, loader, _ = job("started", "step")
        first = 0
        if resume_from is not None:
            meta = staticpipe.load(net.main, str(tmp_path / resume_from), exe, loader=loader)
            first = meta["position"].epoch + meta["position"].ended  # the epoch to go on with
        losses = []
        for _ in range(first, epochs):
            loader.start()
            while True:
                try:
                    (loss,) = exe.run(net.main, fetch_list=[net.loss])
                except core.EOFException:
                    loader.reset()
                    break
                losses.append(float(loss))
                if resume_from is None:
                    staticpipe.save(net.main, str(tmp_path / f"step-{exe.global_step}"), exe, loader=loader)
        return losses, exe.state_dict(net.main)

    losses, state = loop()
    for step in (3, 5, 7):
        got, got_state = loop(f"step-{step}")
        assert got == losses[step:], step
        assert_same_state(got_state, state)
    with open(tmp_path / "step-5" / "meta.json", encoding="utf-8") as f:
        assert json.load(f)["data"][0]["batches"] == 5 * MICRO  # the epoch's last step; its EOF not yet seen
    net, exe, loader, _ = job("started", "step")
    staticpipe.save(net.main, str(tmp_path / "no-loader"), exe)
    with pytest.raises(ValueError, match=re.escape(
            f"checkpoint {str(tmp_path / 'no-loader')!r} records no data position: it was saved without a loader")):
        staticpipe.load(net.main, str(tmp_path / "no-loader"), exe, loader=loader)
