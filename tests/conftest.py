"""Shared test setup: every test builds legacy static-graph programs, except those that build PIR ones
under ``paddle.pir_utils.IrGuard`` (``test_pir*.py``) or in a process of their own. On Paddle 3.x that is
the legacy-IR opt-in (``STATICPIPE_LEGACY_IR=1``), set before staticpipe is imported and inherited by the
scripts the tests start; ``test_legacy_ir.py`` checks the default without it."""
from __future__ import annotations

import os

import pytest

os.environ["STATICPIPE_LEGACY_IR"] = "1"

from staticpipe._paddle import paddle  # noqa: E402  (settles FLAGS_enable_pir_api before static mode is used)

paddle.enable_static()


@pytest.fixture(autouse=True)
def _static_mode():
    paddle.enable_static()
    yield
