"""staticpipe.capabilities: whether CPU stages can run bfloat16 is probed once, and a bf16 program on a
CPU that cannot is refused before anything changes (at minimize) or runs (at its first run).

The refusal tests force the probe's answer to "no", so they check the refusal on every machine; the
probe itself is checked against ``ONEDNN_MAX_CPU_ISA=AVX2``, which caps oneDNN below bfloat16 on any CPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import staticpipe
from models import build_mlp
from pipeline_util import minimize
from staticpipe import capabilities
from staticpipe._paddle import PADDLE_MAJOR, paddle
from staticpipe.capabilities import bf16_numbers
from staticpipe.capabilities.bf16_numbers import Measured

REASON = "could not create a primitive descriptor for a matmul primitive"


@pytest.fixture
def no_bf16(monkeypatch):
    """The probe's answer forced to "no", as on an AVX2-only CPU."""
    monkeypatch.setattr(capabilities, "_probed", {True: capabilities.Bf16Support(False, REASON),
                                                   False: capabilities.Bf16Support(False, REASON)})


def refusal(device: str, what: str) -> str:
    flags = ", ".join(capabilities.cpu_flags()) or "none of " + ", ".join(capabilities.FLAGS)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (f"device {device!r} runs on the CPU, which cannot run {what} here: Paddle's oneDNN has no bfloat16 "
            f"matmul on this CPU ({capabilities.cpu_model()}; flags: {flags}"
            f"{'; ONEDNN_MAX_CPU_ISA=' + cap if cap else ''}), probe: {REASON!r}. bfloat16 on CPU needs AVX-512 "
            "or AMX. Train in float32, or with float16 loss scaling (paddle.static.amp.decorate(optimizer), O1: "
            "the scaling runs, in float32 on CPU), or put this stage on a GPU")


def ops_of(program) -> list[tuple]:
    return [(op.type, tuple(op.input_arg_names), tuple(op.output_arg_names)) for op in program.global_block().ops]


def test_the_probe_runs_once_per_process_and_ir(monkeypatch):
    calls = []
    monkeypatch.setattr(capabilities, "_probed", {})
    real = capabilities._probe
    monkeypatch.setattr(capabilities, "_probe", lambda pir: calls.append(pir) or real(pir))
    first = capabilities.cpu_bf16()
    assert capabilities.cpu_bf16() is first
    assert calls == [False]  # the suite builds legacy programs (conftest)


