"""The documentation: it builds with ``mkdocs build --strict`` and covers every backend in the registry."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import whichdevice as wd

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"


def _nav_pages(nav: Any) -> list[str]:
    """Every Markdown path in a mkdocs nav, however deeply nested."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _nav() -> list[str]:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(MKDOCS_YML.read_text(encoding="utf-8"))
    return _nav_pages(config["nav"])


def _page(backend: wd.Backend) -> str:
    return f"backends/{backend.docs or backend.name}.md"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(MKDOCS_YML)]
    proc = subprocess.run(
        [*command, "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").is_file()
    for backend in wd.backends():
        built = site / "backends" / (backend.docs or backend.name) / "index.html"
        assert built.is_file(), f"no built page for backend {backend.name!r} at {built}"


def test_every_backend_has_a_page_in_the_nav() -> None:
    nav = _nav()
    for backend in wd.backends():
        page = _page(backend)
        assert (DOCS / page).is_file(), f"backend {backend.name!r} has no page docs/{page}"
        assert page in nav, f"docs/{page} (backend {backend.name!r}) is not linked from the nav in mkdocs.yml"


def test_every_nav_entry_exists() -> None:
    for page in _nav():
        assert (DOCS / page).is_file(), f"mkdocs.yml nav names docs/{page}, which does not exist"


@pytest.mark.parametrize("backend", wd.backends(), ids=lambda b: b.name)
def test_backend_page_states_the_registry_facts(backend: wd.Backend) -> None:
    # The pages are written by hand; this catches a registry change the page did not follow.
    text = (DOCS / _page(backend)).read_text(encoding="utf-8")
    expected = [f"`{backend.name}", backend.package, *backend.visible_devices_env]
    expected += [f"`{d.name}=" for d in backend.env_defaults]
    if backend.distributed_backend:
        expected.append(f"`{backend.distributed_backend}`")
    expected += [f"`{b}`" for b in backend.other_distributed_backends]
    if backend.compile_backend:
        expected.append(f"`{backend.compile_backend}`")
    if backend.kernels_key:
        expected.append(f"`{backend.kernels_key}`")
    expected.append(f'simulate("{backend.name}')
    missing = [fact for fact in expected if fact not in text]
    assert not missing, f"docs/{_page(backend)} does not mention {missing} (from the registry record)"
    auto_row = re.search(r'\| `device_map="auto"` \| (\S+)', text)
    assert auto_row, f'docs/{_page(backend)} has no device_map="auto" row'
    says_yes = auto_row.group(1).strip("*:") == "yes"
    assert says_yes == backend.device_map_auto, (
        f'docs/{_page(backend)}: device_map="auto" row disagrees with the registry'
    )


def test_cli_reference_covers_every_option() -> None:
    cli = pytest.importorskip("whichdevice.cli_parser")
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    parser = cli.build_parser()
    options: set[str] = set()
    subparsers = [parser]
    for action in parser._actions:
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict):
            for name, sub in choices.items():
                assert f"whichdevice {name}" in text or name == "report", f"docs/cli.md does not describe {name!r}"
                subparsers.append(sub)
    for sub in subparsers:
        for action in sub._actions:
            options.update(o for o in action.option_strings if o.startswith("--") and o != "--help")
    missing = sorted(o for o in options if f"`{o}" not in text)
    assert not missing, f"docs/cli.md does not document {missing}"


def _schema_properties(node: Any) -> set[str]:
    names: set[str] = set()
    if isinstance(node, dict):
        properties = node.get("properties")
        if isinstance(properties, dict):
            names.update(properties)
        for value in node.values():
            names |= _schema_properties(value)
    elif isinstance(node, list):
        for item in node:
            names |= _schema_properties(item)
    return names


def test_json_schema_page_covers_every_field() -> None:
    import json

    schema_file = ROOT / "src" / "whichdevice" / "report_schema.json"
    if not schema_file.is_file():
        pytest.skip("no report_schema.json")
    text = (DOCS / "json-schema.md").read_text(encoding="utf-8")
    fields = _schema_properties(json.loads(schema_file.read_text(encoding="utf-8")))
    missing = sorted(f for f in fields if f"`{f}`" not in text and f'"{f}"' not in text)
    assert not missing, f"docs/json-schema.md does not describe {missing} (fields of report_schema.json)"


