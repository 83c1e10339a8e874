"""Checkpoints under misuse and damage: a save touches nothing the library did not create, and a load
either applies a whole, verified checkpoint or raises naming the culprit with the live state unchanged."""
from __future__ import annotations

import fcntl
import json
import errno
import os
import pickle

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import dense_layers, learning_rate_var, minimize
from staticpipe import atomic, pickled_arrays
from staticpipe._paddle import np, paddle

pytestmark = pytest.mark.timeout(300)


def small(steps=1, scheduler=False):
    net = build_mlp(num_stages=2, hidden=16)
    lr = paddle.optimizer.lr.StepDecay(0.01, step_size=1) if scheduler else 0.01
    minimize(net, paddle.optimizer.Adam(lr), dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    for step in range(steps):
        exe.run(net.main, feed=net.random_batch(8, seed=step))
        if scheduler:
            net.main.lr_scheduler.step()
    return net, exe


def saved(tmp_path, name="ck", **kw):
    """A checkpoint of a net trained one step, and a fresh net (another state) to load it into."""
    net, exe = small(**kw)
    path = str(tmp_path / name)
    staticpipe.save(net.main, path, exe)
    return path, exe.state_dict(net.main), small(steps=0, **kw)


def refused(fresh, path, error, message):
    """``load`` raises exactly ``message``, and the executor's state, step and scheduler are as before."""
    net, exe = fresh
    before, step = exe.state_dict(net.main), exe.global_step
    scheduler = getattr(net.main, "lr_scheduler", None)
    schedule = scheduler.state_dict() if scheduler is not None else None
    with pytest.raises(error) as err:
        staticpipe.load(net.main, path, exe)
    assert str(err.value) == message
    assert exe.global_step == step and (scheduler is None or scheduler.state_dict() == schedule)
    after = exe.state_dict(net.main)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def rewrite(path, name, arrays):
    """Replace the file ``name`` of a checkpoint by ``arrays`` (any picklable value) and record its true
    checksum in meta.json, so that only the content checks can catch what it holds."""
    file = os.path.join(path, name)
    with open(file, "wb") as f:
        pickle.dump(arrays, f, protocol=4)
    edit_meta(path, lambda meta: meta["files"].__setitem__(name, pickled_arrays.digest(file)))
    return file


def edit_meta(path, change):
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    change(meta)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def test_a_save_and_a_load_touch_nothing_the_library_did_not_create(tmp_path):
    mine = {"ck.old": "old", "ck.tmp": "tmp", "ck.staticpipe-save-1-0123abcd": "no marker", "gone.old": "looks old"}
    for name, text in mine.items():
        os.makedirs(tmp_path / name)
        (tmp_path / name / "meta.json").write_text(text)
    net, exe = small()
    for _ in range(2):
        staticpipe.save(net.main, str(tmp_path / "ck"), exe)
    staticpipe.load(net.main, str(tmp_path / "ck"), exe)
    with pytest.raises(FileNotFoundError) as err:
        staticpipe.load(net.main, str(tmp_path / "gone"), exe)
    assert str(err.value) == f"no checkpoint at {str(tmp_path / 'gone')!r}"
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", *mine])
    for name, text in mine.items():
        assert os.listdir(tmp_path / name) == ["meta.json"] and (tmp_path / name / "meta.json").read_text() == text


def test_saving_over_a_file_a_link_or_a_foreign_directory_is_refused_before_anything_moves(tmp_path):
    net, exe = small()
    (tmp_path / "file").write_bytes(b"precious")
    os.makedirs(tmp_path / "data")
    (tmp_path / "data" / "a.txt").write_text("precious")
    staticpipe.save(net.main, str(tmp_path / "ck"), exe)
    os.symlink(tmp_path / "ck", tmp_path / "link")
    cases = [("file", NotADirectoryError, "it is a file, and a checkpoint is a directory. Nothing was changed"),
             ("data", ValueError, "the directory holds no meta.json, so it is not a checkpoint staticpipe wrote, and "
                                  "replacing it would delete its files. Choose another path or delete it. Nothing was "
                                  "changed"),
             ("link", ValueError, f"it is a symbolic link (to {str(tmp_path / 'ck')!r}); save to the directory itself. "
                                  "Nothing was changed")]
    for name, error, reason in cases:
        with pytest.raises(error) as err:
            staticpipe.save(net.main, str(tmp_path / name), exe)
        assert str(err.value) == f"cannot save a checkpoint to {str(tmp_path / name)!r}: {reason}"
    with pytest.raises(NotADirectoryError) as err:
        staticpipe.save_plan(net.main, str(tmp_path / "file"), net.startup)
    assert str(err.value) == (f"cannot save a saved plan to {str(tmp_path / 'file')!r}: it is a file, and a saved "
                              "plan is a directory. Nothing was changed")
    with pytest.raises(FileNotFoundError) as err:
        staticpipe.load(net.main, str(tmp_path / "file"), exe)
    assert str(err.value) == f"no checkpoint at {str(tmp_path / 'file')!r}: it is a file, a checkpoint is a directory"
    assert sorted(os.listdir(tmp_path)) == ["ck", "data", "file", "link"]
    assert (tmp_path / "file").read_bytes() == b"precious" and os.listdir(tmp_path / "data") == ["a.txt"]
    os.makedirs(tmp_path / "empty")  # an empty directory made for the checkpoint is fine
    staticpipe.save(net.main, str(tmp_path / "empty"), exe)
    assert staticpipe.load(net.main, str(tmp_path / "empty"), exe)["step"] == 1


def test_a_moved_aside_checkpoint_is_put_back_only_once_its_save_is_dead(tmp_path):
    """A staging directory as a save leaves it between moving the previous checkpoint aside and renaming
    the new one into place: while its marker is locked (the save runs) a load leaves it alone; once the
    lock is free (the save died) the load puts the previous checkpoint back and removes the rest."""
    path, state, (net, exe) = saved(tmp_path)
    staging = path + atomic.STAGING + "4242-0123abcd"
    os.makedirs(os.path.join(staging, atomic.NEW))
    lock = os.open(os.path.join(staging, atomic.MARKER), os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(path, os.path.join(staging, atomic.PREVIOUS))
    with pytest.raises(FileNotFoundError):
        staticpipe.load(net.main, path, exe)
    assert sorted(os.listdir(staging)) == sorted([atomic.MARKER, atomic.NEW, atomic.PREVIOUS])
    os.close(lock)  # the save dies
    assert staticpipe.load(net.main, path, exe)["step"] == 1
    assert os.listdir(tmp_path) == ["ck"]
    weight = dense_layers(net.main)[0][0]  # the first layer's
    np.testing.assert_array_equal(exe.state_dict(net.main)[weight], state[weight])


def test_a_missing_optimizer_file_is_refused_unless_the_checkpoint_has_no_optimizer_state(tmp_path):
    path, state, fresh = saved(tmp_path)
    pdopt = os.path.join(path, "model.pdopt")
    os.rename(pdopt, pdopt + ".away")
    refused(fresh, path, FileNotFoundError, f"checkpoint {path!r} is incomplete: {pdopt!r} is missing (meta.json "
                                            "lists it)")
    os.rename(os.path.join(path, "meta.json"), os.path.join(path, "meta.json.away"))  # as paddle.static.save's
    refused(fresh, path, FileNotFoundError, f"checkpoint {path!r} is incomplete: {pdopt!r} is missing (a "
                                            "checkpoint without meta.json has both files)")
    os.rename(os.path.join(path, "meta.json.away"), os.path.join(path, "meta.json"))
    edit_meta(path, lambda meta: meta["files"].pop("model.pdopt"))  # a checkpoint of the parameters only
    net, exe = fresh
    live = exe.state_dict(net.main)
    calls = []
    exe.set_state_dict = lambda *args, **kw: calls.append(type(exe).set_state_dict(exe, *args, **kw))
    assert staticpipe.load(net.main, path, exe)["step"] == 1 and len(calls) == 1
    params = {p.name for p in net.main.global_block().all_parameters()}
    for name, value in exe.state_dict(net.main).items():
        np.testing.assert_array_equal(value, state[name] if name in params else live[name], err_msg=name)


def test_a_corrupt_meta_json_changes_nothing(tmp_path):
    path, _, fresh = saved(tmp_path, scheduler=True)
    meta_file = os.path.join(path, "meta.json")
    good = open(meta_file, "rb").read()
    with open(meta_file, "wb") as f:
        f.write(b"\xff" + good[1:])
    refused(fresh, path, ValueError, f"{meta_file!r} is corrupt: UnicodeDecodeError: 'utf-8' codec can't decode "
                                     "byte 0xff in position 0: invalid start byte")
    with open(meta_file, "wb") as f:
        f.write(good[:-20])
    refused(fresh, path, ValueError, f"{meta_file!r} is corrupt: JSONDecodeError: {json_error(good[:-20])}")
    prefix = f"{meta_file!r} is not the meta data of a staticpipe checkpoint of format 2: "
    for change, problem in [
            (lambda m: m.update(format=1), "its format is 1"),
            (lambda m: m.update(step="7"), "its step '7' is not a count of steps"),
            (lambda m: m.pop("lr_scheduler"), "it has no lr_scheduler"),
            (lambda m: m["files"]["model.pdparams"].pop("sha256"), "its files {'model.pdparams': {'bytes': {b}}, "
             "'model.pdopt': {o}} do not give model.pdparams (and model.pdopt, if the checkpoint has optimizer "
             "state) with their sha256 and bytes")]:
        with open(meta_file, "wb") as f:
            f.write(good)
        meta = json.loads(good)
        edit_meta(path, change)
        problem = problem.replace("{b}", str(meta["files"]["model.pdparams"]["bytes"])).replace(
            "{o}", str(meta["files"]["model.pdopt"]))
        refused(fresh, path, ValueError, prefix + problem)
    with open(meta_file, "wb") as f:
        f.write(good)
    edit_meta(path, lambda m: m.update(lr_scheduler={"last_epoch": 1}))
    refused(fresh, path, ValueError, f"{meta_file!r}: its lr_scheduler state does not fit the program's StepDecay: "
                                     "Please check whether state_dict is correct for optimizer. Can't find "
                                     "[ last_lr ] in state_dict")


def json_error(text):
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return str(exc)
    raise AssertionError("the text is valid JSON")


def test_a_flipped_truncated_or_garbled_array_file_is_named(tmp_path):
    path, _, fresh = saved(tmp_path)
    file = os.path.join(path, "model.pdparams")
    good = open(file, "rb").read()
    recorded = json.load(open(os.path.join(path, "meta.json")))["files"]["model.pdparams"]
    for damaged in (good[:len(good) // 2] + bytes([good[len(good) // 2] ^ 0x40]) + good[len(good) // 2 + 1:],
                    good[:-100]):
        with open(file, "wb") as f:
            f.write(damaged)
        found = pickled_arrays.digest(file)
        refused(fresh, path, ValueError, f"{file!r} is corrupt: it has {found['bytes']} bytes with sha256 "
                                         f"{found['sha256']}, but meta.json recorded {recorded['bytes']} bytes with "
                                         f"sha256 {recorded['sha256']}")
    os.remove(os.path.join(path, "meta.json"))  # unverifiable, as paddle.static.save writes it: the unpickler names it
    for damaged, raised in ((good[:-100], "UnpicklingError: pickle data was truncated"),
                            (b"\xff" + good[1:], "UnpicklingError: invalid load key, '\\xff'.")):
        with open(file, "wb") as f:
            f.write(damaged)
        refused(fresh, path, ValueError, f"{file!r} is truncated or corrupt: unpickling it raised {raised}")
    rewrite_plain(file, ["not", "a", "dict"])
    refused(fresh, path, ValueError, f"{file!r} holds a list, not a dict of arrays by name")
    weight = dense_layers(fresh[0].main)[0][0]  # the first layer's
    rewrite_plain(file, {weight: [1.0, 2.0], 3: np.zeros(2)})
    refused(fresh, path, ValueError, f"{file!r} holds entries that are not arrays by name: '{weight}' (list), "
                                     "3 (ndarray)")


def rewrite_plain(file, value):
    with open(file, "wb") as f:
        pickle.dump(value, f, protocol=4)


class Payload:
    """Unpickling it creates the file ``path``: what a crafted checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_loading_never_runs_code_from_a_crafted_pickle(tmp_path):
    path, _, fresh = saved(tmp_path)
    pwned = str(tmp_path / "pwned")
    rate = learning_rate_var(fresh[0].main)
    for payload in ({rate: Payload(pwned)},
                    {rate: np.array([Payload(pwned)], dtype=object)}):  # inside numpy's reconstruction
        file = rewrite(path, "model.pdopt", payload)
        refused(fresh, path, ValueError, f"{file!r} refers to the Python global io.open, which a file of arrays "
                                         "never needs: refused before anything ran (a crafted or foreign pickle)")
        assert not os.path.exists(pwned)
    with open(file, "rb") as f:
        pickle.load(f)  # the payload is live: plain unpickling runs it
    assert os.path.exists(pwned)


def test_an_array_of_another_dtype_is_named_before_anything_is_set(tmp_path):
    path, state, fresh = saved(tmp_path)
    params = {name: value for name, value in pickled_arrays.read(os.path.join(path, "model.pdparams")).items()}
    layers = dense_layers(fresh[0].main)
    weight, bias = layers[0][0], layers[1][1]  # the first layer's weight, the second's bias
    params[weight] = params[weight].astype("float64")
    params[bias] = params[bias].astype("float16")
    rewrite(path, "model.pdparams", params)
    refused(fresh, path, ValueError, f"checkpoint {path!r} does not match the program: missing none; unexpected "
                                     f"none; wrong shapes none; wrong dtypes ['{weight}: checkpoint float64, program "
                                     f"float32', '{bias}: checkpoint float16, program float32']")


@pytest.mark.parametrize("protocol", [2, 3, 4])
def test_what_paddle_static_save_writes_loads(tmp_path, protocol):
    """Paddle's own files (every pickle protocol it writes; protocol 2 stores bytes through _codecs.encode)
    pass the allow-list; that Paddle reads staticpipe's files is tested in test_checkpoint."""
    net, exe = small(steps=0)
    ref = build_mlp(num_stages=2, hidden=16, guarded=False)
    minimize(ref, paddle.optimizer.Adam(0.01), None)
    pexe, scope = paddle.static.Executor(paddle.CPUPlace()), paddle.static.Scope()
    with paddle.static.scope_guard(scope):
        pexe.run(ref.startup)
        pexe.run(ref.main, feed=ref.random_batch(8, seed=3))
        paddle.static.save(ref.main, str(tmp_path / "single" / "model"), protocol=protocol)
    assert staticpipe.load(net.main, str(tmp_path / "single"), exe)["step"] == 0
    for name, value in exe.state_dict(net.main).items():
        np.testing.assert_array_equal(value, np.array(scope.find_var(name).get_tensor()), err_msg=name)


def test_a_full_disk_during_a_save_names_the_checkpoint_and_keeps_the_old_one(tmp_path, monkeypatch):
    net, exe = small()
    path = str(tmp_path / "ck")
    staticpipe.save(net.main, path, exe)
    saved = exe.state_dict(net.main)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path + ".staging", "params"))
    monkeypatch.setattr(staticpipe.checkpoint.pickled_arrays, "write", full)
    with pytest.raises(OSError) as err:
        staticpipe.save(net.main, path, exe)
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == (f"[Errno 28] No space left on device while saving a checkpoint to {path!r}; what "
                              "was there before, if anything, is kept whole")
    monkeypatch.undo()
    exe.set_state_dict(net.main, {n: v * 0 for n, v in saved.items()})
    staticpipe.load(net.main, path, exe)
    assert all(np.array_equal(exe.state_dict(net.main)[n], v) for n, v in saved.items())
    assert sorted(os.listdir(tmp_path)) == ["ck"]
