"""Shared test setup: every test builds legacy static-graph programs, except those that build PIR ones
under ``paddle.pir_utils.IrGuard`` (``test_pir*.py``) or in a process of their own. On Paddle 3.x that is
the legacy-IR opt-in (``STATICPIPE_LEGACY_IR=1``), set before staticpipe is imported and inherited by the
scripts the tests start; ``test_legacy_ir.py`` checks the default without it."""
from __future__ import annotations

import os
import signal

import pytest

os.environ["STATICPIPE_LEGACY_IR"] = "1"
# bfloat16 on this CPU may run and be wrong (Paddle 2.6.2 and 3.3.1 get an fc's bias gradient wrong where the
# batch equals its width, on Intel and AMD alike: staticpipe.capabilities), which minimize refuses. The bf16
# tests compare the pipeline with Paddle's own training on the same kernels, right or wrong, so the suite
# opts in; test_capabilities checks the refusal without it.
os.environ["STATICPIPE_ALLOW_WRONG_BF16"] = "1"

# The Ctrl-C tests send SIGINT to this process and to the processes they start. A suite run as a
# background job of a non-interactive shell (``cmd &`` in a script, ``nohup``) starts with SIGINT ignored,
# Python then leaves it ignored, and every process started from here inherits that through exec: a script's
# Ctrl-C was never delivered (it trained on for half an hour), and a launcher keeps a signal it was started
# ignoring ignored, by design. Handled here, SIGINT is the default again in every process the tests start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from staticpipe._paddle import paddle  # noqa: E402  (settles FLAGS_enable_pir_api before static mode is used)

paddle.enable_static()


@pytest.fixture(autouse=True)
def _static_mode():
    paddle.enable_static()
    yield


@pytest.fixture(autouse=True)
def _ir_coverage(request):
    """Tells ``pipeline_util.train_twins`` which test runs it and whether that test runs on both IRs."""
    import pipeline_util

    pipeline_util.current_test = (request.node.originalname, "program_ir" in request.fixturenames)
    yield
    pipeline_util.current_test = None


@pytest.fixture(params=["legacy", "pir"])
def program_ir(request):
    """A feature test taking this fixture runs once per program IR: the legacy IR (this process's default,
    see above), and PIR (Paddle 3's default) under ``IrGuard``, skipped on Paddle 2.x. Its programs are built
    and trained inside, so one test body checks a feature on both IRs."""
    from staticpipe._paddle import PADDLE_MAJOR

    if request.param == "legacy":
        yield "legacy"
        return
    if PADDLE_MAJOR < 3:
        pytest.skip("PIR is Paddle 3's program IR")
    with paddle.pir_utils.IrGuard():
        yield "pir"


@pytest.fixture
def bf16_kernels_assumed(monkeypatch):
    """For tests that only build bfloat16 plans (nothing runs): the CPU's answer is taken as yes, so the
    rewrite is tested on every machine."""
    from staticpipe import capabilities
    monkeypatch.setattr(capabilities, "_probed", {True: capabilities.Bf16Support(True),
                                                   False: capabilities.Bf16Support(True)})
