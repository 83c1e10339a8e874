"""``python -m staticpipe.selftest``: skips cleanly without CUDA, its report starts with what ran where, and
its CPU dry run passes every row.

The dry run (``--cpu --quick``) runs every check of the GPU table on CPU devices, each in its own process,
so the harness that a GPU machine runs is exercised here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import metadata

import pytest

import staticpipe
from staticpipe import selftest
from staticpipe._paddle import paddle
from staticpipe.capabilities import cpu_bf16
from staticpipe.selftest import checks, cli, harness, process

pytestmark = pytest.mark.timeout(180)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = [sys.executable, "-m", "staticpipe.selftest"]
ROWS = ["a. equivalence: MLP", "a. equivalence: ResNet (batch norm)", "a. equivalence: GPT (tied embedding)",
        "b. heterogeneous cpu+gpu: DLRM", "c. seed ResNet-50: 2 stages vs 1 GPU", "d. peak memory per stage",
        "e. 2-process launch (NCCL)", "f. AMP fp16 across stages", "g. AMP bf16 across stages"]


def run_selftest(*args, command=COMMAND, timeout=150, **env_vars):
    env = dict(os.environ, **env_vars)
    env.pop("STATICPIPE_DEVICE_MAP", None)
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def has_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def facts_expected() -> dict[str, str]:
    """What the report's header must say of this machine, from Paddle itself."""
    cuda = paddle.is_compiled_with_cuda()
    return {"Paddle": f"{paddle.__version__}, commit {paddle.version.commit}",
            "CUDA": paddle.version.cuda() if cuda else "none (a CPU build of Paddle)",
            "cuDNN": paddle.version.cudnn() if cuda else "none"}


def installed_version() -> str:
    try:
        return metadata.version("staticpipe")
    except metadata.PackageNotFoundError:
        return "not installed"


def header_facts(lines: list[str]) -> dict[str, str]:
    """The header's "- name: value" lines, by name."""
    return dict(line[2:].split(": ", 1) for line in lines if line.startswith("- "))


def test_without_cuda_it_skips_with_a_message_and_what_ran_where_and_exits_0():
    if has_gpu():
        pytest.skip("this machine has a GPU: the command runs the checks instead of skipping")
    result = run_selftest()
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("no CUDA device: ")
    assert "run on a GPU machine" in result.stdout and "`python -m staticpipe.selftest`" in result.stdout
    assert "| check |" not in result.stdout  # no table: nothing was run
    facts = header_facts(result.stdout.splitlines())
    assert {k: facts.get(k) for k in facts_expected()} == facts_expected()
    assert facts["GPUs"].startswith("no GPU") and facts["Python"].startswith(sys.version.split()[0])
    # the script of older instructions runs the same command
    old = run_selftest(command=[sys.executable, os.path.join("bench", "gpu_acceptance.py")])
    assert (old.returncode, old.stdout) == (0, result.stdout)


