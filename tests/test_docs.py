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
    synopsis = re.search(r"```text\n(whichdevice .*?)```", text, re.S)
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
