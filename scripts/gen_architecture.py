"""Regenerate the layout section of docs/architecture.md from the package's folders.

    python scripts/gen_architecture.py          # rewrite the section between the markers
    python scripts/gen_architecture.py --check  # exit 1 when the doc has drifted (tests/test_layers.py runs this)

The layer order comes from tests/test_layers.py (written once there); what each folder decides and
may import comes from its ``__init__`` docstring; each module's line is its docstring's first line.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "whichdevice"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- generated:layout -->", "<!-- /generated:layout -->"


def _layers() -> tuple[tuple[str, tuple[str, ...]], ...]:
    tree = ast.parse((ROOT / "tests" / "test_layers.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "LAYERS":
            return ast.literal_eval(node.value)  # type: ignore[no-any-return]
    raise SystemExit("tests/test_layers.py defines no LAYERS")


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def _first_line(path: Path) -> str:
    doc = _docstring(path).split("\n\n")[0]
    return " ".join(doc.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    layers = _layers()
    out = [BEGIN, "", "| layer | folder | what it decides | may import |", "|---|---|---|---|"]
    modules = ["", "| module | what it holds |", "|---|---|"]
    for rank, (layer, names) in enumerate(layers):
        for name in names:
            folder = PACKAGE / name
            if folder.is_dir():
                doc = _docstring(folder / "__init__.py")
                decides, _, allowed = doc.partition("May import:")
                if not allowed:  # a surface: its first paragraph says what it is
                    decides = _first_line(folder / "__init__.py")
                out.append(
                    f"| {rank + 1}. {layer} | `{name}/` | {_cell(' '.join(decides.split()))} | "
                    f"{_cell(' '.join(allowed.split()) or 'anything below')} |"
                )
                files = sorted(p for p in folder.rglob("*.py") if p.name != "__init__.py" or p.parent != folder)
            else:
                file = PACKAGE / f"{name}.py"
                out.append(f"| {rank + 1}. {layer} | `{name}.py` | {_cell(_first_line(file))} | anything |")
                files = []
            for file in files:
                rel = file.relative_to(PACKAGE).as_posix()
                if file.name == "__init__.py":
                    rel = rel.removesuffix("/__init__.py") + "/"
                modules.append(f"| `{rel}` | {_cell(_first_line(file))} |")
    return "\n".join([*out, *modules, "", END])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/architecture.md has drifted")
    args = parser.parse_args()
    text = DOC.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        print(f"{DOC}: the markers {BEGIN} ... {END} are missing", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + render() + tail
    if args.check:
        if new != text:
            print("docs/architecture.md has drifted: run python scripts/gen_architecture.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
