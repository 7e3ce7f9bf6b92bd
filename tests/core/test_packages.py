"""Installed versions read from metadata folders, and compared as PEP 440 orders them."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.version import Version

from whichdevice.core import packages
from whichdevice.core.packages import cache_clear, package_version, version_at_least, version_before


def _dist(folder: Path, name: str, version: str) -> None:
    meta = folder / f"{name}-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nbody\n")


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.setattr(sys, "path", [str(first), str(second), *sys.path])
    cache_clear()
    yield first, second
    cache_clear()


RELEASES = ["0", "1", "4.57", "4.57.0", "4.57.0.0", "4.57.1", "4.9", "4.10", "5.25.0", "10.0", "2.13.0", "02.13"]
OTHERS = ["4.57.0rc1", "4.57.0.dev0", "2.13.0+cpu", "2.13.0+cu130", "4.57.post1", "1!1.0", "5.0.0a1"]


@pytest.mark.parametrize(("text", "limit"), list(itertools.product(RELEASES + OTHERS, RELEASES + OTHERS)))
def test_comparison_orders_as_packaging_does(text: str, limit: str) -> None:
    # The plain-release fast path and packaging must never disagree.
    a, b = Version(text), Version(limit)
    assert version_before(text, limit) is (a < b)
    assert version_at_least(text, limit) is (a >= b)


def test_plain_releases_do_not_import_packaging() -> None:
    import subprocess

    code = (
        "import sys; from whichdevice.core.packages import version_before, transformers_problem\n"
        "assert version_before('4.9', '4.10') and not version_before('5.25.0', '4.57')\n"
        "transformers_problem()\n"
        "print('packaging' in sys.modules)\n"
    )
    src = str(Path(packages.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


def test_an_unparsable_version_compares_by_its_leading_numbers() -> None:
    assert version_before("2.6-custom-build", "2.7")
    assert not version_before("2.8-custom-build", "2.7")


def test_the_first_folder_on_sys_path_answers(on_path: tuple[Path, Path]) -> None:
    first, second = on_path
    _dist(second, "wd_probe_pkg", "2.0")
    _dist(first, "wd_probe_pkg", "1.0")
    assert package_version("wd-probe-pkg") == "1.0"  # PEP 503: one distribution, however spelled
    assert package_version("WD.Probe_Pkg") == "1.0"


def test_a_folder_is_listed_once_and_again_after_cache_clear(
    on_path: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = on_path
    listed: list[str] = []
    real = os.listdir

    def counting(folder: str) -> list[str]:
        listed.append(folder)
        return real(folder)

    monkeypatch.setattr(os, "listdir", counting)
    for name in ("wd_absent_a", "wd_absent_b", "wd_absent_c"):
        assert package_version(name) is None
    assert listed.count(str(first)) == 1
    # pip install in a notebook, then probing.clear_cache(): the new package shows up.
    _dist(first, "wd_absent_a", "3.1")
    assert package_version("wd_absent_a") is None  # still the cached answer
    cache_clear()
    assert package_version("wd_absent_a") == "3.1"
    assert listed.count(str(first)) == 2


def test_a_metadata_folder_without_a_version_is_passed_over(on_path: tuple[Path, Path]) -> None:
    first, second = on_path
    (first / "wd_broken-1.0.dist-info").mkdir()  # an interrupted install: no METADATA
    _dist(second, "wd_broken", "1.2")
    assert package_version("wd_broken") == "1.2"


def test_the_working_directory_on_sys_path_is_read_where_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _dist(one, "wd_cwd_pkg", "1.0")
    _dist(two, "wd_cwd_other", "2.0")
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    cache_clear()
    try:
        monkeypatch.chdir(one)
        assert package_version("wd_cwd_pkg") == "1.0"
        monkeypatch.chdir(two)  # a notebook's os.chdir: "" is now another folder
        assert package_version("wd_cwd_other") == "2.0"
    finally:
        cache_clear()


def test_pyproject_floors_are_the_ones_the_code_checks() -> None:
    """pyproject.toml's floors beside the constants that check them at run time: a floor raised in
    one place and not the other would install a version the code then calls too old (or accept one
    it cannot run)."""
    import re

    from packaging.requirements import Requirement

    from whichdevice.hardware.probes import hpu
    from whichdevice.report import findings

    root = Path(__file__).resolve().parents[2]
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block is not None
    floors = {}
    for line in re.findall(r'^\s*"([^"]+)"', block.group(1), re.M):
        req = Requirement(line)
        (spec,) = [s for s in req.specifier if s.operator == ">="]
        floors[req.name] = Version(spec.version)
    assert floors["transformers"] == Version(packages.MIN_TRANSFORMERS)
    # torch is declared, with the floor checked at run time (packages.torch_problem, issue 58).
    assert floors["torch"] == Version(packages.MIN_TORCH)
    assert floors["accelerate"] == Version(hpu._MIN_ACCELERATE) == Version(findings.ACCELERATE_MIN_FOR_GAUDI)
    # The nox session that runs the oldest transformers pins a release of that floor.
    pin = re.search(r'"transformers==([\w.]+)"', (root / "noxfile.py").read_text(encoding="utf-8"))
    assert pin is not None and Version(pin.group(1)).release[:2] == floors["transformers"].release[:2]
    # This environment is inside every floor (the suite runs against what pyproject allows).
    for name, floor in floors.items():
        installed = package_version(name)
        assert installed is not None and Version(installed) >= floor, name