def test_cpu_dry_run_passes_every_row_of_the_table(tmp_path):
    rows_file = tmp_path / "rows.json"
    result = run_selftest("--cpu", "--quick", "--json", str(rows_file), "--log-dir", str(tmp_path / "logs"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(rows_file.read_text())
    rows = report["rows"]
    assert [r["check"] for r in rows] == ROWS
    bf16 = cpu_bf16().ok  # the bf16 row runs where this CPU runs bfloat16, and is skipped (not failed) elsewhere
    assert [r["status"] for r in rows] == ["PASS"] * (len(ROWS) - 1) + ["PASS" if bf16 else "SKIP"], \
        json.dumps(rows, indent=1)
    assert report["title"].startswith("staticpipe selftest, CPU DRY RUN (--cpu)")
    assert "NOT GPU results" in report["title"] and "quick sizes" in report["title"]
    # the report: its title, what ran where (a line per fact), then one table: the Markdown header and rule,
    # a line per row, the summary
    lines = result.stdout.splitlines()
    facts = report["environment"]
    assert lines[0] == report["title"] and lines[1] == ""
    assert lines[2:2 + len(facts)] == [f"- {name}: {value}" for name, value in facts.items()]
    assert list(facts) == ["staticpipe", "Paddle", "CUDA", "cuDNN", "GPUs", "Python", "CPU"]
    assert {k: facts[k] for k in facts_expected()} == facts_expected()
    assert facts["staticpipe"] == f"{installed_version()} ({os.path.dirname(staticpipe.__file__)})"
    assert f", {os.cpu_count()} cores, " in facts["CPU"]
    if not has_gpu():
        assert facts["GPUs"].startswith("no GPU")
    table = lines[3 + len(facts):]
    assert table[:2] == ["| check | devices | result | status | seconds |", "| --- | --- | --- | --- | --- |"]
    assert [line.split(" | ")[0] for line in table[2:2 + len(ROWS)]] == [f"| {title}" for title in ROWS]
    assert table[-1] == (f"{len(ROWS)} checks: {len(ROWS)} passed, 0 failed, 0 skipped" if bf16 else
                         f"{len(ROWS)} checks: {len(ROWS) - 1} passed, 0 failed, 1 skipped")
    by_check = {r["check"]: r for r in rows}
    for title in ROWS[:4]:  # equivalence rows state their tolerance and the largest relative difference
        assert "max rel diff" in by_check[title]["result"] and "rtol 1e-05, atol 1e-06" in by_check[title]["result"]
        assert by_check[title]["devices"].startswith("CPU: ")
    assert "GradientMerge" in by_check[ROWS[1]]["result"]
    assert by_check[ROWS[3]]["devices"] == "CPU: cpu+gpu:0 as CPU devices"
    assert "samples/s" in by_check[ROWS[4]]["result"] and "ratio" in by_check[ROWS[4]]["result"]
    assert "stage 0 (gpu:0) activations" in by_check[ROWS[5]]["result"]
    assert "stage 1 (gpu:1) activations" in by_check[ROWS[5]]["result"]
    assert "gloo (CPU dry run)" in by_check[ROWS[6]]["result"]
    fp16 = by_check[ROWS[7]]["result"]
    assert all(f"{p} " in fp16 and "samples/s" in fp16 for p in ("fp32", "fp16"))
    assert "fp16 loss scale per stage {0: 32768.0, 1: 32768.0}" in fp16
    bf16_row = by_check[ROWS[8]]["result"]
    if bf16:
        assert all(f"{p} " in bf16_row and "samples/s" in bf16_row for p in ("fp32", "bf16")) and "bfloat16" in bf16_row
    else:
        assert bf16_row == f"skipped: this CPU cannot run bfloat16 through Paddle's oneDNN ({cpu_bf16().reason})"
    assert sorted(os.listdir(tmp_path / "logs")) == sorted(f"{key}.log" for key in
                                                           ("a-mlp", "a-resnet", "a-gpt", "b-dlrm", "c-seed",
                                                            "d-memory", "e-launch", "f-amp", "g-bf16"))


def test_the_bf16_row_is_skipped_with_the_reason_on_a_cpu_without_bfloat16(tmp_path):
    """oneDNN capped at AVX2 (any CPU then lacks bfloat16 kernels): the row says SKIP and why, not FAIL."""
    rows_file = tmp_path / "rows.json"
    result = run_selftest("--cpu", "--quick", "--only", "g-bf16", "--json", str(rows_file), "--log-dir",
                          str(tmp_path / "logs"), ONEDNN_MAX_CPU_ISA="AVX2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [row] = json.loads(rows_file.read_text())["rows"]
    assert row["check"] == ROWS[8] and row["status"] == "SKIP"
    assert row["result"].startswith("skipped: this CPU cannot run bfloat16 through Paddle's oneDNN (")
    assert result.stdout.splitlines()[-1] == "1 checks: 0 passed, 0 failed, 1 skipped"


def test_a_failing_check_is_reported_in_its_row_and_the_others_still_run(monkeypatch, capsys):
    def boom(ctx):
        raise RuntimeError("stage 1 (gpu:1) failed")

    def fine(ctx):
        return "somewhere", "all good", harness.PASS

    monkeypatch.setattr(checks, "CHECKS", {"x-boom": ("x. boom", boom, True), "x-fine": ("x. fine", fine, False)})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main(--cpu) sets it; monkeypatch restores it
    assert selftest.main(["--cpu", "--in-process"]) == 1
    out = capsys.readouterr().out
    assert "| x. boom | - | error: RuntimeError: stage 1 (gpu:1) failed | FAIL |" in out
    assert "| x. fine | somewhere | all good | PASS |" in out
    assert out.splitlines()[-1] == "2 checks: 1 passed, 1 failed, 0 skipped (failed: x. boom)"


def test_a_hung_check_is_killed_with_its_children():
    start = time.monotonic()
    code, _ = process.run_group([sys.executable, "-c", "import subprocess, sys, time; "
                                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                 "time.sleep(60)"], dict(os.environ), timeout=2)
    assert code is None and time.monotonic() - start < 20


def test_device_map_runs_a_longer_pipeline_on_the_gpus_there_are():
    ctx = harness.Context(cpu=True, quick=True, tf32=False)
    assert ctx.gpus == 0 and ctx.device_map(["gpu:0", "gpu:1"]) == {}
    assert ctx.describe(["cpu", "gpu:0"]) == "CPU: cpu+gpu:0 as CPU devices"
    ctx.gpus = 1  # what a one-GPU machine would see
    assert ctx.device_map(["gpu:0", "gpu:1"]) == {"gpu:1": "gpu:0"}
    assert ctx.describe(["gpu:0", "gpu:1"]) == "gpu:0+gpu:1 on GPU 0 (device map gpu:1->gpu:0)"
    assert ctx.describe(["cpu", "gpu:0", "gpu:1"]) == "cpu+gpu:0+gpu:1 on CPU + GPU 0 (device map gpu:1->gpu:0)"
    ctx.gpus = 2
    assert ctx.device_map(["gpu:0", "gpu:1", "gpu:2"]) == {"gpu:2": "gpu:0"}
    assert ctx.describe(["gpu:0", "gpu:1"]) == "gpu:0+gpu:1 on GPU 0, GPU 1"


def test_unknown_checks_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "a-mlp,z-nope"])
    assert "unknown check(s) ['z-nope']" in capsys.readouterr().err


def test_what_cuda_must_find_when_it_starts():
    """A dry run hides every GPU; one process running every row has TF32 off unless --tf32; isolated
    checks get their environment per row."""
    def needed(*argv):
        return cli.needed_environment(cli.parse_args(list(argv)))

    assert needed("--cpu") == needed("--cpu", "--in-process") == {"CUDA_VISIBLE_DEVICES": ""}
    assert needed("--in-process") == {"NVIDIA_TF32_OVERRIDE": "0"}
    assert needed() == needed("--in-process", "--tf32") == {}
