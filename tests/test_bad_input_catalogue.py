"""A catalogue of bad inputs across the public API: each is refused with an error that names the culprit.

Issue 13, "Also" 2. Every row is ``Case(name, call, exc, match)``: ``call(tmp)`` (``tmp``: an empty
directory of its own) must raise ``exc`` whose message matches ``match`` (``re.search``; most are the
exact message, escaped, anchored with ``^``...``$``; a few where a path or a count varies are a fragment
that still names the argument, variable, device, file, op or stage at fault; where it names a variable
Paddle named, ``match`` is a function that looks the name up in a program). The setups are cheap and
built once per module (``functools.cache``); a call that needs a fresh program builds a small one.

Cases already in ``tests/test_misuse.py`` and ``tests/test_paddle_script.py`` are not repeated here.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import dense_layers, minimize, op_vars
from staticpipe._paddle import np, paddle
from staticpipe.io import DataLoader
from staticpipe.schedule.__main__ import main as schedule_cli

pytestmark = pytest.mark.timeout(120)

DEVICE_FORMS = '"cpu", "gpu", "gpu:k" (k = 0, 1, ...)'
KNOWN_SCHEDULES = ("F-then-B (aliases FThenB, GPipe), 1F1B, interleaved (aliases Interleaved1F1B, "
                   "interleaved-1F1B), ZB-H1, ZB-V, V-Min, V-Half, ZB-2P, Eager1F1B, DualPipeV")
SPLIT_SCHEDULES = "ZB-H1, ZB-V, V-Min, V-Half, ZB-2P, DualPipeV"


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[str], Any]  # called with an empty directory of its own
    exc: type[BaseException] | tuple[type[BaseException], ...]
    match: str | Callable[[], str]  # a regular expression (or a function giving it): re.search in str(the error)


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


# --- cheap setups, built once -------------------------------------------------------------------------
IN, M = 8, 2  # input width; micro-batches of the trained MLP


def small(guarded: bool = True, stages: int = 2, **kw):
    return build_mlp(num_stages=stages, guarded=guarded, in_dim=IN, hidden=16, depth=max(2, stages), **kw)


@functools.cache
def trained():
    """A 2-stage MLP pipelined with Momentum, 2 micro-batches; its evaluation clone (taken before minimize);
    an executor that ran the startup program and one step on 8 rows (micro-batch size 4)."""
    net = small()
    test = net.main.clone(for_test=True)
    minimize(net, paddle.optimizer.Momentum(0.1, momentum=0.9), dict(num_microbatches=M))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(8), fetch_list=[net.loss])
    return net, test, exe


def net():
    return trained()[0]


def exe():
    return trained()[2]


def batch(rows: int = 8, **changes) -> dict:
    out = net().random_batch(rows)
    out.update(changes)
    return out


@functools.cache
def compiled():
    """A pipeline whose micro-batch size 4 is compiled in (micro_batch_size=4), never run."""
    n = small()
    minimize(n, paddle.optimizer.SGD(0.1), dict(num_microbatches=M, micro_batch_size=4))
    e = staticpipe.Executor()
    e.run(n.startup)
    return n, e


@functools.cache
def forward_program():
    """An unguarded MLP before minimize (what auto_place and profile take)."""
    return small(guarded=False)


_MADE: list[str] = []  # directories made once per module, removed after it


@functools.cache
def plan_dir() -> str:
    """A plan saved by save_plan, once per module."""
    _MADE.append(tempfile.mkdtemp(prefix="catalogue-plan-"))
    directory = os.path.join(_MADE[-1], "plan")
    staticpipe.save_plan(net().main, directory, net().startup)
    return directory


@pytest.fixture(scope="module", autouse=True)
def _clean_up():
    yield
    for directory in _MADE:
        shutil.rmtree(directory, ignore_errors=True)
    if trained.cache_info().currsize:
        exe().close()
    if compiled.cache_info().currsize:
        compiled()[1].close()


def first_weight() -> str:
    """The trained MLP's first layer's weight."""
    return dense_layers(net().main)[0][0]


CYCLIC = ["gpu:0", "gpu:1", "gpu:0", "gpu:1"]  # 4 stages whose guards go back to gpu:0
V = ["gpu:0", "gpu:1", "gpu:1", "gpu:0"]  # 4 stages down and back up the 2 devices


def cyclic_cut() -> str:
    """What stage 2 (on gpu:0) reads from stage 1 in a 4-stage MLP on ``CYCLIC``: the second layer's ReLU output."""
    return op_vars(small(stages=4, stage_devices=CYCLIC).main, "relu", "Out")[1]


def fresh_minimize(schedule="1F1B", m=M, devices=None, stages=2, **options):
    """minimize a new small program with ``options`` (a failed minimize may leave the program half-built)."""
    n = small(stages=stages, stage_devices=devices)
    return minimize(n, paddle.optimizer.SGD(0.1), dict(num_microbatches=m, schedule=schedule, **options))


def opt(*args, **kw):
    return staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), *args, **kw)


def io_vars():
    """Two data variables in a program of their own, so the loaders made here feed no trained program."""
    with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
        return [paddle.static.data("x", [None, 2], "float32"), paddle.static.data("y", [None, 1], "int64")]


def gen_loader(**kw):
    return DataLoader.from_generator(feed_list=io_vars(), **kw)


def reader():
    yield from ((np.zeros(2, "float32"), np.zeros(1, "int64")) for _ in range(4))


