"""Shared test setup: every test builds legacy static-graph programs."""
from __future__ import annotations

import pytest

from staticpipe._paddle import paddle  # settles FLAGS_enable_pir_api before static mode is used

paddle.enable_static()


@pytest.fixture(autouse=True)
def _static_mode():
    paddle.enable_static()
    yield
