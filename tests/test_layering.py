"""The package's imports run one way, and no module grows past what a reader takes in at once.

Read as text (``ast``), so the rule holds for every import: at module level or inside a function (a
lazy import the wrong way is still the wrong way). Only ``if TYPE_CHECKING:`` blocks are left out:
annotations may name a type from anywhere.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "staticpipe"
# bottom to top; a module may import its own layer and the layers below it
LAYERS = [
    {"_paddle", "legacy_ir", "gc_paused", "process_switch", "linear_scans", "op_callstacks", "restarts"},
    {"ir", "pir_ir", "pir_view", "placement", "plan", "plan_records", "memory_model", "capabilities"},
    {"schedule"},
    {"io", "trace"},
    {"rewrite"},
    {"runtime"},
    {"", "executor", "train", "checkpoint", "atomic", "pickled_arrays", "saved_plan", "saved_pir", "verify", "export",
     "partition", "optimizer", "launch", "launch_restarts", "fleet"},
    {"selftest"},  # the command users run on their machines: nothing in the package imports it
]
# besides: the runtime executes plans without knowing how they are made, and saved plans and partitioning
# work without the runtime
FORBIDDEN = [("runtime", "rewrite"), ("runtime", "checkpoint"), ("saved_plan", "runtime"), ("saved_pir", "runtime"),
             ("partition", "runtime")]
MAX_LINES = 380


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package: Path = PACKAGE, annotations: bool = False) -> set[str]:
    """The staticpipe modules (dotted, maybe with an imported name at the end) ``path`` imports;
    ``annotations``: those under ``if TYPE_CHECKING:`` too."""
    name = module_name(path, package)
    parent = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parent.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if node.module:  # "from . import x" imports x, not the package that holds it
                found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m == "staticpipe" or m.startswith("staticpipe.")}


def top(module: str) -> str:
    """The first name under the package: ``runtime`` for ``staticpipe.runtime.worker``."""
    return module.split(".")[1] if "." in module else ""


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if top(module) in names:
            return i
    raise AssertionError(f"{module} is in no layer of test_layering.LAYERS: add it")


def graph(package: Path = PACKAGE, annotations: bool = False) -> tuple[dict[str, Path], dict[str, set[str]]]:
    """(module -> file, module -> the modules it imports; ``annotations``: for type annotations too)."""
    modules = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}

    def resolve(imported: str) -> str:  # staticpipe.plan.Plan -> staticpipe.plan
        while imported not in modules:
            imported = imported.rsplit(".", 1)[0]
        return imported

    return modules, {m: {resolve(i) for i in imports(p, package, annotations)} - {m} for m, p in modules.items()}


def wrong_arrows(package: Path = PACKAGE) -> list[str]:
    """Imports of a higher layer, and imports ``FORBIDDEN`` names."""
    _, edges = graph(package)
    wrong = []
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            if layer(t) > layer(m):
                wrong.append(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})")
            elif (top(m), top(t)) in FORBIDDEN:
                wrong.append(f"{m} imports {t}: {top(m)} must not depend on {top(t)}")
    return wrong


MODULES, EDGES = graph()


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_imports_never_point_up():
    wrong = wrong_arrows()
    assert not wrong, "\n".join(wrong)


def test_wrong_arrows_are_found(tmp_path):
    """The rule can fail: in a copy of the package, a lazy import of the runtime inside the plan and an
    import of the rewrite in the runtime are both caught."""
    copy = tmp_path / "staticpipe"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path, line in (("runtime/worker.py", "from ..rewrite import build_plan"),
                       ("plan.py", "def late():\n    from .runtime.step import StepRunner")):
        (copy / path).write_text((copy / path).read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")
    assert wrong_arrows(copy) == [
        "staticpipe.plan (layer 1) imports staticpipe.runtime.step (layer 5)",
        "staticpipe.runtime.worker imports staticpipe.rewrite: runtime must not depend on rewrite"]


def test_no_import_cycle():
    """Among modules and packages (an arrow into a package is one into what its ``__init__`` imports), every
    import counted: at module level, lazy, and for type annotations (a type a reader must follow is a
    dependency too). A module that needs a higher one's object takes it through a ``Protocol`` of its own
    (``checkpoint.StateHolder``, ``train.loop.Stepper``, ``runtime.optimize_phase.DeviceWorker``)."""
    _, edges = graph(annotations=True)
    edges = {m: targets - {"staticpipe"} for m, targets in edges.items() if m != "staticpipe"}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for t in sorted(edges.get(module, ())):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [module, t]))
            if t not in state:
                visit(t, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    lines = MODULES[module].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by idea"
