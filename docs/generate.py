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


def simulate_grammar() -> str:
    """The simulate() spec grammar, its keys and modes read from the parser's own tables."""
    from whichdevice.testing import spec

    keys = [*spec._DETAIL_KEYS, *spec._COMMON_KEYS, *spec._ALIASES]
    return (
        "```text\n"
        'spec     := backend [":" count] ("," item)*\n'
        'item     := key "=" value | mode\n'
        f"key      := {' | '.join(sorted(keys))}\n"
        f"mode     := {' | '.join(sorted(spec.MODES))}\n"
        "```\n"
    )


def _command(*args: str) -> tuple[str, str]:
    """(stdout, stderr) of ``python -m whichdevice ARGS`` with this checkout's source, steering variables unset."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WHICHDEVICE_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "whichdevice", *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    return proc.stdout, proc.stderr


def gaudi3_report() -> str:
    """The head of the report for a simulated Gaudi 3 machine, and its training resolution."""
    args = ("--simulate", "hpu:8,gen=gaudi3", "--task", "training")
    lines = _command(*args)[0].splitlines()
    start = lines.index("RESOLUTION FOR TRAINING")
    excerpt = [*lines[:10], "  ...", *lines[start : start + 5], "  ..."]
    command = " ".join(f'"{a}"' if "," in a else a for a in args)
    return f"```text\n$ whichdevice {command}\n" + "\n".join(excerpt) + "\n```\n"


def smoke_output() -> str:
    """``whichdevice smoke``: its progress (stderr) and summary (stdout); figures vary per run and machine."""
    out, err = _command("smoke")
    progress = [line for line in err.splitlines() if line.startswith("[")]
    return "```text\n" + "\n".join([*progress, *out.splitlines()]) + "\n```\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "env-variables": env_table,
    "simulate-grammar": simulate_grammar,
    "gaudi3-report": gaudi3_report,
    "smoke-output": smoke_output,
}
# Parts whose figures (timings, speeds) change from run to run, and whose decisions (dtype, attention,
# precision flags) change from machine to machine (a CPU with or without native bf16, its measured
# calibration): compared with every number and every such decision masked, so that what is checked
# is the output's form.
VARYING = frozenset({"smoke-output"})
_DECISIONS = (
    r"(?<!\w)(?:attention left to transformers|bfloat#|float#|whichdevice_sdpa|sdpa|eager|flash_attention_#"
    r"|True|False)(?!\w)"
)


def mask(text: str) -> str:
    return re.sub(_DECISIONS, "?", re.sub(r"[0-9]+(?:[.,][0-9]+)*", "#", text))


def drifted_parts(text: str) -> list[str]:
    """The names of the generated parts of a page that no longer match what the code produces."""
    drifted = []
    for match in _PART.finditer(text):
        name, body = match.group("name"), match.group("body")
        fresh = GENERATORS[name]()
        if (mask(fresh) != mask(body)) if name in VARYING else (fresh != body):
            drifted.append(name)
    return drifted


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
        if "--check" in argv:
            drifted += [f"{page.relative_to(ROOT).as_posix()} ({name})" for name in drifted_parts(text)]
            continue
        fresh = regenerate(text)
        if fresh != text:
            drifted.append(page.relative_to(ROOT).as_posix())
            page.write_text(fresh, encoding="utf-8")
    verb = "differ from the code" if "--check" in argv else "regenerated"
    print(f"{verb}: {', '.join(drifted) if drifted else 'nothing'}")
    return 1 if drifted and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
