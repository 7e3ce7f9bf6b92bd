"""Regenerate the parts of the docs that the code produces: ``python docs/generate.py`` (``--check`` to compare).

A generated part sits between ``<!-- generated:NAME -->`` and ``<!-- /generated -->``; the text in
between is whatever ``GENERATORS[NAME]()`` returns. tests/test_docs_api.py fails when a page has
drifted from the code; this script mends it. A sample whose figures change from run to run (the
smoke output's timings) is rewritten only when its form changed, so a regeneration does not churn;
``--refresh-samples`` rewrites those too.
"""

from __future__ import annotations

import argparse
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
    # Up to the Gaudi row: the CPU row below it is the machine that printed it, not the simulated one.
    head = next(i for i, line in enumerate(lines) if line.startswith("  + hpu")) + 1
    excerpt = [*lines[:head], "  ...", *lines[start : start + 5], "  ..."]
    command = " ".join(f'"{a}"' if "," in a else a for a in args)
    return f"```text\n$ whichdevice {command}\n" + "\n".join(excerpt) + "\n```\n"


def check_json() -> str:
    """``whichdevice check --json`` on a simulated 8 x H200, as json-schema.md shows it."""
    args = ("check", "cuda", "--min-devices", "8", "--simulate", "cuda:8,name=NVIDIA H200,cc=9.0,mem=141GiB", "--json")
    return _json_sample(args)


def error_json() -> str:
    """``whichdevice check gpu --json``: the object a command prints when it fails before its own."""
    return _json_sample(("check", "gpu", "--json"))


def _json_sample(args: tuple[str, ...]) -> str:
    command = " ".join(f'"{a}"' if "," in a or " " in a else a for a in args)
    return f"```text\n$ whichdevice {command}\n{_command(*args)[0].rstrip()}\n```\n"


def smoke_output() -> str:
    """``whichdevice smoke``: its progress (stderr) and summary (stdout), headed by the machine that
    printed it; figures vary per run and machine."""
    out, err = _command("smoke")
    progress = [line for line in err.splitlines() if line.startswith("[")]
    machine = f"$ whichdevice smoke    # printed on: {_machine()}"
    return "```text\n" + "\n".join([machine, *progress, *out.splitlines()]) + "\n```\n"


def _machine() -> str:
    """This machine as its output depends on it: the CPU, its bf16 flags, its cores and torch."""
    import os

    import torch

    from whichdevice.hardware.probes.cpu_facts import BF16_CPU_FLAGS, cpu_facts

    name, flags, _ = cpu_facts()
    bf16 = sorted(flags & BF16_CPU_FLAGS)
    native = f"native bf16 ({', '.join(bf16)})" if bf16 else "no native bf16"
    return f"{name or 'a CPU'}, {os.cpu_count()} cores, {native}, torch {torch.__version__}"


def readme_explain() -> str:
    """``res.explain()`` for a 1.1B Llama (a config: nothing to download) on a simulated CPU with native
    bf16, as the README shows it; numbers and versions vary with the installed stack."""
    code = (
        "import whichdevice as wd\n"
        "from transformers import LlamaConfig\n"
        "from whichdevice.testing import simulate\n"
        "config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,\n"
        "    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, dtype='bfloat16')\n"
        "with simulate('cpu,flags=avx512_bf16,name=a CPU with native bf16,mem=64GiB,free=60GiB'):\n"
        "    print(wd.resolve_device(model=config).explain())\n"
    )
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WHICHDEVICE_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    # The backends not chosen say only that they are absent on the simulated machine: one line for them.
    lines = [line for line in out.splitlines() if "not present on the simulated machine" not in line]
    lines.insert(2, "  - ...          (the other backends: not present on the simulated machine)")
    return "```text\n" + "\n".join(lines) + "\n```\n"


def detection_order() -> str:
    """The registry's declared detection order, as ``wd.backends()`` returns it."""
    import whichdevice

    return "```text\n" + ", ".join(backend.name for backend in whichdevice.backends()) + "\n```\n"


