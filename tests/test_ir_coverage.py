"""Feature tests cannot land on one program IR only: a test that trains a pipeline against one device
(``pipeline_util.train_twins``) takes the ``program_ir`` fixture (conftest.py: once per IR from one body),
or is listed in ``pipeline_util.LEGACY_ONLY`` with the reason it cannot run on PIR. ``train_twins``
checks it when it runs, whatever way a test reaches it (directly, a helper, a fixture); here, that the
list names only tests that exist and need it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import pipeline_util
from pipeline_util import LEGACY_ONLY

TESTS = Path(__file__).parent


def test_the_legacy_only_list_names_tests_that_exist_and_take_no_program_ir():
    sources = "\n".join(path.read_text() for path in sorted(TESTS.glob("test_*.py")))
    for name in LEGACY_ONLY:
        found = re.search(rf"^def {name}\((.*?)\):", sources, re.M | re.S)
        assert found, f"LEGACY_ONLY names {name}, which no test file defines"
        assert "program_ir" not in found.group(1), f"{name} takes program_ir: take it off LEGACY_ONLY"


def test_a_twin_trained_outside_the_list_without_program_ir_is_refused(monkeypatch):
    monkeypatch.setattr(pipeline_util, "current_test", ("test_something_new", False))
    with pytest.raises(AssertionError) as err:
        pipeline_util.check_ir_coverage()
    assert str(err.value) == (
        "test_something_new trains a pipeline against one device on one IR only: take the program_ir fixture "
        "(conftest.py), or list the test in pipeline_util.LEGACY_ONLY with the reason it cannot run on PIR")
    monkeypatch.setattr(pipeline_util, "current_test", ("test_something_new", True))
    pipeline_util.check_ir_coverage()
    monkeypatch.setattr(pipeline_util, "current_test", (next(iter(LEGACY_ONLY)), False))
    pipeline_util.check_ir_coverage()
