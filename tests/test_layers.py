"""The package's layers: every import points down or sideways, never up, and no two modules import
each other (directly or round a loop). The layer order is written here, once."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import whichdevice

PACKAGE_DIR = Path(whichdevice.__file__).parent

# Bottom to top: one folder a question (each folder's __init__ docstring says what it decides and
# what it may import), then the surfaces. A module may import its own folder or a lower one. A new
# folder or top-level module must be placed here before its imports are accepted, which is the point:
# its place in the order is a decision.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("core",)),
    ("hardware", ("hardware",)),
    ("model", ("model",)),
    ("launch", ("launch",)),
    ("device", ("device",)),
    ("measure", ("measure",)),
    ("precision", ("precision",)),
    ("attention", ("attention",)),
    ("memory", ("memory",)),
    ("tuning", ("tuning",)),
    ("resolve", ("resolve",)),
    ("training", ("training",)),
    ("surfaces", ("testing", "report", "smoke", "cli", "cli_parser", "__main__", "pytest_plugin", "__init__")),
)
FOLDERS = tuple(layer for layer, _ in LAYERS[:-1])


def _modules() -> dict[str, Path]:
    """Dotted name below the package ("probes.cuda", "__init__") -> file."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if len(parts) > 1 and parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer_of(module: str) -> int:
    top = module.split(".")[0]
    for rank, (_, names) in enumerate(LAYERS):
        if top in names:
            return rank
    raise LookupError(module)


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every whichdevice module ``module`` imports: top-level, in functions, under TYPE_CHECKING."""
    # the package a relative import starts from: "probes.cuda" -> ["probes"], "errors" -> []
    parts = [p for p in module.split(".") if p != "__init__"]
    package = parts if path.name == "__init__.py" else parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(["whichdevice", *base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{alias.name}" for alias in node.names]
        for name in names:
            if not name.startswith("whichdevice."):
                continue
            dotted = name.removeprefix("whichdevice.")
            # "from whichdevice.hardware.probes import finish" names the module probes, not probes.finish
            while dotted and dotted not in known:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != module:
                found.add(dotted)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    unplaced = []
    for name in _modules():
        try:
            _layer_of(name)
        except LookupError:
            unplaced.append(name)
    assert not unplaced, f"place these modules in LAYERS (tests/test_layers.py): {unplaced}"


def test_every_listed_module_exists() -> None:
    """A name in LAYERS that no file or folder carries is a stale list, not a layer."""
    tops = {name.split(".")[0] for name in _modules()}
    missing = [name for _, names in LAYERS for name in names if name not in tops]
    assert missing == []


def _may_import(folder: str) -> list[str]:
    """The folders ``folder``'s docstring says it may import ("May import: core/, hardware/." or a
    range "core/ ... memory/")."""
    doc = __import__(f"whichdevice.{folder}", fromlist=["_"]).__doc__ or ""
    assert "May import:" in doc, f"whichdevice/{folder}/__init__.py: say what it may import ('May import: ...')"
    said = doc.split("May import:", 1)[1]
    named = [f for f in FOLDERS if f"{f}/" in said]
    if "..." in said and named:
        named = list(FOLDERS[FOLDERS.index(named[0]) : FOLDERS.index(named[-1]) + 1])
    return named


def test_the_folders_are_the_layers() -> None:
    """Every folder below the surfaces is a layer; its docstring names only folders below it, and
    its modules import nothing beyond what the docstring names."""
    on_disk = sorted(p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists())
    assert sorted([*FOLDERS, "report", "smoke", "testing"]) == on_disk
    graph = _graph()
    for rank, folder in enumerate(FOLDERS):
        allowed = _may_import(folder)
        assert set(allowed) <= set(FOLDERS[:rank]), f"whichdevice/{folder} names a folder above it: {allowed}"
        beyond = sorted(
            f"{module} imports {target}"
            for module, targets in graph.items()
            if module.split(".")[0] == folder
            for target in targets
            if target.split(".")[0] not in (folder, *allowed)
        )
        assert beyond == [], f"whichdevice/{folder}/__init__.py allows {allowed}"


def test_no_import_points_upward() -> None:
    upward = [
        f"{module} ({LAYERS[_layer_of(module)][0]}) imports {target} ({LAYERS[_layer_of(target)][0]})"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _layer_of(target) > _layer_of(module)
    ]
    assert upward == []


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert cycles == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from whichdevice.hardware.registry import backends", {"hardware.registry"}),
        ("from whichdevice.hardware import probing", {"hardware", "hardware.probing"}),
        ("import whichdevice.resolve.resolver", {"resolve.resolver"}),
        ("def f():\n    from whichdevice.resolve.resolver import Resolution", {"resolve.resolver"}),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from whichdevice.training.lora import x",
            {"training.lora"},
        ),
        ("from .records import TraceStep", {"core.records"}),
        ("import os", set()),
    ],
)
def test_the_reader_sees_every_kind_of_import(tmp_path: Path, source: str, expected: set[str]) -> None:
    """The checks above are only as good as the import reader: it must see function-level,
    TYPE_CHECKING, relative and `from package import module` forms."""
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert _imports("core.errors", path, set(_modules())) == expected


def test_an_upward_import_is_caught() -> None:
    """A lower module importing a higher one is reported (the check can fail)."""
    assert _layer_of("resolve.resolver") > _layer_of("core.records")
    assert _layer_of("hardware.probes.cuda") == _layer_of("hardware.probing")


# The size rules a newcomer reads the code by (docs/architecture.md).
MAX_MODULE_LINES = 400
# 13 since core/frozen.py (issue 56): every record module imports it, one level under core/records.py,
# and it reads as @dataclass(frozen=True) does, so the climb it adds is one a reader never takes.
MAX_CHAIN = 13
MAX_FUNCTION_LINES = 60


def _longest_chain(graph: dict[str, set[str]]) -> list[str]:
    memo: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in memo:
            memo[node] = [node, *max((chain(nxt) for nxt in graph.get(node, ())), key=len, default=[])]
        return memo[node]

    return max((chain(node) for node in graph), key=len, default=[])


def test_modules_stay_small() -> None:
    big = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert big == {}, f"split these modules (over {MAX_MODULE_LINES} lines)"


def test_the_import_chain_is_short() -> None:
    """A newcomer following imports down from the command climbs at most MAX_CHAIN modules."""
    longest = _longest_chain(_graph())
    assert len(longest) <= MAX_CHAIN, " -> ".join(longest)


def test_the_chain_counter_counts() -> None:
    assert _longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ["a", "b", "c"]


def test_functions_stay_short() -> None:
    """Functions stay under MAX_FUNCTION_LINES lines; at most three may run over while they wait to be split."""
    long = sorted(
        f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    )
    assert len(long) <= 3, long


def test_the_architecture_page_is_generated_from_the_folders() -> None:
    script = PACKAGE_DIR.parents[1] / "scripts" / "gen_architecture.py"
    if not script.exists():
        pytest.skip("the source tree's scripts/ is not beside this installed package")
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