def test_the_probe_sees_onednn_capped_below_bfloat16():
    """ONEDNN_MAX_CPU_ISA=AVX2 makes any CPU an AVX2-only one for oneDNN: the probe must say no, with
    oneDNN's reason, and the command line prints it (as CI does first)."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-m", "staticpipe.capabilities"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(f"CPU: {capabilities.cpu_model()}, {os.cpu_count()} cores, flags: ")
    assert ", ONEDNN_MAX_CPU_ISA=AVX2; Paddle " in line
    assert "bfloat16 on CPU does not run (" in line, line
    assert "RuntimeWarning" not in out.stderr, out.stderr[-2000:]


def test_the_command_line_runs_as_a_package_main_without_runpy_warning(monkeypatch):
    """``python -m staticpipe.capabilities`` as .ci/run calls it: staticpipe imports capabilities first, so a
    module run as __main__ drew runpy's RuntimeWarning about sys.modules; the package's __main__ does not."""
    monkeypatch.delenv(capabilities.WRONG_BF16_ENV)  # the suite's opt-in would show in the line
    out = subprocess.run([sys.executable, "-W", "always", "-m", "staticpipe.capabilities"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RuntimeWarning" not in out.stderr, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == capabilities.describe()  # this process's probe, the same IR


def test_a_bf16_program_on_a_cpu_without_bf16_is_refused_at_minimize_before_it_changes(no_bf16):
    net = build_mlp(num_stages=2, hidden=16, in_dim=8)
    before = ops_of(net.main), ops_of(net.startup)
    with pytest.raises(ValueError) as err:
        minimize(net, paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.SGD(0.1)), dict(num_microbatches=2))
    assert str(err.value) == refusal("gpu:0", "a bfloat16 AMP program (its white-list ops cast to bfloat16)")
    assert (ops_of(net.main), ops_of(net.startup)) == before
    assert staticpipe.plan_of(net.main) is None


def test_a_value_the_user_made_bfloat16_names_its_op_and_device(no_bf16):
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        with staticpipe.device_guard("gpu:0"):
            x = paddle.static.data("x", [-1, 4], "float32")
            h = paddle.static.nn.fc(x, 4)
        with staticpipe.device_guard("gpu:1"):
            low = paddle.cast(h, "bfloat16")
            w = paddle.cast(paddle.static.create_parameter([4, 4], "float32"), "bfloat16")
            product = paddle.cast(low, "float32")  # a cast of bfloat16 runs anywhere: not refused alone
            low_mul = main.global_block().create_var(name="low_mul", dtype=low.dtype, shape=[-1, 4])
            main.global_block().append_op(type="mul", inputs={"X": [low], "Y": [w]}, outputs={"Out": [low_mul]})
            loss = paddle.mean(paddle.cast(low_mul, "float32") + product)
        before = ops_of(main)
        with pytest.raises(ValueError) as err:
            staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
    assert str(err.value) == refusal("gpu:1", f"op 'mul' on the bfloat16 value {low.name!r}")
    assert ops_of(main) == before


@pytest.mark.parametrize("amp", ["fp32", "fp16"])
def test_programs_without_bfloat16_are_not_refused(no_bf16, amp):
    net = build_mlp(num_stages=2, hidden=16, in_dim=8)
    opt = paddle.optimizer.SGD(0.1)
    minimize(net, paddle.static.amp.decorate(opt) if amp == "fp16" else opt, dict(num_microbatches=2))
    exe = staticpipe.Executor()
    exe.run(net.startup)
    exe.run(net.main, feed=net.random_batch(4))
    exe.close()


def test_a_plan_built_where_bf16_runs_is_refused_at_its_first_run_where_it_does_not(bf16_kernels_assumed,
                                                                                      monkeypatch):
    """A plan built on a machine with bfloat16 kernels (or saved there) and run on one without: refused by
    the executor before the startup program runs or a step starts, naming the stage's device."""
    net = build_mlp(num_stages=2, hidden=16, in_dim=8)
    minimize(net, paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.SGD(0.1)), dict(num_microbatches=2))
    monkeypatch.setattr(capabilities, "_probed", {False: capabilities.Bf16Support(False, REASON)})
    exe = staticpipe.Executor()
    with pytest.raises(ValueError) as err:
        exe.run(net.startup)
    found = capabilities.bf16_kernel_op(staticpipe.plan_of(net.main).stages[0].sections["forward"].program)
    assert found[1].startswith("op 'mul'")  # the first fc's matmul (marked by decorate_bf16 on Paddle 2.6)
    what = f"stage 0's {found[1]}"
    assert str(err.value) == refusal("gpu:0", what)
    assert exe._devices.workers == {}  # nothing was placed
    with pytest.raises(ValueError) as err:
        exe.run(net.main, feed=net.random_batch(4))
    assert str(err.value) == refusal("gpu:0", what)
    exe.close()


@pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")
def test_a_pir_program_with_a_bfloat16_value_is_refused_at_minimize(no_bf16):
    with paddle.pir_utils.IrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            with staticpipe.device_guard("gpu:0"):
                x = paddle.static.data("x", [-1, 4], "float32")
                h = paddle.static.nn.fc(x, 4)
            with staticpipe.device_guard("gpu:1"):
                low = paddle.cast(h, "bfloat16")
                loss = paddle.mean(paddle.cast(paddle.matmul(low, low, transpose_y=True), "float32"))
            count = len(main.global_block().ops)
            with pytest.raises(ValueError) as err:
                staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
        assert str(err.value) == refusal("gpu:1", "op 'pd_op.matmul' on bfloat16 values")
        assert len(main.global_block().ops) == count