def test_the_command_synopsis_names_every_option() -> None:
    """Issue 46: the synopsis in docs/cli.md left out the report's model options. Every option the
    parser takes, of every subcommand, is named there."""
    import argparse
    import re

    from whichdevice.cli_parser import build_parser

    options: set[str] = set()
    commands: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                commands.update(action.choices)
                for sub in action.choices.values():
                    walk(sub)
            options.update(o for o in action.option_strings if o.startswith("--") and o != "--help")

    walk(build_parser())
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    synopsis = re.search(r"```text[^\n]*\n(whichdevice .*?)```", text, re.S)
    assert synopsis is not None
    named = set(re.findall(r"--[a-z][a-z-]*", synopsis.group(1)))
    assert sorted(options - named) == []
    assert all(re.search(rf"^whichdevice \[?{c}\b", synopsis.group(1), re.M) for c in commands)


def test_the_tiny_llama_recipe_and_the_test_fixture_build_the_same_model(tmp_path: Path, monkeypatch) -> None:
    """Issue 46: the fixture added a tokenizer the docs never mentioned. docs/end-to-end.md's recipe and
    tests/tiny_models.py build the same config and the same tokenizer."""
    import json

    from tiny_models import save_tiny_llama

    text = (ROOT / "docs" / "end-to-end.md").read_text(encoding="utf-8")
    recipe = re.search(r"```python\n(from tokenizers import .*?)```", text, re.S)
    assert recipe is not None
    monkeypatch.chdir(tmp_path)
    exec(compile(recipe.group(1), "end-to-end.md recipe", "exec"), {})  # the page's own code
    fixture = save_tiny_llama(tmp_path / "fixture")
    ignored = {"transformers_version", "dtype", "torch_dtype"}
    for name in ("config.json", "tokenizer.json"):
        mine = json.loads((tmp_path / "tiny-llama" / name).read_text())
        theirs = json.loads((fixture / name).read_text())
        if name == "config.json":
            mine, theirs = ({k: v for k, v in d.items() if k not in ignored} for d in (mine, theirs))
        assert mine == theirs, name


