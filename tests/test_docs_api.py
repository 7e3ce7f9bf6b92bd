"""docs/api.md against the code: every public name and record field, every variable read, the generated parts.

Also the version, which is written once (``whichdevice.__version__``) and read from there by
pyproject.toml and CHANGELOG.md.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.training.lora import LoraTraining

ROOT = Path(__file__).resolve().parent.parent
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
sys.path.insert(0, str(ROOT / "docs"))
import generate  # noqa: E402  (docs/generate.py: the generated parts of the pages)

RECORDS = (wd.Resolution, wd.Backend, wd.ProbeResult, wd.DeviceInfo, LoraTraining)
# A read of the environment: os.environ.get(X), os.environ[X], os.getenv(X), environ().get(X), read_env((X, ...)).
_READ = re.compile(r"(?:environ(?:\(\))?\.get\(|environ\[|getenv\()\s*(?P<name>[\"'][A-Z0-9_]+[\"']|[A-Z][A-Z0-9_]+)")
_CONSTANT = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]+)\s*(?::\s*\w+\s*)?=\s*[\"'](?P<value>[A-Z0-9_]+)[\"']", re.M)


def _documented(name: str) -> bool:
    return any(form in API for form in (f"`{name}", f"wd.{name}", f".{name}`", f".{name}("))


@pytest.mark.parametrize("name", wd.__all__)
def test_every_public_name_is_documented(name: str) -> None:
    assert _documented(name), f"whichdevice.{name} is public (in __all__) but docs/api.md does not mention it"


def test_every_public_name_is_importable() -> None:
    for name in wd.__all__:
        assert getattr(wd, name) is not None


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_every_field_of_the_public_records_is_documented(record: type) -> None:
    fields = [f.name for f in dataclasses.fields(record) if not f.name.startswith("_")]
    missing = [name for name in fields if f"`{name}`" not in API and f"`{name}`," not in API]
    assert not missing, f"docs/api.md does not describe {record.__name__} fields {missing}"


def test_generated_parts_match_the_code() -> None:
    # Sample outputs with timings (smoke) are compared with their numbers masked.
    drifted = {
        page.relative_to(ROOT).as_posix(): parts
        for page in generate.pages()
        if (parts := generate.drifted_parts(page.read_text(encoding="utf-8")))
    }
    assert not drifted, f"{drifted} differ from what the code generates: run python docs/generate.py"


def _variables_read() -> dict[str, str]:
    """Every environment variable src/ reads by name -> the file that reads it."""
    sources = sorted((ROOT / "src" / "whichdevice").rglob("*.py"))
    constants: dict[str, str] = {}
    for source in sources:
        constants.update(dict(_CONSTANT.findall(source.read_text(encoding="utf-8"))))
    read: dict[str, str] = {}
    for source in sources:
        for match in _READ.finditer(source.read_text(encoding="utf-8")):
            token = match.group("name")
            name = token.strip("\"'") if token[0] in "\"'" else constants.get(token)
            if name:
                read.setdefault(name, source.relative_to(ROOT).as_posix())
    return read


def test_the_environment_tables_name_every_variable_the_code_reads() -> None:
    read = _variables_read()
    assert "WHICHDEVICE_DEVICE" in read and "WHICHDEVICE_PROBE_TIMEOUT" in read, "the scan found nothing"
    missing = {name: where for name, where in read.items() if f"`{name}`" not in API}
    assert not missing, f"src/ reads {missing}, which docs/api.md#environment-variables does not name"


def test_every_declared_variable_is_in_the_generated_table() -> None:
    table = generate.env_table()
    for name in generate.declared_variables():
        assert f"`{name}`" in table


def test_the_version_is_written_once() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M), "pyproject.toml types a version"
    assert 'version = { attr = "whichdevice.__version__" }' in pyproject
    assert not re.search(r'^version = "', pyproject, re.M)
    init = (ROOT / "src" / "whichdevice" / "__init__.py").read_text(encoding="utf-8")
    assert len(re.findall(r"^__version__ = ", init, re.M)) == 1


def test_installed_metadata_agrees_with_the_package() -> None:
    try:
        installed = importlib.metadata.version("whichdevice")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("whichdevice is not installed (only on PYTHONPATH)")
    assert installed == wd.__version__, "reinstall (pip install -e .): the metadata is from another version"


def test_the_changelog_names_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{wd.__version__}]" in changelog, f"CHANGELOG.md has no section for {wd.__version__}"
    assert "## [Unreleased]" in changelog


@pytest.mark.parametrize("function", ["resolve_device", "training_arguments", "lora_training", "probe"])
def test_documented_signatures_name_the_real_parameters(function: str) -> None:
    match = re.search(rf"wd\.{function}\((?P<params>[^)]*)\)", API)
    assert match, f"docs/api.md has no signature for wd.{function}"
    documented = {
        p.split("=")[0].strip().lstrip("*") for p in match.group("params").split(",") if p.strip() not in ("*", "")
    }
    documented.discard("")
    real = set(inspect.signature(getattr(wd, function)).parameters)
    assert documented == real, f"wd.{function}: docs say {sorted(documented)}, code has {sorted(real)}"


def test_every_simulate_key_has_a_row_in_the_spec_table() -> None:
    from whichdevice.testing import spec

    keys = [*spec._DETAIL_KEYS, *spec._COMMON_KEYS, *spec.MODES]
    missing = [key for key in keys if f"| `{key}=`" not in API and f"| `{key}`" not in API and f"`{key}=`" not in API]
    assert not missing, f"docs/api.md#spec-grammar has no row for simulate keys {missing}"