def test_the_pir_backward_probe_runs_apart_and_tells_a_crash_from_a_step(monkeypatch):
    """Paddle 3.3.1's PIR bfloat16 matmul backward on CPU dies by SIGSEGV (single device, no staticpipe),
    which no handler survives: the probe trains its one step in a process of its own and reads how it ended."""
    monkeypatch.setattr(capabilities, "_PIR_BACKWARD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    crashed = capabilities._probe_pir_backward()
    assert (crashed.ok, crashed.backward_crashes) == (False, True)
    assert crashed.reason == "one training step of a bfloat16 matmul on PIR ended the process (signal 11)"
    monkeypatch.setattr(capabilities, "_PIR_BACKWARD", "print('a step')")
    assert capabilities._probe_pir_backward() == capabilities.Bf16Support(True)


@pytest.mark.skipif(PADDLE_MAJOR < 3, reason="PIR is Paddle 3's program IR")
def test_a_pir_auto_cast_program_whose_backward_crashes_here_is_refused_at_minimize(monkeypatch):
    """Paddle 3's own PIR AMP route (``paddle.amp.auto_cast``) in a pipeline, where the probe found the
    backward crashing: refused before the program changes, naming the device, the op and what to do."""
    reason = "one training step of a bfloat16 matmul on PIR ended the process (signal 11)"
    monkeypatch.setattr(capabilities, "_probed", {True: capabilities.Bf16Support(False, reason, True)})
    with paddle.pir_utils.IrGuard():
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [-1, 8], "float32")
            with paddle.amp.auto_cast(level="O1", dtype="bfloat16"):
                with staticpipe.device_guard("gpu:0"):
                    h = paddle.nn.functional.relu(paddle.nn.Linear(8, 8)(x))
                with staticpipe.device_guard("gpu:1"):
                    out = paddle.nn.Linear(8, 2)(h)
            with staticpipe.device_guard("gpu:1"):
                loss = paddle.mean(paddle.cast(out, "float32"))
            count = len(main.global_block().ops)
            with pytest.raises(ValueError) as err:
                staticpipe.PipelineOptimizer(paddle.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
        assert str(err.value) == (
            "device 'gpu:0' runs on the CPU, which cannot train op 'pd_op.matmul' on bfloat16 values here: Paddle's "
            f"PIR bfloat16 matmul backward kills the process on this CPU ({capabilities.cpu_model()}), probe: "
            f"{reason!r}. Train in float32, build the program in the legacy IR for bfloat16 on CPU "
            "(staticpipe.use_legacy_ir() before building, or STATICPIPE_LEGACY_IR=1; README \"PIR programs\"), or "
            "put this stage on a GPU")
        assert len(main.global_block().ops) == count


# What Paddle 2.6.2 measured here (Intel Xeon, avx512_bf16, legacy IR): the figures the wrong-path tests feed
REDUCTION = "could not create a primitive descriptor for a reduction primitive descriptor"
MEASURED = [Measured("the step", 1, raised=REDUCTION),
            Measured("fc output [4, 4]", 4, 0.0004), Measured("bias gradient [4]", 4, 0.929),
            Measured("weight gradient [8, 32]", 32, 0.002), Measured("bias gradient [32]", 32, 1.302)]
WRONG = ("the step at batch 1 raised 'could not create a primitive descriptor for a reduction primitive descriptor'; "
         "bias gradient [4] at batch 4: 92.9% off float32; bias gradient [32] at batch 32: 130.2% off float32")


def wrong_refusal(device: str, what: str, wrong: str = WRONG) -> str:
    return (f"device {device!r} runs on the CPU, where Paddle runs {what} but computes it wrong: on this CPU "
            f"({capabilities.cpu_model()}) Paddle {paddle.__version__}'s bfloat16 step is off float32 by more than "
            f"bfloat16's precision (1.56%): {wrong}. Train in float32, or put this stage on a GPU, or set "
            "STATICPIPE_ALLOW_WRONG_BF16=1 to train with Paddle's numbers as they are")


@pytest.fixture
def wrong_bf16(monkeypatch):
    """The probe's measurement replaced by the figures above; the verdict is the probe's own."""
    monkeypatch.setattr(bf16_numbers, "measure", lambda: list(MEASURED))
    monkeypatch.delenv(capabilities.WRONG_BF16_ENV, raising=False)
    monkeypatch.setattr(capabilities, "_probed", {False: capabilities._probe_numbers()})


def test_bfloat16_that_runs_wrong_is_reported_with_its_figures(wrong_bf16, monkeypatch):
    assert capabilities.cpu_bf16() == capabilities.Bf16Support(True, wrong=WRONG)
    assert not capabilities.cpu_bf16().right
    assert capabilities.describe().endswith(f"(legacy IR): bfloat16 on CPU runs but is wrong here ({WRONG})")
    monkeypatch.setenv(capabilities.WRONG_BF16_ENV, "1")
    assert capabilities.describe().endswith(
        f"bfloat16 on CPU runs but is wrong here ({WRONG}, trained as STATICPIPE_ALLOW_WRONG_BF16=1 allows)")


def test_right_figures_make_a_right_answer(monkeypatch):
    monkeypatch.setattr(bf16_numbers, "measure", lambda: [m for m in MEASURED if m.error and m.error < 0.01])
    assert capabilities._probe_numbers() == capabilities.Bf16Support(True)
    assert capabilities._probe_numbers().right


@pytest.mark.skipif(not capabilities.cpu_bf16().ok, reason="the matmul probe decides first where bf16 has no kernel")
def test_the_probe_checks_the_numbers_where_the_matmul_runs(monkeypatch):
    monkeypatch.setattr(bf16_numbers, "measure", lambda: list(MEASURED))
    assert capabilities._probe(False) == capabilities.Bf16Support(True, wrong=WRONG)


def test_bfloat16_that_runs_wrong_is_refused_at_minimize_and_at_first_run_unless_allowed(wrong_bf16, monkeypatch):
    what = "a bfloat16 AMP program (its white-list ops cast to bfloat16)"
    net = build_mlp(num_stages=2, hidden=16, in_dim=8)
    before = ops_of(net.main), ops_of(net.startup)
    with pytest.raises(ValueError) as err:
        minimize(net, paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.SGD(0.1)), dict(num_microbatches=2))
    assert str(err.value) == wrong_refusal("gpu:0", what)
    assert (ops_of(net.main), ops_of(net.startup)) == before
    monkeypatch.setenv(capabilities.WRONG_BF16_ENV, "1")  # the opt-in: built ...
    minimize(net, paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.SGD(0.1)), dict(num_microbatches=2))
    monkeypatch.delenv(capabilities.WRONG_BF16_ENV)  # ... and run where it is not set: refused before it runs
    exe = staticpipe.Executor()
    with pytest.raises(ValueError) as err:
        exe.run(net.startup)
    found = capabilities.bf16_kernel_op(staticpipe.plan_of(net.main).stages[0].sections["forward"].program)
    assert str(err.value) == wrong_refusal("gpu:0", f"stage 0's {found[1]}")
    assert exe._devices.workers == {}
    exe.close()


