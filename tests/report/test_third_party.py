"""Third-party noise: bitsandbytes fetching a Hub kernel on import, named where the installed stack does it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import jsonschema
import pytest

from steering import STEERING
from whichdevice.core.packages import package_version, simulated_packages
from whichdevice.hardware.probes.cpu_facts import cpu_facts
from whichdevice.report.gather import gather, load_schema
from whichdevice.report.third_party import AVX512_BF16, bitsandbytes_hub_kernel, third_party_warnings

BNB = package_version("bitsandbytes")
needs_bnb = pytest.mark.skipif(BNB is None, reason="bitsandbytes is not installed")


@pytest.fixture(autouse=True)
def _read_again() -> Iterator[None]:
    bitsandbytes_hub_kernel.cache_clear()
    yield
    bitsandbytes_hub_kernel.cache_clear()


def _fake_bitsandbytes(root: Path, ops: str) -> None:
    package = root / "bitsandbytes"
    (package / "backends" / "cpu").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported to find out')\n")
    (package / "backends" / "cpu" / "ops.py").write_text(ops)


def test_the_fetch_is_read_from_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bitsandbytes(
        tmp_path,
        "if has_avx512bf16():\n"
        "    try:\n"
        "        from kernels import get_kernel\n"
        "        k = get_kernel('some-org/some-kernel', version=1)\n"
        "    except Exception as exc:\n"
        "        logger.warning('Failed to load CPU gemm_x from some-org: %s. Please ...', exc)\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    found = bitsandbytes_hub_kernel()
    assert found is not None and found.repo == "some-org/some-kernel"
    assert found.logged == "Failed to load CPU gemm_x from some-org"
    assert "bitsandbytes" not in sys.modules


def test_a_bitsandbytes_that_fetches_nothing_has_no_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bitsandbytes(tmp_path, "def gemv_4bit(A, B):\n    return A @ B\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    assert bitsandbytes_hub_kernel() is None


@needs_bnb
def test_the_installed_bitsandbytes_is_read_as_it_is() -> None:
    found = bitsandbytes_hub_kernel()
    ops = Path(metadata.distribution("bitsandbytes").locate_file("bitsandbytes/backends/cpu/ops.py"))
    source = ops.read_text(encoding="utf-8") if ops.is_file() else ""
    assert (found is not None) == ("get_kernel(" in source and "has_avx512bf16()" in source)
    if found is not None:
        assert f'"{found.repo}"' in source and found.logged in source


@needs_bnb
@pytest.mark.parametrize("flags", [AVX512_BF16, ""])
def test_the_report_names_it_on_a_cpu_with_the_flag(flags: str) -> None:
    report = gather(tasks=("inference",), simulate=[f"cpu,flags={flags}"])
    jsonschema.validate(report, load_schema())
    said = [w["message"] for w in report["warnings"] if w["source"] == "bitsandbytes"]
    if not flags or bitsandbytes_hub_kernel() is None:
        assert said == []
        return
    [message] = said
    found = bitsandbytes_hub_kernel()
    assert found is not None
    assert f"bitsandbytes {BNB}" in message and found.repo in message and AVX512_BF16 in message
    kernels = package_version("kernels")
    if kernels is not None:
        assert f"kernels {kernels}" in message and "pip uninstall kernels" in message
    else:
        assert "without the kernels package" in message


@needs_bnb
def test_this_cpu_gets_the_finding_by_its_own_flags() -> None:
    report = gather(tasks=("inference",))
    said = [w for w in report["warnings"] if w["source"] == "bitsandbytes"]
    expected = AVX512_BF16 in cpu_facts()[1] and bitsandbytes_hub_kernel() is not None
    assert bool(said) == expected


@needs_bnb
def test_what_it_says_follows_kernels_and_hf_hub_offline() -> None:
    from whichdevice.hardware.probing import probe_all
    from whichdevice.testing import simulate

    if bitsandbytes_hub_kernel() is None:
        pytest.skip("this bitsandbytes fetches nothing on import")
    with simulate(f"cpu,flags={AVX512_BF16}"):
        results = probe_all()
    versions = {"bitsandbytes": BNB, "kernels": "0.19.1"}
    [online] = third_party_warnings({}, results, versions)
    assert "downloads and runs" in online["message"] and "export HF_HUB_OFFLINE=1" in online["message"]
    [offline] = third_party_warnings({"HF_HUB_OFFLINE": "1"}, results, versions)
    assert "nothing is downloaded" in offline["message"] and "pip uninstall kernels" in offline["message"]
    [absent] = third_party_warnings({}, results, {"bitsandbytes": BNB, "kernels": None})
    assert "without the kernels package" in absent["message"]
    # A replayed machine's bitsandbytes is not the one whose source was read here: nothing said.
    assert third_party_warnings({}, results, {"bitsandbytes": "0.0.1", "kernels": None}) == []
    assert third_party_warnings({}, results, {"bitsandbytes": None}) == []


@needs_bnb
def test_a_simulated_bitsandbytes_version_says_nothing() -> None:
    with simulated_packages({"bitsandbytes": "0.0.1"}):
        report = gather(tasks=("inference",), simulate=[f"cpu,flags={AVX512_BF16}"])
    assert [w for w in report["warnings"] if w["source"] == "bitsandbytes"] == []


@needs_bnb
def test_the_finding_matches_what_importing_bitsandbytes_does() -> None:
    """The real import, offline: the line bitsandbytes logs appears exactly where the report says it does."""
    found = bitsandbytes_hub_kernel()
    env = {k: v for k, v in os.environ.items() if k not in STEERING} | {"HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", "import bitsandbytes"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    applies = found is not None and AVX512_BF16 in cpu_facts()[1]
    logged = found.logged if found is not None else "Failed to load CPU gemm_4bit_forward"
    assert (logged in proc.stderr) == applies, proc.stderr[-2000:]