class Pairs(paddle.io.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.full(2, i, "float32"), np.array([i], "int64")


class Stream(paddle.io.IterableDataset):
    def __iter__(self):
        return iter(Pairs()[i] for i in range(4))


def train_loader(samples: int = 16, **kw):
    """A from_generator loader of the trained MLP's feeds (iterable: never started, so no other call sees it)."""
    loader = DataLoader.from_generator(feed_list=net().feeds, iterable=True, **kw)
    return loader.set_sample_generator(net().sample_reader(samples), batch_size=4)


def own_executor(call: Callable[[staticpipe.Executor], Any]) -> Any:
    """``call`` on a started executor of the trained MLP of its own (for calls that may change its state)."""
    e = staticpipe.Executor()
    try:
        e.run(net().startup)
        return call(e)
    finally:
        e.close()


def with_env(env: dict, call: Callable[[], Any]) -> Any:
    with mock.patch.dict(os.environ, env):
        return call()


class CliExit(Exception):
    """``python -m staticpipe.schedule`` ended with an error: its exit status and what it printed."""


def cli(*argv: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            schedule_cli(list(argv))
        except SystemExit as exit_:
            raise CliExit(f"exit {exit_.code}: {err.getvalue().strip().splitlines()[-1]}") from None


def deadlocked():
    return {0: ["0F0", "0B0", "0F1", "0B1", "0OPT"], 1: ["1F1", "1B1", "1F0", "1B0", "1OPT"]}


def backward_flow():
    """A program whose stage 0 reads a value that stage 1 computes."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        with staticpipe.device_guard("gpu:0"):
            x = paddle.static.data("x", [None, 4], "float32")
            h = paddle.static.nn.fc(x, 4)
        with staticpipe.device_guard("gpu:1"):
            g = paddle.static.nn.fc(h, 4)
        with staticpipe.device_guard("gpu:0"):
            loss = paddle.mean(paddle.add(h, g))
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)


def fixed_batch_dim():
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        with staticpipe.device_guard("gpu:0"):
            x = paddle.static.data("x", [4, 8], "float32")
            h = paddle.static.nn.fc(x, 4)
        with staticpipe.device_guard("gpu:1"):
            loss = paddle.mean(paddle.static.nn.fc(h, 1))
        staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)


def unpipelined_training_program():
    """A program with backward ops but no plan (minimized by Paddle itself)."""
    n = small(guarded=False)
    minimize(n, paddle.optimizer.SGD(0.1), None)
    return n


def started_twice(tmp):
    loader = gen_loader(iterable=False)
    loader.set_sample_generator(reader, batch_size=2)
    loader.start()
    try:
        loader.start()
    finally:
        loader.reset()


def a_file(tmp, name="file"):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write("not a directory")
    return path


def a_user_directory(tmp):
    path = os.path.join(tmp, "mine")
    os.makedirs(path)
    a_file(path, "notes.txt")
    return path


def plan_with_format(tmp, version):
    directory = os.path.join(tmp, "plan")
    shutil.copytree(plan_dir(), directory)
    with open(os.path.join(directory, "plan.json")) as f:
        description = json.load(f)
    description["format"] = version
    with open(os.path.join(directory, "plan.json"), "w") as f:
        json.dump(description, f)
    return directory


CASES = [
    # --- PipelineOptimizer arguments --------------------------------------------------------------
    Case("optimizer-not-an-optimizer", lambda tmp: staticpipe.PipelineOptimizer("sgd", 2), ValueError,
         exactly("optimizer must be a paddle.optimizer.Optimizer, or one decorated by Paddle's static AMP "
                 "(paddle.static.amp.decorate, paddle.static.amp.bf16.decorate_bf16), got builtins.str")),
    Case("num_microbatches-zero", lambda tmp: opt(0), ValueError,
         exactly("num_microbatches must be an integer >= 1, got 0")),
    Case("num_microbatches-float", lambda tmp: opt(2.0), ValueError,
         exactly("num_microbatches must be an integer >= 1, got 2.0")),
    Case("num_microbatches-bool", lambda tmp: opt(True), ValueError,
         exactly("num_microbatches must be an integer >= 1, got True")),
    Case("num_microbatches-setter", lambda tmp: setattr(opt(2), "num_microbatches", -1), ValueError,
         exactly("num_microbatches must be an integer >= 1, got -1")),
    Case("schedule-unknown-name", lambda tmp: opt(2, "2F2B"), ValueError,
         exactly(f"unknown schedule '2F2B'; known schedules: {KNOWN_SCHEDULES}")),
    Case("schedule-none", lambda tmp: opt(2, None), ValueError,
         exactly(f"unknown schedule None; known schedules: {KNOWN_SCHEDULES}")),
    Case("schedule-lower-case", lambda tmp: opt(2, "1f1b"), ValueError, r"^unknown schedule '1f1b'; "),
    Case("micro_batch_size-zero", lambda tmp: opt(2, micro_batch_size=0), ValueError,
         exactly("micro_batch_size must be a positive integer or None, got 0")),
    Case("micro_batch_size-string", lambda tmp: opt(2, micro_batch_size="4"), ValueError,
         exactly("micro_batch_size must be a positive integer or None, got '4'")),
    Case("dp_degree-zero", lambda tmp: opt(2, dp_degree=0), ValueError,
         exactly("dp_degree must be an integer >= 1, got 0")),
    Case("dp_degree-float", lambda tmp: opt(2, dp_degree=1.5), ValueError,
         exactly("dp_degree must be an integer >= 1, got 1.5")),
    # --- schedule_costs ----------------------------------------------------------------------------
    Case("schedule_costs-for-1F1B", lambda tmp: opt(2, "1F1B", schedule_costs={"F": 1}), ValueError,
         exactly("schedule_costs is for the schedules that plan by measured costs (ZB-H1, ZB-V, V-Min, V-Half, "
                 "ZB-2P); schedule 1F1B does not use it")),
    Case("schedule_comm-for-1F1B", lambda tmp: opt(2, "1F1B", schedule_comm=0.5), ValueError,
         exactly("schedule_comm is for the schedules that plan by measured costs (ZB-H1, ZB-V, V-Min, V-Half, "
                 "ZB-2P); schedule 1F1B does not use it")),
    Case("schedule_comm-negative", lambda tmp: opt(2, "ZB-H1", schedule_comm=-1), ValueError,
         exactly("schedule_comm must be seconds >= 0, a mapping {(source rank, destination rank): seconds} or a "
                 "function of the two ranks, got -1")),
    Case("schedule_comm-bad-link", lambda tmp: opt(2, "ZB-V", schedule_comm={("gpu:0", "gpu:1"): 1.0}), ValueError,
         exactly("schedule_comm keys must be (source rank, destination rank) pairs, got ('gpu:0', 'gpu:1')")),
    Case("schedule_costs-unknown-kind", lambda tmp: opt(2, "ZB-H1", schedule_costs={"OPT": 1}), ValueError,
         exactly("unknown action kind 'OPT' in schedule_costs; kinds: F, B, W")),
    Case("schedule_costs-negative", lambda tmp: opt(2, "ZB-H1", schedule_costs={"W": -0.5}), ValueError,
         exactly("schedule_costs['W'] must be seconds >= 0, or a list of them (one per stage); got -0.5")),
    Case("schedule_costs-empty-list", lambda tmp: opt(2, "ZB-V", schedule_costs={"B": []}), ValueError,
         exactly("schedule_costs['B'] must be seconds >= 0, or a list of them (one per stage); got []")),
    Case("schedule_costs-not-a-mapping", lambda tmp: opt(2, "ZB-H1", schedule_costs=[1, 2]), ValueError,
         exactly("schedule_costs must be a mapping such as {'F': 1, 'B': 1, 'W': 0.5} or a function of the action, "
                 "got [1, 2]")),
    Case("schedule_costs-with-custom-schedule",
         lambda tmp: opt(1, {0: ["0F0", "0B0", "0OPT"]}, schedule_costs={"F": 1}), ValueError,
         exactly("schedule_costs plans the order of a named schedule (ZB-H1, ZB-V, V-Min, V-Half, ZB-2P); a custom "
                 "schedule gives its own order")),
    Case("schedule_costs-list-length", lambda tmp: fresh_minimize("ZB-H1", schedule_costs={"F": [1, 2, 3]}),
         ValueError, exactly("schedule_costs['F'] has 3 values for 2 stages: [1, 2, 3]")),
    # --- custom schedules: text and dict -----------------------------------------------------------
    Case("custom-text-bad-line", lambda tmp: opt(2, "rank 0: 0F0 0B0 0OPT\nstage 1: 1F0"), ValueError,
         exactly("not a schedule line: 'stage 1: 1F0' (expected 'rank <n>: <actions>')")),
    Case("custom-text-rank-twice", lambda tmp: opt(1, "rank 0: 0F0 0B0 0OPT\nrank 0: 0OPT"), ValueError,
         exactly("rank 0 has two lines")),
    Case("custom-text-without-rank-lines", lambda tmp: opt(2, "0F0 0F1 0B0 0B1 0OPT\n1F0 1B0 1F1 1B1 1OPT"),
         ValueError, exactly("the custom schedule '0F0 0F1 0B0 0B1 0OPT\\n1F0 1B0 1F1 1B1 1OPT' has no 'rank <n>:' "
                             "lines: give each rank's actions on a line of its own, 'rank <n>: <actions>' (e.g. "
                             "'rank 0: 0F0 0F1 0B0 0B1 0OPT')")),
    Case("custom-text-bad-action", lambda tmp: opt(1, "rank 0: 0F0 0X0 0OPT"), ValueError,
         exactly("not an action: '0X0' (expected e.g. 0F3, 1B0, 0W5, 0OPT, 0F3&7B1, 0SEND_F3>1, 1RECV_F3<0)")),
    Case("custom-dict-bad-action-text", lambda tmp: opt(1, {0: ["0F0", "0B0", "OPT"]}), ValueError,
         exactly("not an action: 'OPT' (expected e.g. 0F3, 1B0, 0W5, 0OPT, 0F3&7B1, 0SEND_F3>1, 1RECV_F3<0)")),
    Case("custom-dict-negative-rank", lambda tmp: opt(1, {-1: ["0F0"]}), ValueError,
         exactly("a custom schedule's keys are ranks (integers >= 0), got -1")),
    Case("custom-dict-bool-rank", lambda tmp: opt(1, {True: ["0F0"]}), ValueError,
         exactly("a custom schedule's keys are ranks (integers >= 0), got True")),
    Case("custom-missing-opt", lambda tmp: fresh_minimize(
        {0: ["0F0", "0F1", "0B0", "0B1", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1"]}), ValueError,
         exactly("stage 1 lacks its OPT")),
    Case("custom-missing-forward", lambda tmp: fresh_minimize(
        {0: ["0F0", "0B0", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1", "1OPT"]}), ValueError,
         exactly("stage 0 lacks F of micro-batch 1")),
    Case("custom-lone-w", lambda tmp: fresh_minimize(
        {0: ["0F0", "0F1", "0B0", "0B1", "0W0", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1", "1OPT"]}), ValueError,
         exactly("rank 0, step 4, action 0W0: a W action splits the backward (with none, a B runs the whole "
                 "backward), so every stage needs a W of each micro-batch after its B; stage 0 lacks W of micro-batch "
                 "1")),
    Case("custom-w-without-its-b", lambda tmp: fresh_minimize(
        {0: ["0F0", "0F1", "0W0", "0B1", "0W1", "0OPT"], 1: ["1F0", "1B0", "1W0", "1F1", "1B1", "1W1", "1OPT"]}),
         ValueError, exactly("rank 0, step 2, action 0W0: W of micro-batch 0 has no B on stage 0 (stage 0 lacks B of "
                             "micro-batch 0)")),
    # (a custom schedule is validated as written first: its errors count the steps the user wrote)
    Case("custom-backward-before-forward", lambda tmp: fresh_minimize(
        {0: ["0B0", "0F0", "0F1", "0B1", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1", "1OPT"]}), ValueError,
         r"^rank 0, step \d+, action 0B0: B of micro-batch 0 comes before its F on stage 0$"),
    Case("custom-stage-out-of-range", lambda tmp: fresh_minimize(
        {0: ["0F0", "0F1", "0B0", "0B1", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1", "1OPT", "2OPT"]}), ValueError,
         r"^rank 1, step \d+, action 2OPT: stage 2 does not exist \(stages 0\.\.1\)$"),
    Case("custom-action-twice", lambda tmp: fresh_minimize(
        {0: ["0F0", "0F1", "0F1", "0B0", "0B1", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1", "1OPT"]}), ValueError,
         r"^rank 0, step \d+, action 0F1: stage 0 runs F of micro-batch 1 twice$"),
    Case("custom-micro-batch-out-of-range", lambda tmp: fresh_minimize(
        {0: ["0F0", "0F5", "0B0", "0B1", "0OPT"], 1: ["1F0", "1B0", "1F1", "1B1", "1OPT"]}), ValueError,
         exactly("rank 0, step 1, action 0F5: micro-batch 5 does not exist (micro-batches 0..1)")),
    Case("custom-action-on-wrong-rank", lambda tmp: fresh_minimize(
        {0: ["0F0", "1F0", "0F1", "0B0", "0B1", "0OPT"], 1: ["1B0", "1F1", "1B1", "1OPT"]}), ValueError,
         exactly("rank 0, step 1, action 1F0: stage 1 is placed on rank 1, not rank 0")),
    Case("custom-deadlock", lambda tmp: fresh_minimize(deadlocked()), ValueError,
         exactly("deadlock: rank 0 at step 1 (0B0) waits for 1B0; rank 1 at step 0 (1F1) waits for 0F1")),
    # --- the program against the options (minimize) ------------------------------------------------
    Case("recompute-unknown-stage", lambda tmp: fresh_minimize(recompute=[0, 5]), ValueError,
         exactly("recompute names stages [5], but the program has stages 0..1")),
    Case("recompute-with-split-backward", lambda tmp: fresh_minimize("ZB-H1", recompute=True), ValueError,
         exactly(f"recompute is not supported with schedules that split the backward ({SPLIT_SCHEDULES}) yet")),
    Case("ZB-V-on-two-stages", lambda tmp: fresh_minimize("ZB-V"), ValueError,
         exactly("schedule ZB-V cannot run this program: it needs 4 stages on the 2 devices ['gpu:0', 'gpu:1'] in "
                 "the order ['gpu:0', 'gpu:1', 'gpu:1', 'gpu:0'], but the program's guards give 2 stages on "
                 "['gpu:0', 'gpu:1']; separate consecutive stages on one device with staticpipe.split_point()")),
    Case("V-Min-on-two-stages", lambda tmp: fresh_minimize("V-Min"), ValueError,
         exactly("schedule V-Min cannot run this program: it needs 4 stages on the 2 devices ['gpu:0', 'gpu:1'] in "
                 "the order ['gpu:0', 'gpu:1', 'gpu:1', 'gpu:0'], but the program's guards give 2 stages on "
                 "['gpu:0', 'gpu:1']; separate consecutive stages on one device with staticpipe.split_point()")),
    Case("Eager1F1B-micro-batches", lambda tmp: fresh_minimize("Eager1F1B", m=2), ValueError,
         exactly("schedule Eager1F1B needs num_microbatches >= 3 on 2 devices (2 x devices - 1: stage 0's warm-up "
                 "forwards, as Paddle's Eager1F1B pass requires); got 2")),
    Case("DualPipeV-micro-batches", lambda tmp: fresh_minimize("DualPipeV", m=3, stages=4, devices=V), ValueError,
         exactly("schedule DualPipeV needs num_microbatches >= 4 on 2 devices (2 x devices: every rank fills both "
                 "of its chunks before its first paired F&B); got 3")),
    Case("interleaved-micro-batches", lambda tmp: fresh_minimize(
        "interleaved", m=3, stages=4, devices=["gpu:0", "gpu:1", "gpu:0", "gpu:1"]), ValueError,
         exactly("interleaved 1F1B needs num_microbatches to be a multiple of the number of devices (2); got 3: "
                 "use 2 or 4")),
    Case("cyclic-guards-with-1F1B", lambda tmp: fresh_minimize("1F1B", stages=4, devices=CYCLIC), ValueError,
         lambda: rf"^op #\d+ 'mul' on stage 0 \(gpu:0\) reads variable '{re.escape(cyclic_cut())}' produced on the "
                 r"later stage 1 \(gpu:1\) by op #\d+ 'relu': forward data may only flow to later stages; move the op "
                 r"into a later device_guard or reorder the guards$"),
    Case("data-variable-fixed-batch", lambda tmp: fixed_batch_dim(), ValueError,
         exactly("data variable 'x' has shape [4, 8] with a fixed batch dimension; declare it with None as dim 0 so "
                 "it can be split into 2 micro-batches")),
    Case("forward-data-flowing-back", lambda tmp: backward_flow(), ValueError,
         r"^op #\d+ '\w+' on stage 0 \(gpu:0\) reads variable '[\w.]+' produced on the later stage 1 \(gpu:1\) by "
         r"op #\d+ '\w+': forward data may only flow to later stages"),
    # --- device_guard, parse_device, split_point ---------------------------------------------------
    Case("device_guard-cpu-index", lambda tmp: staticpipe.device_guard("cpu:1").__enter__(), ValueError,
         exactly(f"invalid device 'cpu:1': accepted forms are {DEVICE_FORMS}")),
    Case("device_guard-negative-gpu", lambda tmp: staticpipe.device_guard("gpu:-1").__enter__(), ValueError,
         exactly(f"invalid device 'gpu:-1': accepted forms are {DEVICE_FORMS}")),
    Case("device_guard-int", lambda tmp: staticpipe.device_guard(1).__enter__(), ValueError,
         exactly(f"device must be a string such as {DEVICE_FORMS}, got 1")),
    Case("parse_device-none", lambda tmp: staticpipe.parse_device(None), ValueError,
         exactly(f"device must be a string such as {DEVICE_FORMS}, got None")),
    Case("parse_device-npu", lambda tmp: staticpipe.parse_device("npu:0"), ValueError,
         exactly(f"invalid device 'npu:0': accepted forms are {DEVICE_FORMS}")),
    Case("split_point-not-a-program", lambda tmp: staticpipe.split_point("main"), (TypeError, ValueError),
         r"program.*'main'"),
    # --- Executor arguments and the device map -----------------------------------------------------
    Case("place-float", lambda tmp: staticpipe.Executor(0.5), ValueError,
         exactly("place must be a Paddle place (paddle.CPUPlace(), paddle.CUDAPlace(k)), a device string ('cpu', "
                 "'gpu', 'gpu:k') or None, got float: 0.5")),
    Case("place-bad-string", lambda tmp: staticpipe.Executor("gpu:x"), ValueError,
         exactly(f"invalid device 'gpu:x': accepted forms are {DEVICE_FORMS}")),
    Case("threads_per_stage-float", lambda tmp: staticpipe.Executor(threads_per_stage=1.5), ValueError,
         exactly("threads_per_stage must be an integer >= 1 or a dict device -> integer >= 1, got 1.5")),
    Case("threads_per_stage-bool", lambda tmp: staticpipe.Executor(threads_per_stage=True), ValueError,
         exactly("threads_per_stage must be an integer >= 1 or a dict device -> integer >= 1, got True")),
    Case("threads_per_stage-dict-zero", lambda tmp: staticpipe.Executor(threads_per_stage={"gpu:0": 0}),
         ValueError, exactly("threads_per_stage must be an integer >= 1 or a dict device -> integer >= 1, got "
                             "{'gpu:0': 0}")),
    Case("device_map-list", lambda tmp: staticpipe.Executor(device_map=[("gpu:1", "gpu:0")]), ValueError,
         exactly("device_map must be a dict {pipeline device: device}, got list")),
    Case("device_map-bad-key", lambda tmp: staticpipe.Executor(device_map={"cuda:1": "gpu:0"}), ValueError,
         exactly(f"device_map entry 'cuda:1': 'gpu:0': invalid device 'cuda:1': accepted forms are {DEVICE_FORMS}")),
    Case("STATICPIPE_DEVICE_MAP-two-equals", lambda tmp: with_env(
        {"STATICPIPE_DEVICE_MAP": "gpu:1=gpu:0=gpu:2"}, staticpipe.Executor), ValueError,
         exactly("STATICPIPE_DEVICE_MAP='gpu:1=gpu:0=gpu:2': entry 'gpu:1=gpu:0=gpu:2' is not 'device=device' "
                 "(e.g. gpu:1=gpu:0)")),
    Case("STATICPIPE_DEVICE_MAP-empty-target", lambda tmp: with_env(
        {"STATICPIPE_DEVICE_MAP": "gpu:1="}, staticpipe.Executor), ValueError,
         exactly(f"STATICPIPE_DEVICE_MAP entry 'gpu:1': '': invalid device '': accepted forms are {DEVICE_FORMS}")),
    # --- run and step: arguments and feeds ---------------------------------------------------------
    Case("run-scope", lambda tmp: exe().run(net().main, feed=batch(), scope=paddle.static.Scope()), ValueError,
         exactly("scope must be None for a pipelined program: each device keeps its own scope "
                 "(Executor.scope_of(device))")),
    Case("feed-extra-variable", lambda tmp: exe().run(net().main, feed=batch(extra=np.zeros((8, 1)))), ValueError,
         exactly("feed does not match the program's data variables: missing [], unknown ['extra']; expected "
                 "['features', 'label']")),
    Case("feed-label-float", lambda tmp: exe().run(net().main, feed=batch(label=np.zeros((8, 1), "float32"))),
         ValueError, exactly("feed variable 'label': expected dtype int64, received float32")),
    Case("feed-features-bool", lambda tmp: exe().run(net().main, feed=batch(features=np.zeros((8, IN), bool))),
         ValueError, exactly("feed variable 'features': expected dtype float32, received bool")),
    Case("feed-missing-feature-dim", lambda tmp: exe().run(net().main, feed=batch(features=np.zeros(8, "float32"))),
         ValueError, exactly(f"feed variable 'features': expected shape [-1, {IN}] (batch, ...), received shape (8,)")),
    Case("feed-scalar", lambda tmp: exe().run(net().main, feed=batch(features=np.float32(1))), ValueError,
         exactly(f"feed variable 'features': expected shape [-1, {IN}] (batch, ...), received shape ()")),
    Case("feed-ragged-list", lambda tmp: exe().run(net().main, feed=batch(features=[[1.0, 2.0], [3.0]])),
         ValueError, r"^feed variable 'features': received \[\[1\.0, 2\.0\], \[3\.0\]\], which is not an array of "
                     r"numbers \("),
    Case("feed-batch-sizes-differ", lambda tmp: exe().run(net().main, feed=batch(label=batch(6)["label"])),
         ValueError, exactly("feed variables 'features' and 'label' have different batch sizes (8 and 6)")),
    Case("feed-batch-not-divisible", lambda tmp: exe().run(net().main, feed=batch(5)), ValueError,
         exactly("batch size 5 of feed variable 'features' is not divisible by num_microbatches=2; use a batch size "
                 "that is a multiple of 2 (e.g. 4 or 6)")),
    Case("feed-batch-below-micro-batches", lambda tmp: exe().run(net().main, feed=batch(1)), ValueError,
         exactly("batch size 1 of feed variable 'features' is not divisible by num_microbatches=2; use a batch size "
                 "that is a multiple of 2 (e.g. 2)")),
    Case("feed-micro-batch-size-bound", lambda tmp: exe().run(net().main, feed=batch(12)), ValueError,
         exactly("micro-batch size 6 differs from the first step's micro-batch size 4 the plan runs; every "
                 "micro-batch must have the same size: feed micro-batches (loader batches) of 4 samples, or global "
                 "batches of 8 (num_microbatches=2)")),
    Case("feed-micro-batch-size-compiled", lambda tmp: compiled()[1].run(
        compiled()[0].main, feed=compiled()[0].random_batch(12)), ValueError,
         exactly("micro-batch size 6 differs from micro_batch_size=4 the plan runs; every micro-batch must have the "
                 "same size: feed micro-batches (loader batches) of 4 samples, or global batches of 8 "
                 "(num_microbatches=2), or build the plan with micro_batch_size=6")),
    Case("feed-string", lambda tmp: exe().run(net().main, feed="features"), ValueError,
         exactly("feed must be a dict {data variable name: array} (or a list holding one), got str")),
    Case("feed-list-of-a-non-dict", lambda tmp: exe().run(net().main, feed=[batch()["features"]]), ValueError,
         exactly("feed must be a dict {data variable name: array} (or a list holding one), got ndarray")),
    Case("feed-array", lambda tmp: exe().run(net().main, feed=batch()["features"]), ValueError,
         exactly("feed must be a dict {data variable name: array} (or a list holding one), got ndarray")),
    Case("fetch_list-int", lambda tmp: exe().run(net().main, feed=batch(), fetch_list=[0]), (TypeError, ValueError),
         exactly("fetch_list[0] must be a variable or its name, got int: 0")),
    Case("set_state_dict-wrong-shape", lambda tmp: own_executor(lambda e: e.set_state_dict(
        net().main, {first_weight(): np.zeros((3, 3), "float32")})), ValueError,
         lambda: rf"'{re.escape(first_weight())}'.*\[?\(?3, 3"),
    Case("step-count", lambda tmp: exe().step(net().main, [batch(4)] * 3), ValueError,
         exactly("a step takes num_microbatches=2 micro-batches, got 3")),
    Case("step-not-a-dict", lambda tmp: exe().step(net().main, [batch(4), [np.zeros((4, IN))]]), ValueError,
         exactly("micro-batch 1 must be a dict {data variable name: array}, got list")),
    Case("step-missing-variable", lambda tmp: exe().step(net().main, [batch(4), {"features": batch(4)["features"]}]),
         ValueError, exactly("micro-batch 1 does not match the program's data variables: missing ['label'], unknown "
                             "[]; expected ['features', 'label']")),
    Case("step-without-plan", lambda tmp: exe().step(paddle.static.Program(), [{}]), ValueError,
         exactly("step needs a program rewritten by staticpipe.PipelineOptimizer.minimize; this program has no "
                 "pipeline plan")),
    Case("run-without-feed-or-loader", lambda tmp: exe().run(net().main), ValueError,
         r"^Executor\.run has no dataset and no started loader feeds this program \("),
    Case("timeline-untraced", lambda tmp: exe().timeline(net().main), ValueError,
         exactly("no actions were recorded: create the Executor with trace=True and run a step")),
    Case("dp_degree-in-one-process", lambda tmp: (lambda n: staticpipe.Executor().run(n.startup))(
        _dp_net()), ValueError,
         exactly("dp_degree=2 runs one process per device and replica: launch 4 processes (python -m "
                 "staticpipe.launch --nprocs 4 script.py)")),
    # --- train_from_dataset, infer_from_dataset, evaluate ------------------------------------------
    Case("train-dataset-list", lambda tmp: exe().train_from_dataset(net().main, [batch()]), ValueError,
         exactly("dataset must be a staticpipe.io.DataLoader, got list (Paddle's QueueDataset / InMemoryDataset feed "
                 "the parameter-server trainers, not pipelines)")),
    Case("train-thread-negative", lambda tmp: exe().train_from_dataset(net().main, train_loader(), thread=-1),
         ValueError, exactly("thread must be an integer >= 0 (it is ignored: each stage has its own worker), got -1")),
    Case("train-print_period-zero", lambda tmp: exe().train_from_dataset(net().main, train_loader(), print_period=0),
         ValueError, exactly("print_period must be an integer >= 1, got 0")),
    Case("train-lr_step-unknown", lambda tmp: exe().train_from_dataset(net().main, train_loader(), lr_step="batch"),
         ValueError, exactly("lr_step must be None, 'step' or 'epoch', got 'batch'")),
    Case("train-lr_step-constant-rate", lambda tmp: exe().train_from_dataset(net().main, train_loader(),
                                                                           lr_step="step"), ValueError,
         exactly("lr_step='step' needs an optimizer with a paddle.optimizer.lr.LRScheduler learning rate; this "
                 "program's learning rate is constant")),
    Case("train-checkpoint_every-without-dir", lambda tmp: exe().train_from_dataset(
        net().main, train_loader(), checkpoint_every=5), ValueError,
         exactly("checkpoint_every must be an integer >= 1 and needs checkpoint_dir, got checkpoint_every=5, "
                 "checkpoint_dir=None")),
    Case("train-keep_last-zero", lambda tmp: exe().train_from_dataset(net().main, train_loader(), keep_last=0),
         ValueError, exactly("keep_last must be an integer >= 1, got 0")),
    Case("train-fetch_info-length", lambda tmp: exe().train_from_dataset(
        net().main, train_loader(), fetch_list=[net().loss], fetch_info=["loss", "acc"]), ValueError,
         exactly("fetch_info has 2 names for 1 fetch_list entries")),
    Case("infer-scope", lambda tmp: exe().infer_from_dataset(net().main, train_loader(), scope=paddle.static.Scope()),
         ValueError, exactly("scope must be None: staticpipe keeps one scope per device (Executor.scope_of(device))")),
    Case("infer-dataset-int", lambda tmp: exe().infer_from_dataset(net().main, 42), ValueError,
         r"^dataset must be a staticpipe\.io\.DataLoader, got int "),
    Case("evaluate-training-program", lambda tmp: exe().evaluate(
        unpipelined_training_program().main, train_loader(), [net().loss]), ValueError,
         exactly("an evaluation program must hold forward ops only: take main_program.clone(for_test=True) before "
                 "minimize")),
    Case("evaluate-empty-data", lambda tmp: exe().evaluate(trained()[1], train_loader(samples=0), [net().loss],
                                                           like=net().main), ValueError,
         exactly("the evaluation data set gave no batch")),
    # --- DataLoader.from_generator, the Dataset constructor, set_*_generator, start/next ---------------
    Case("from_generator-no-feed_list", lambda tmp: DataLoader.from_generator(), ValueError,
         exactly("feed_list is required in static mode: pass the paddle.static.data variables the loader feeds, e.g. "
                 "feed_list=[image, label]")),
    Case("from_generator-empty-feed_list", lambda tmp: DataLoader.from_generator(feed_list=[]), ValueError,
         exactly("feed_list must be a non-empty list of paddle.static.data variables, got []")),
    Case("from_generator-feed_list-names", lambda tmp: DataLoader.from_generator(feed_list=["x", "y"]), ValueError,
         exactly("feed_list entries must be paddle.static.data variables, got str: 'x'")),
    Case("from_generator-feed_list-twice", lambda tmp: DataLoader.from_generator(feed_list=io_vars()[:1] * 2),
         ValueError, exactly("feed_list names a variable twice: ['x', 'x']")),
    Case("from_generator-capacity-zero", lambda tmp: gen_loader(capacity=0), ValueError,
         exactly("capacity must be a positive integer (batches prefetched), got 0")),
    Case("set_sample_generator-batch_size-zero", lambda tmp: gen_loader().set_sample_generator(reader, 0),
         ValueError, exactly("batch_size must be a positive integer, got 0")),
    Case("set_sample_list_generator-not-callable", lambda tmp: gen_loader().set_sample_list_generator("reader"),
         TypeError, exactly("set_sample_list_generator: reader must be a callable returning an iterator (e.g. a "
                            "generator function), got 'reader'")),
    Case("set_batch_generator-on-a-dataset-loader", lambda tmp: DataLoader(
        Pairs(), feed_list=io_vars()).set_batch_generator(reader), RuntimeError,
         exactly("set_batch_generator is for loaders made by DataLoader.from_generator; this loader reads its "
                 "dataset (Pairs)")),
    Case("loader-start-iterable", lambda tmp: gen_loader().set_sample_generator(reader, 2).start(), RuntimeError,
         exactly("start() is for non-iterable loaders (iterable=False); iterate this loader instead")),
    Case("loader-start-without-source", lambda tmp: gen_loader(iterable=False).start(), RuntimeError,
         exactly("DataLoader has no data source: call set_sample_generator, set_sample_list_generator or "
                 "set_batch_generator first")),
    Case("loader-next_batch-before-start", lambda tmp: gen_loader(iterable=False).set_sample_generator(
        reader, 2).next_batch(), RuntimeError,
         exactly("DataLoader is not started: call loader.start() before training (non-iterable mode)")),
    Case("loader-started-twice", started_twice, RuntimeError,
         exactly("DataLoader is already started: call loader.reset() before loader.start() again")),
    Case("loader-len-of-generator", lambda tmp: len(gen_loader()), TypeError,
         exactly("a DataLoader.from_generator loader has no len(): its generator decides the epoch")),
    Case("dataset-not-a-dataset", lambda tmp: DataLoader(5, feed_list=io_vars()), TypeError,
         exactly("dataset must be a paddle.io.Dataset (__getitem__ and __len__) or a paddle.io.IterableDataset, got "
                 "int")),
    Case("dataset-batch_size-none", lambda tmp: DataLoader(Pairs(), feed_list=io_vars(), batch_size=None),
         ValueError, exactly("batch_size=None (the dataset yields whole batches) is not supported: give a batch_size, "
                             "or a batch generator through DataLoader.from_generator(...).set_batch_generator")),
    Case("dataset-batch_sampler-and-batch_size", lambda tmp: DataLoader(
        Pairs(), feed_list=io_vars(), batch_sampler=[[0, 1], [2, 3]], batch_size=2), ValueError,
         exactly("batch_sampler is given, so batch_size, shuffle and drop_last must keep their defaults (1, False, "
                 "False), got batch_size=2, shuffle=False, drop_last=False: the batch sampler decides them")),
    Case("dataset-collate_fn-not-callable", lambda tmp: DataLoader(Pairs(), feed_list=io_vars(), collate_fn=3),
         TypeError, exactly("collate_fn must be callable (list of samples -> batch), got 3")),
    Case("dataset-worker_init_fn-not-callable", lambda tmp: DataLoader(
        Pairs(), feed_list=io_vars(), worker_init_fn="seed"), TypeError,
         exactly("worker_init_fn must be callable (worker id -> None), got 'seed'")),
    Case("dataset-prefetch_factor-zero", lambda tmp: DataLoader(Pairs(), feed_list=io_vars(), prefetch_factor=0),
         ValueError, exactly("prefetch_factor must be an integer >= 1, got 0")),
    Case("iterable-dataset-workers", lambda tmp: DataLoader(Stream(), feed_list=io_vars(), num_workers=2),
         ValueError, exactly("num_workers=2 with a paddle.io.IterableDataset: every worker process would replay the "
                             "whole dataset (staticpipe does not shard it by worker); use num_workers=0")),
    Case("iterable-dataset-shuffle", lambda tmp: DataLoader(Stream(), feed_list=io_vars(), shuffle=True),
         ValueError, exactly("shuffle=True with a paddle.io.IterableDataset: it has no indices to shuffle (Paddle "
                             "refuses it too)")),
    # --- save, load, save_plan, load_plan, export_inference ------------------------------------------
    Case("load-missing", lambda tmp: staticpipe.load(net().main, os.path.join(tmp, "nope"), exe()),
         FileNotFoundError, r"^no checkpoint at '[^']*/nope'$"),
    Case("load-a-file", lambda tmp: staticpipe.load(net().main, a_file(tmp), exe()), FileNotFoundError,
         r"^no checkpoint at '[^']*/file': it is a file, a checkpoint is a directory$"),
    Case("save-onto-a-file", lambda tmp: staticpipe.save(net().main, a_file(tmp), exe()), NotADirectoryError,
         r"^cannot save a checkpoint to '[^']*/file': it is a file, and a checkpoint is a directory\. Nothing was "
         r"changed$"),
    Case("save-onto-a-user-directory", lambda tmp: staticpipe.save(net().main, a_user_directory(tmp), exe()),
         ValueError, r"^cannot save a checkpoint to '[^']*/mine': the directory holds no meta\.json, so it is not a "
                     r"checkpoint staticpipe wrote"),
    Case("save-step-not-a-number", lambda tmp: staticpipe.save(net().main, os.path.join(tmp, "ckpt"), exe(),
                                                                step="last"), ValueError, r"step.*'last'"),
    Case("export_inference-unknown-feed", lambda tmp: staticpipe.export_inference(
        net().main, ["nope"], [net().outputs["logits"]], os.path.join(tmp, "model"), exe()), ValueError,
         r"\bnope\b"),
    Case("save_plan-without-plan", lambda tmp: staticpipe.save_plan(paddle.static.Program(), tmp), ValueError,
         exactly("save_plan needs a program rewritten by staticpipe.PipelineOptimizer.minimize; this program has no "
                 "pipeline plan")),
    Case("save_plan-wrong-startup", lambda tmp: staticpipe.save_plan(net().main, tmp, paddle.static.Program()),
         ValueError, exactly("startup_program is not the startup program of this plan: pass the startup program "
                             "given to minimize")),
    Case("save_plan-onto-a-file", lambda tmp: staticpipe.save_plan(net().main, a_file(tmp), net().startup),
         NotADirectoryError, r"^cannot save a saved plan to '[^']*/file': it is a file"),
    Case("load_plan-missing", lambda tmp: staticpipe.load_plan(os.path.join(tmp, "nope")), FileNotFoundError,
         r"^no saved plan at '[^']*/nope': the directory does not exist$"),
    Case("load_plan-no-plan-json", lambda tmp: staticpipe.load_plan(tmp), FileNotFoundError,
         r"^'[^']*/plan\.json' does not exist: it holds the plan written by staticpipe\.save_plan$"),
    Case("load_plan-unknown-stage", lambda tmp: staticpipe.load_plan(plan_dir(), stages=[0, 7]), ValueError,
         r"^load_plan: stages=\[0, 7\] names \[7\], but '[^']*/plan\.json' has stages 0\.\.1$"),
    Case("load_plan-format", lambda tmp: staticpipe.load_plan(plan_with_format(tmp, 99)), ValueError,
         r"^'[^']*/plan\.json' has plan format 99; this staticpipe reads format \d+$"),
    # --- verify ------------------------------------------------------------------------------------
    Case("verify-steps-zero", lambda tmp: staticpipe.verify(net().main, [batch()], net().startup, steps=0),
         ValueError, exactly("steps must be an integer >= 1, got 0")),
    Case("verify-too-few-batches", lambda tmp: staticpipe.verify(net().main, [batch()], net().startup, steps=2),
         ValueError, exactly("the loader gave batches for 1 step(s); verify was asked for 2 steps")),
    Case("verify-without-plan", lambda tmp: staticpipe.verify(paddle.static.Program(), [batch()], net().startup),
         ValueError, exactly("verify needs a program rewritten by staticpipe.PipelineOptimizer.minimize; this program "
                             "has no pipeline plan")),
    Case("verify-executor-not-an-executor", lambda tmp: staticpipe.verify(net().main, [batch()], net().startup,
                                                                           steps=1, executor="exe"),
         (TypeError, ValueError), r"executor.*'exe'"),
    # --- auto_place and profile --------------------------------------------------------------------
    Case("auto_place-policy", lambda tmp: staticpipe.auto_place(forward_program().main, 2, policy="fastest"),
         ValueError, exactly("unknown policy 'fastest'; policies: uniform, params, time, memory")),
    Case("auto_place-after-minimize", lambda tmp: staticpipe.auto_place(
        unpipelined_training_program().main, 2, policy="uniform"), ValueError,
         r"^auto_place runs before minimize, but op #\d+ '\w+' is a \w+ op; call auto_place on the forward program, "
         r"then PipelineOptimizer\.minimize$"),
    Case("auto_place-num_stages-zero", lambda tmp: staticpipe.auto_place(forward_program().main, 0, policy="uniform"),
         ValueError, exactly("num_stages must be an integer >= 1, got 0")),
    Case("auto_place-no-stages", lambda tmp: staticpipe.auto_place(forward_program().main, policy="uniform"),
         ValueError, exactly("pass num_stages or devices (or split points, which then set the stages)")),
    Case("auto_place-devices-empty", lambda tmp: staticpipe.auto_place(forward_program().main, devices=[],
                                                                      policy="uniform"), ValueError,
         exactly("devices is empty: name one device per stage")),
    Case("auto_place-devices-count", lambda tmp: staticpipe.auto_place(
        forward_program().main, 3, devices=["gpu:0", "gpu:1"], policy="uniform"), ValueError,
         exactly("num_stages=3 but devices names 2 devices: ['gpu:0', 'gpu:1']")),
    Case("auto_place-bad-device", lambda tmp: staticpipe.auto_place(
        forward_program().main, devices=["gpu:0", "tpu:1"], policy="uniform"), ValueError,
         exactly(f"invalid device 'tpu:1': accepted forms are {DEVICE_FORMS}")),
    Case("auto_place-too-many-stages", lambda tmp: staticpipe.auto_place(forward_program().main, 64,
                                                                        policy="uniform"), ValueError,
         r"^64 stages need at least 64 layers, but the program has \d+$"),
    Case("auto_place-memory-without-limit", lambda tmp: staticpipe.auto_place(forward_program().main, 2,
                                                                             policy="memory"), ValueError,
         exactly("policy 'memory' needs memory_limit= (bytes per device)")),
    Case("auto_place-memory-limit-negative", lambda tmp: staticpipe.auto_place(
        forward_program().main, 2, policy="memory", memory_limit="-1GB"), ValueError,
         exactly("memory_limit='-1GB' is negative: a memory cap must be a positive, finite number of bytes (None for "
                 "no cap)")),
    Case("auto_place-memory-limit-not-a-size", lambda tmp: staticpipe.auto_place(
        forward_program().main, 2, policy="memory", memory_limit="1 gig"), ValueError,
         exactly("memory_limit='1 gig' is not a size: give bytes (a number) or a size such as '8GB' or '512MiB' "
                 "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")),
    Case("auto_place-time-without-profile", lambda tmp: staticpipe.auto_place(forward_program().main, 2,
                                                                             policy="time"), ValueError,
         exactly("policy 'time' needs measured times: pass profile= (staticpipe.profile(...)) or feed=")),
    Case("auto_place-split-point-unknown", lambda tmp: staticpipe.auto_place(
        forward_program().main, 2, policy="uniform", split_points=["nope"]), ValueError,
         exactly("split point 'nope' is not a variable of the program")),
    Case("auto_place-split-point-data", lambda tmp: staticpipe.auto_place(
        forward_program().main, 2, policy="uniform", split_points=["features"]), ValueError,
         exactly("split point 'features' is produced by no op (a data variable or a parameter); name an op's output to "
                 "cut after that op")),
    Case("auto_place-schedule", lambda tmp: staticpipe.auto_place(forward_program().main, 2, policy="uniform",
                                                                 schedule="zb-h1"), ValueError,
         r"^unknown schedule 'zb-h1'; known schedules: "),
    Case("profile-repeat-zero", lambda tmp: staticpipe.profile(forward_program().main, batch(4), repeat=0),
         ValueError, exactly("repeat must be an integer >= 1, got 0")),
    Case("profile-empty-feed", lambda tmp: staticpipe.profile(forward_program().main, {}), ValueError,
         exactly("feed is empty: give one batch as {data variable name: array}")),
    Case("profile-feed-list", lambda tmp: staticpipe.profile(forward_program().main, [batch(4)]), ValueError,
         exactly("feed must be a dict of arrays or a staticpipe.io.DataLoader, got list")),
    Case("profile-unknown-loss", lambda tmp: staticpipe.profile(forward_program().main, batch(4), loss="nope"),
         ValueError, exactly("loss 'nope' is not a variable of the program")),
    # --- python -m staticpipe.schedule -------------------------------------------------------------
    Case("cli-unknown-schedule", lambda tmp: cli("--schedule", "Zero", "--stages", "2", "--microbatches", "4"),
         CliExit, exactly(f"exit 2: python -m staticpipe.schedule: error: unknown schedule 'Zero'; known schedules: "
                          f"{KNOWN_SCHEDULES}")),
    Case("cli-missing-stages", lambda tmp: cli("--microbatches", "4"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: the following arguments are required: --stages")),
    Case("cli-stages-not-a-number", lambda tmp: cli("--stages", "two", "--microbatches", "4"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: argument --stages: invalid int value: 'two'")),
    Case("cli-stages-zero", lambda tmp: cli("--stages", "0", "--microbatches", "4"), CliExit,
         r"^exit 2: python -m staticpipe\.schedule: error: .*--stages"),
    Case("cli-microbatches-zero", lambda tmp: cli("--stages", "2", "--microbatches", "0"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: --microbatches must be >= 1, got 0")),
    Case("cli-costs-syntax", lambda tmp: cli("--stages", "2", "--microbatches", "4", "--costs", "F:1"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: argument --costs: costs must look like F=1,B=2; got "
                 "'F:1'")),
    Case("cli-costs-kind", lambda tmp: cli("--stages", "2", "--microbatches", "4", "--costs", "F=1,X=2"), CliExit,
         r"^exit 2: python -m staticpipe\.schedule: error: unknown action kind 'X' in costs; kinds: "),
    Case("cli-interleaved-micro-batches", lambda tmp: cli("--schedule", "interleaved", "--stages", "2",
                                                          "--microbatches", "3"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: interleaved 1F1B needs num_microbatches to be a "
                 "multiple of the number of devices (2); got 3: use 2 or 4")),
    Case("cli-DualPipeV-chunks", lambda tmp: cli("--schedule", "DualPipeV", "--stages", "2", "--microbatches",
                                                 "4", "--chunks", "1"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: schedule DualPipeV needs 2 chunks per device (stages = "
                 "2 x devices); the program has 2 stages on 2 devices")),
    Case("cli-V-Half-chunks", lambda tmp: cli("--schedule", "V-Half", "--stages", "3", "--microbatches", "4",
                                              "--chunks", "3"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: schedule V-Half needs 2 chunks per device (stages = "
                 "2 x devices); the program has 9 stages on 3 devices")),
    Case("cli-Eager1F1B-micro-batches", lambda tmp: cli("--schedule", "Eager1F1B", "--stages", "4",
                                                        "--microbatches", "6"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: schedule Eager1F1B needs num_microbatches >= 7 on 4 "
                 "devices (2 x devices - 1: stage 0's warm-up forwards, as Paddle's Eager1F1B pass requires); got 6")),
    Case("cli-DualPipeV-micro-batches", lambda tmp: cli("--schedule", "DualPipeV", "--stages", "3",
                                                        "--microbatches", "5"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: schedule DualPipeV needs num_microbatches >= 6 on 3 "
                 "devices (2 x devices: every rank fills both of its chunks before its first paired F&B); got 5")),
    Case("cli-ZB-V-chunks", lambda tmp: cli("--schedule", "ZB-V", "--stages", "2", "--microbatches", "4",
                                            "--chunks", "3"), CliExit,
         exactly("exit 2: python -m staticpipe.schedule: error: schedule ZB-V needs 2 chunks per device (stages = 2 x "
                 "devices); the program has 6 stages on 2 devices")),
]


def _dp_net():
    n = small()
    minimize(n, paddle.optimizer.SGD(0.1), dict(num_microbatches=M, dp_degree=2))
    return n


def _params():
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    return [pytest.param(c, id=c.name) for c in CASES]


@pytest.mark.parametrize("case", _params())
def test_a_bad_input_is_refused_naming_the_culprit(case, tmp_path):
    with pytest.raises(case.exc, match=case.match() if callable(case.match) else case.match):
        case.call(str(tmp_path))


def test_a_refused_minimize_leaves_the_program_as_it_was():
    n = small()
    ops = len(n.main.global_block().ops)
    with pytest.raises(ValueError, match=r"^schedule ZB-V cannot run this program"):
        minimize(n, paddle.optimizer.SGD(0.1), dict(num_microbatches=M, schedule="ZB-V"))
    assert len(n.main.global_block().ops) == ops


def test_fetch_list_may_be_one_variable_or_name_as_in_paddle():
    def fetched(fetch):
        try:
            return own_executor(lambda e: e.run(net().main, feed=batch(), fetch_list=fetch))
        except ValueError as err:
            return err
    want = fetched([net().loss])
    for fetch in (net().loss, net().loss.name):
        got = fetched(fetch)
        assert isinstance(got, list) and len(got) == 1 and np.array_equal(got[0], want[0]), (fetch, got)


def test_the_schedule_command_line_exits_with_the_error():
    """One case through the real ``python -m staticpipe.schedule`` (the others call its ``main`` in-process)."""
    result = subprocess.run([sys.executable, "-m", "staticpipe.schedule", "--schedule", "ZB-V", "--stages", "2",
                             "--microbatches", "4", "--chunks", "3"], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "python -m staticpipe.schedule: error: schedule ZB-V needs 2 chunks per device (stages = 2 x devices); "
        "the program has 6 stages on 2 devices")
    assert result.stdout == ""