def performance_latest() -> str:
    """docs/performance.md's first table: benchmarks/latest.json's rows with a target, and the resolved
    load against transformers' default, headed by the run's machine, date and commit."""
    import json

    run = json.loads((ROOT / "benchmarks" / "latest.json").read_text(encoding="utf-8"))
    machine, versions = run["machine"], run["machine"]["versions"]
    cpu = machine["cpu"]
    flags = ", ".join(name for name, on in cpu["flags"].items() if on) or "none of the listed flags"
    head = (
        f"From `benchmarks/latest.json`: a {run['mode']} run ({', '.join(run['sections'])}) started "
        f"{run['started'][:16].replace('T', ' ')} UTC at commit {machine['git']['commit']}, on {cpu['model']} "
        f"({cpu['cores']} cores; {flags}), torch {versions['torch']}, transformers {versions['transformers']}.\n\n"
    )
    columns = ("target", "measure", "baseline", "measured", "result", "spread", "threshold", "verdict")
    rows = ["| row | measure | baseline | measured | result | noise (p25..p75) | target | verdict |"]
    rows.append("|" + "---|" * len(columns))
    for row in run["rows"]:
        if row["verdict"] == "info" and "transformers default" not in row["measure"]:
            continue
        rows.append("| " + " | ".join(str(row[c]).replace("|", "\\|") or " " for c in columns) + " |")
    return head + "\n".join(rows) + "\n"


HUB_PLANS = "benchmarks/results-58/hub_plans.txt"


def hub_plans() -> str:
    """placement.md's large-model figures: the printout of ``benchmarks/hub_plans.py --only hub`` kept in
    HUB_PLANS, without its machine lines and its "this machine" rows (they describe the CPU that ran it,
    not the reader's)."""
    lines = (ROOT / HUB_PLANS).read_text(encoding="utf-8").splitlines()
    kept = [
        line
        for line in lines
        if not line.startswith(("machine:", "         ", "| this machine |")) and not line.startswith("wrote ")
    ]
    while kept and not kept[0].strip():
        kept.pop(0)
    return "\n".join(kept).rstrip() + "\n"


def nox_sessions() -> str:
    """The nox sessions, as ``nox -l`` lists them: each session's name and its docstring's first line."""
    import ast

    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    rows = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "nox.session":
                names = [k.value for k in decorator.keywords if k.arg == "name"]
                name = names[0].value if names and isinstance(names[0], ast.Constant) else node.name
                doc = (ast.get_docstring(node) or "").splitlines()[0]
                rows.append(f"| `{name}` | {doc} |")
    return "| session | what it runs |\n|---|---|\n" + "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "env-variables": env_table,
    "simulate-grammar": simulate_grammar,
    "gaudi3-report": gaudi3_report,
    "smoke-output": smoke_output,
    "readme-explain": readme_explain,
    "nox-sessions": nox_sessions,
    "detection-order": detection_order,
    "check-json": check_json,
    "error-json": error_json,
    "performance-latest": performance_latest,
    "hub-plans": hub_plans,
}
# Parts whose figures (timings, speeds) change from run to run, and whose decisions (dtype, attention,
# precision flags) change from machine to machine (a CPU with or without native bf16, its measured
# calibration): compared with every number and every such decision masked, so that what is checked
# is the output's form.
VARYING = frozenset({"smoke-output", "readme-explain"})
_DECISIONS = (
    r"(?<!\w)(?:attention left to transformers|bfloat#|float#|whichdevice_sdpa|sdpa|eager|flash_attention_#"
    r"|True|False)(?!\w)"
)


def mask(text: str) -> str:
    text = re.sub(r"# printed on: .*", "# printed on: ?", text)  # the machine, which the block names
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


def regenerate(text: str, refresh_samples: bool = False) -> str:
    """The page with every generated part replaced by what its generator returns now.

    A part whose figures vary from run to run (VARYING) keeps its text when only the figures differ,
    unless ``refresh_samples``: rewriting it on every run would change the page with nothing to say.
    """

    def part(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise KeyError(f"no generator named {name!r} (known: {', '.join(GENERATORS)})")
        fresh, body = GENERATORS[name](), match.group("body")
        if name in VARYING and not refresh_samples and mask(fresh) == mask(body):
            fresh = body
        return f"{match.group(1)}{fresh}{match.group(4)}"

    return _PART.sub(part, text)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python docs/generate.py",
        description="Rewrite the parts of README.md and docs/ that the code produces "
        "(between <!-- generated:NAME --> and <!-- /generated -->).",
    )
    parser.add_argument("--check", action="store_true", help="compare only: exit 1 naming the parts that drifted")
    parser.add_argument(
        "--refresh-samples",
        action="store_true",
        help="also rewrite samples whose figures vary from run to run (smoke timings) when only figures differ",
    )
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)  # --help prints and exits here, before any page is read
    drifted = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if args.check:
            drifted += [f"{page.relative_to(ROOT).as_posix()} ({name})" for name in drifted_parts(text)]
            continue
        fresh = regenerate(text, refresh_samples=args.refresh_samples)
        if fresh != text:
            drifted.append(page.relative_to(ROOT).as_posix())
            page.write_text(fresh, encoding="utf-8")
    verb = "differ from the code" if args.check else "regenerated"
    print(f"{verb}: {', '.join(drifted) if drifted else 'nothing'}")
    return 1 if drifted and args.check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