def test_the_extras_table_names_what_each_extra_brings() -> None:
    """Issue 58: install.md's row for the `test` extra left out deepspeed. Each row's packages are the
    extra's requirements in pyproject.toml, no more and no fewer."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    text = (DOCS / "install.md").read_text(encoding="utf-8")
    for extra, requirements in extras.items():
        row = re.search(rf"^\| `{re.escape(extra)}` \| (?P<brings>[^|]*) \|", text, re.M)
        assert row, f"docs/install.md has no row for the {extra!r} extra"
        wanted = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in requirements}  # type: ignore[union-attr]
        named = {name.lower() for name in re.findall(r"`([^`]+)`", row.group("brings"))}
        assert named == wanted, (
            f"docs/install.md's {extra!r} row names {sorted(named)}, pyproject.toml {sorted(wanted)}"
        )


def test_what_accelerates_estimate_leaves_out_is_what_placement_md_says(tmp_path: Path, monkeypatch) -> None:
    """Issue 58: placement.md said `accelerate estimate-memory` leaves out the input embedding. Run its
    own model builder and sizer on a tiny Llama (untied head): it leaves out the output head."""
    from types import SimpleNamespace

    from accelerate.commands import estimate
    from accelerate.utils import calculate_maximum_sizes
    from transformers import LlamaForCausalLM

    from tiny_models import tiny_config

    config = tiny_config(tie_word_embeddings=False)
    config.save_pretrained(tmp_path)
    # Its Hub check only: the rest of create_empty_model runs as `accelerate estimate-memory` runs it.
    monkeypatch.setattr(estimate, "verify_on_hub", lambda *a, **k: SimpleNamespace(config={}))
    model = estimate.create_empty_model(str(tmp_path), library_name="transformers")
    total, _ = calculate_maximum_sizes(model)
    whole = LlamaForCausalLM(config)  # float32, as estimate builds it
    head = whole.lm_head.weight.numel() * 4
    names = {name for name, _ in model.named_parameters()}
    assert calculate_maximum_sizes(whole)[0] - total == head and not any("lm_head" in n for n in names)
    assert any("embed_tokens" in n for n in names)
    text = " ".join((DOCS / "placement.md").read_text(encoding="utf-8").split())
    assert "Its total is the headers' less the output head" in text
    assert "less the input embedding" not in text


@pytest.mark.parametrize(
    ("argv", "code", "named"),
    [
        (["check", "gpu"], 2, "an unknown device name"),
        (["check", "cuda:x", "--simulate", "cuda:2"], 2, "a malformed index"),
        (["check", "cuda:5", "--simulate", "cuda:2"], 1, "an index past its devices"),
    ],
    ids=["unknown-name", "malformed-index", "index-past-the-devices"],
)
def test_the_readme_says_the_exit_code_a_bad_device_gets(argv: list[str], code: int, named: str) -> None:
    """Issue 58: the README's table said bad input exits 2, but an index past the devices exits 1, as the
    exit-code policy (docs/cli.md#exit-codes: 1 the hardware cannot do it, 2 the request is wrong) says."""
    proc = subprocess.run(
        [sys.executable, "-m", "whichdevice", *argv], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == code, proc.stderr
    row = re.search(r"^\| bad input \|(?P<row>.*)$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M)
    assert row is not None
    # "exits 2 for a wrong request (..., NAMED, ...)": the example in the parentheses after its code.
    said = re.search(rf"\b{code} for [^(;|]*\([^)]*\b{re.escape(named)}\b[^)]*\)", row.group("row"))
    assert said, f"README.md's bad-input row does not say that {named} exits {code}: {row.group('row')}"
    policy = re.search(rf"^\| {code} \|(?P<row>.*)$", (DOCS / "cli.md").read_text(encoding="utf-8"), re.M)
    assert policy is not None and f"`{argv[1]}`" in policy.group("row"), "docs/cli.md#exit-codes names no example"


def test_the_performance_figures_come_from_one_place() -> None:
    """Issue 58: performance.md said in three ways where its figures came from, and they disagreed with
    benchmarks/latest.json. Its first table is generated from that file (test_docs_api's drift test
    compares them); every other figure before "Runs without a file" names a results file that exists;
    the README's cost-of-asking figures are latest.json's."""
    import json

    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    head, _, history = text.partition("## Runs without a file")
    assert history, "docs/performance.md has no 'Runs without a file' section"
    assert "<!-- generated:performance-latest -->" in head
    assert "no file kept" not in head, "a figure without a file above 'Runs without a file'"
    named = re.findall(r"`(benchmarks/[^`\s]+)`", head)
    assert "benchmarks/latest.json" in named
    assert [path for path in named if not (ROOT / path).exists()] == []
    run = json.loads((ROOT / "benchmarks" / "latest.json").read_text(encoding="utf-8"))
    results = {row["result"] for row in run["rows"]}
    row = re.search(r"^\| cost of asking \|(?P<row>.*)$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M)
    assert row is not None and "`benchmarks/latest.json`" in row.group("row")
    figures = re.findall(r"[0-9]+\.[0-9]+x", row.group("row"))
    assert figures and [f for f in figures if f not in results] == [], (figures, sorted(results))


def test_the_mixtral_decode_limits_on_placement_md_are_what_the_code_computes(tmp_path: Path, monkeypatch) -> None:
    """Issue 58: placement.md's Mixtral table gave 51 tokens/s on an H200, priced over every weight; the
    code prices a token's read as the shared weights and its routed experts' share (183). The page's
    rows are the code's, for the same machines, from the same header-faithful Hub fixture."""
    from hub_server import docs_hub
    from whichdevice.report.plan import DEFAULT_MACHINES, plan_hardware

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("WHICHDEVICE_CALIBRATION", "off")
    text = (DOCS / "placement.md").read_text(encoding="utf-8")
    heading = "mistralai/Mixtral-8x7B-v0.1, inference, batch 1 x 4096"
    assert heading in text, "docs/placement.md has no Mixtral inference table headed as hub_plans.py prints it"
    table = text.split(heading, 1)[1].split("\n\n", 2)[1]
    machines = [(name, spec) for name, spec in DEFAULT_MACHINES if name in ("H100", "H200", "MI300X")]
    with docs_hub():
        plan = plan_hardware("mistralai/Mixtral-8x7B-v0.1", batch_size=1, max_length=4096, machines=machines)
    computed = [line for line in plan.table().splitlines() if line.startswith(("| H100 |", "| H200 |", "| MI300X |"))]
    assert any(row.startswith("| H200 |") for row in computed), plan.table()
    page = table.splitlines()
    missing = [row for row in computed if row not in page]
    assert not missing, f"docs/placement.md's Mixtral table differs from the code's rows: {missing}"
