"""The package's layers: every import points down or sideways, never up, and no two modules import
each other (directly or round a loop). The layer order is written here, once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import whichdevice

PACKAGE_DIR = Path(whichdevice.__file__).parent

# Bottom to top. A module may import modules of its own layer or of a lower one. A package named
# here ("probes") covers its submodules. A new module must be placed here before its imports are
# accepted, which is the point: its place in the order is a decision.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("records", ("errors", "records", "packages", "envview", "modelfiles", "sizing")),
    ("registry", ("registry", "visible", "envhooks")),
    ("probes", ("probes", "probing", "compatibility", "calibration")),
    (
        "deciders",
        (
            "model_support",
            "precision",
            "measured_precision",
            "model_precision",
            "flash",
            "attention",
            "decode_attention",
            "kernels_support",
            "quantization",
            "job_memory",
            "offload",
            "placement",
            "distributed",
            "launch_leftovers",
            "training_settings",
            "accelerate_settings",
            "request",
            "device_choice",
            "shapes",
            "detection",
            "memo",
            "steps",
        ),
    ),
    ("resolver", ("resolution", "resolver")),
    ("adapters", ("training", "lora")),
    ("surfaces", ("testing", "report", "smoke", "cli", "__main__", "pytest_plugin", "__init__")),
)


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
            # "from whichdevice.probes import finish" names the module probes, not probes.finish
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
        ("from whichdevice.registry import backends", {"registry"}),
        ("from whichdevice import probing", {"probing"}),
        ("import whichdevice.resolver", {"resolver"}),
        ("def f():\n    from whichdevice.resolver import Resolution", {"resolver"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from whichdevice.lora import x", {"lora"}),
        ("from .records import TraceStep", {"records"}),
        ("import os", set()),
    ],
)
def test_the_reader_sees_every_kind_of_import(tmp_path: Path, source: str, expected: set[str]) -> None:
    """The checks above are only as good as the import reader: it must see function-level,
    TYPE_CHECKING, relative and `from package import module` forms."""
    path = tmp_path / "mod.py"
    path.write_text(source)
    assert _imports("errors", path, set(_modules())) == expected


def test_an_upward_import_is_caught() -> None:
    """A lower module importing a higher one is reported (the check can fail)."""
    assert _layer_of("resolver") > _layer_of("records")
    assert _layer_of("probes.cuda") == _layer_of("probes")
