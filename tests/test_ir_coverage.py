"""Feature tests cannot land on one program IR only: every test that trains a pipeline against one device
through ``pipeline_util.train_twins`` takes the ``program_ir`` fixture (conftest.py: once per IR from one
body), or is listed here with the reason it is legacy-only."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
LEGACY_ONLY = {  # test -> why it cannot run on a PIR program
    "test_adam_family_equals_single_device_up_to_its_own_rounding_noise":
        "its rounding-noise reference is Paddle's gradient merge, which builds legacy programs only",
    "test_gpt_with_adamw_warmup_cosine_and_global_norm_clipping":
        "the same rounding-noise reference; and it reads the clip's norms from the reference's legacy ops",
    "test_tied_embedding_with_active_global_norm_clipping_where_every_stage_owns_parameters":
        "it reads the clip's per-parameter norms from the reference's legacy ops (squared_l2_norm)",
    "test_dlrm_with_embeddings_on_a_cpu_stage": "it finds the dense layers by the legacy ops that use them",
    "test_gpt_tied_embedding_adamw_clipping_over_four_stages":
        "AMP: Paddle 3.3.1 trains no PIR AMP program on a CPU (docs/pir.md)",
    "test_gpt_parity_fails_when_stages_clip_by_their_local_norm":
        "it plants a fault in the legacy rewrite's clipping to check the parity check catches it",
    "test_tied_embedding_parity_fails_when_stages_clip_by_their_local_norm":
        "it plants a fault in the legacy rewrite's clipping to check the parity check catches it",
    "test_training_after_auto_place_equals_single_device_mlp":
        "profile (and so auto_place by measured times) reads legacy programs only (docs/pir.md)",
    "test_training_after_auto_place_equals_single_device_gpt":
        "profile (and so auto_place by measured times) reads legacy programs only (docs/pir.md)",
}


def twin_tests() -> dict[str, tuple[str, bool]]:
    """test name -> (its file, whether it takes program_ir), for tests calling pipeline_util's train_twins."""
    found = {}
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        imported = any(isinstance(node, ast.ImportFrom) and node.module in ("pipeline_util", "tests.pipeline_util")
                       and any(alias.name == "train_twins" for alias in node.names) for node in tree.body)
        if not imported:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                calls = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "train_twins"
                            for n in ast.walk(node))
                if calls:
                    found[node.name] = (path.name, "program_ir" in [a.arg for a in node.args.args])
    return found


def test_every_pipeline_against_one_device_test_runs_on_both_irs_or_says_why_not():
    tests = twin_tests()
    assert len(tests) > 15  # the scan finds them
    one_ir = sorted(f"{file}::{name}" for name, (file, both) in tests.items() if not both and name not in LEGACY_ONLY)
    assert one_ir == [], ("take the program_ir fixture (or list the test in LEGACY_ONLY with the reason it "
                          f"cannot run on PIR): {one_ir}")


def test_the_legacy_only_list_names_tests_that_exist_and_need_it():
    tests = twin_tests()
    stale = sorted(name for name in LEGACY_ONLY if name not in tests or tests[name][1])
    assert stale == [], f"LEGACY_ONLY names tests that are gone or run on both IRs: {stale}"
