"""Regenerate the parts of the docs that the code produces: ``python docs/generate.py`` (``--check`` to compare).

A generated part sits between ``<!-- generated:NAME -->`` and ``<!-- /generated -->``; the text in
between is whatever ``GENERATORS[NAME]()`` returns. tests/test_docs_api.py fails when a page has
drifted from the code; this script mends it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PART = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)


def declared_variables() -> dict[str, list[str]]:
    """Every environment variable the code declares -> the modules (or registry rows) that declare it."""
    import whichdevice

    found: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(whichdevice.__path__, "whichdevice."):
        if info.name.endswith(("__main__", "pytest_plugin")):
            continue
        module = importlib.import_module(info.name)
        names = getattr(module, "ENV_VARIABLES", ())
        if module.__name__.endswith(".probes") or not isinstance(names, tuple):
            continue  # probes/__init__ holds the union of its modules' declarations
        for name in names:
            found.setdefault(name, []).append(f"`{info.name.removeprefix('whichdevice.')}`")
    for backend in whichdevice.backends():
        for name in backend.visible_devices_env:
            found.setdefault(name, []).append(f"registry row `{backend.name}` (visible devices)")
        for default in backend.env_defaults:
            found.setdefault(name := default.name, []).append(f"registry row `{backend.name}` (set when unset)")
    return dict(sorted(found.items()))


def env_table() -> str:
    rows = ["| variable | declared by |", "|---|---|"]
    rows += [f"| `{name}` | {', '.join(dict.fromkeys(where))} |" for name, where in declared_variables().items()]
    return "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {"env-variables": env_table}


def regenerate(text: str) -> str:
    """The page with every generated part replaced by what its generator returns now."""

    def part(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise KeyError(f"no generator named {name!r} (known: {', '.join(GENERATORS)})")
        return f"{match.group(1)}{GENERATORS[name]()}{match.group(4)}"

    return _PART.sub(part, text)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def main(argv: list[str]) -> int:
    drifted = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        fresh = regenerate(text)
        if fresh != text:
            drifted.append(page.relative_to(ROOT).as_posix())
            if "--check" not in argv:
                page.write_text(fresh, encoding="utf-8")
    verb = "differ from the code" if "--check" in argv else "regenerated"
    print(f"{verb}: {', '.join(drifted) if drifted else 'nothing'}")
    return 1 if drifted and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
