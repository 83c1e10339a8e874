"""The docs cannot drift: every Python block of README.md and docs/*.md is marked runnable (and runs here, as
written) or a fragment; every ``staticpipe.<name>`` they mention exists; every relative link resolves."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- (runnable|fragment) -->\n)?^```python\n(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[str, int, str | None, str]]:
    """(document, line, marker or None, code) of every Python block."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            found.append((doc.name, text.count("\n", 0, m.start(2)), m.group(1), m.group(2)))
    return found


def test_every_python_block_is_marked_runnable_or_fragment():
    unmarked = [f"{doc}:{line}" for doc, line, marker, _ in blocks() if marker is None]
    assert unmarked == [], f"mark each block <!-- runnable --> or <!-- fragment -->: {unmarked}"


@pytest.mark.parametrize("doc, line, code", [(d, n, c) for d, n, m, c in blocks() if m == "runnable"],
                         ids=lambda v: str(v)[:40])
def test_a_runnable_block_runs_as_written(doc, line, code, tmp_path):
    """In a process of its own, as a user pastes it (Paddle's default IR, no flags of the suite's)."""
    env = {k: v for k, v in os.environ.items() if k != "STATICPIPE_LEGACY_IR"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, f"{doc}:{line}\n{done.stderr[-3000:]}"


def test_every_staticpipe_name_a_doc_mentions_exists():
    missing = []
    for doc in DOCS:
        for name in sorted(set(re.findall(r"\bstaticpipe(?:\.[A-Za-z_]\w*)+", doc.read_text(encoding="utf-8")))):
            if not _resolves(name):
                missing.append(f"{doc.name}: {name}")
    assert missing == []


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the package or an attribute reachable from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+://", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.name}: {target}")
    assert broken == []