@pytest.mark.skipif(not capabilities.cpu_bf16().ok, reason="this CPU has no bfloat16 matmul to measure")
def test_the_measurement_is_cheap_and_its_float32_reference_is_right():
    """On the measured machines Paddle's bfloat16 gets outputs, input and weight gradients right (within
    bfloat16's precision): the reference is right, and only the bias gradient (or a raising step) is flagged."""
    start = time.perf_counter()
    found = bf16_numbers.measure()
    assert time.perf_counter() - start < 2.0
    assert {m.batch for m in found} == set(bf16_numbers.BATCHES)
    for m in found:
        assert m.right or m.quantity.startswith(("bias gradient", "the step")), m
        assert m.error is None or m.error < 1e-2 or m.error > 0.5, m  # right is bf16-close, wrong is far off


@pytest.mark.skipif(not capabilities.cpu_bf16().ok, reason="this CPU has no bfloat16 matmul to measure")
def test_this_machines_own_verdict_decides_whether_a_bf16_pipeline_is_built(monkeypatch):
    """Unforced (the suite opts in to wrong numbers; here it does not): where Paddle's bfloat16 is right a
    pipeline builds; where it is wrong (Paddle 2.6.2 and 3.3.1 on the Intel Xeon and AMD EPYC measured: the
    bias gradient where the batch equals the layer's width) minimize refuses it with the measured figures,
    and the opt-in builds it."""
    monkeypatch.delenv(capabilities.WRONG_BF16_ENV)
    support = capabilities.cpu_bf16()
    net = build_mlp(num_stages=2, hidden=16, in_dim=8)
    bf16_sgd = paddle.static.amp.bf16.decorate_bf16(paddle.optimizer.SGD(0.1))
    if not support.right:
        assert support.wrong == "; ".join(str(m) for m in bf16_numbers.measure() if not m.right)
        with pytest.raises(ValueError) as err:
            minimize(net, bf16_sgd, dict(num_microbatches=4))
        assert str(err.value) == wrong_refusal(
            "gpu:0", "a bfloat16 AMP program (its white-list ops cast to bfloat16)", support.wrong)
        monkeypatch.setenv(capabilities.WRONG_BF16_ENV, "1")
    minimize(net, bf16_sgd, dict(num_microbatches=4))
    assert staticpipe.plan_of(net.main) is not None


def test_the_selftest_skips_its_bf16_row_where_bfloat16_runs_wrong_unless_allowed(wrong_bf16, monkeypatch):
    from staticpipe.selftest import amp
    from staticpipe.selftest.harness import SKIP, Context
    ctx = Context(cpu=True, quick=True, tf32=False)
    assert amp.check_bf16(ctx) == ("CPU", f"skipped: Paddle computes bfloat16 wrong on this CPU ({WRONG}); "
                                          "STATICPIPE_ALLOW_WRONG_BF16=1 runs it all the same", SKIP)
    monkeypatch.setenv(capabilities.WRONG_BF16_ENV, "1")
    monkeypatch.setattr(amp, "_amp_row", lambda ctx, low: ("CPU", f"the {low} row", "PASS"))  # allowed: it runs
    assert amp.check_bf16(ctx) == ("CPU", "the bf16 row", "PASS")
