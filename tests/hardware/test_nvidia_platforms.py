"""NVIDIA on ARM64: the host read by the probe, the platform it and the GPU names make, and the install line said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice import report as wd_report
from whichdevice.core.records import DeviceInfo, ProbeResult
from whichdevice.hardware.probes import cuda
from whichdevice.hardware.probes import nvidia_platforms as platforms
from whichdevice.hardware.probes.common import DeviceReading
from whichdevice.hardware.probes.cuda import CudaReadings
from whichdevice.testing import simulate

ROOT = Path(__file__).resolve().parents[2]
JETSON_LINE = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8"
ROWS = {row.key: row for row in platforms.PLATFORMS}


def _platform_line(res: wd.Resolution) -> str:
    (line,) = [s.message for s in res.trace if s.topic == "platform"]
    return line


# ----------------------------------------------------------------- explain() per platform (the test)


@pytest.mark.parametrize(
    ("spec", "key", "install"),
    [
        ("cuda:1,name=NVIDIA GH200 480GB", "grace", "pip install 'torch>=2.11'"),
        ("cuda:1,name=Orin", "jetson", "the torch wheel NVIDIA builds for this JetPack release (Jetson Linux R36.4.3)"),
        ("cuda:1,name=NVIDIA GB10", "dgx-spark", "docker pull nvcr.io/nvidia/pytorch:25.11-py3"),
        ("cuda:2,host=aarch64", "aarch64", "pip install 'torch>=2.11'"),
    ],
    ids=["grace-hopper", "jetson", "dgx-spark", "arm64-server"],
)
def test_explain_names_the_platforms_install_line_and_its_source(spec: str, key: str, install: str) -> None:
    with simulate(spec):
        res = wd.resolve_device()
    assert res.device == "cuda:0" and res.probe.platform == key
    line = _platform_line(res)
    assert install in line and f"(source: {ROWS[key].source})" in line
    assert line in res.explain()
    assert wd.probe("cuda").platform is None  # out of the simulation: this x86_64 machine


def test_dgx_spark_and_jetson_lines_name_nvidias_own_sources() -> None:
    with simulate("cuda:1,name=NVIDIA GB10"):
        spark = _platform_line(wd.resolve_device())
    with simulate("cuda:1,name=Orin"):
        res = wd.resolve_device()
    jetson = _platform_line(res)
    assert "github.com/NVIDIA/dgx-spark-playbooks" in spark and "download.pytorch.org/whl/cu130" in spark
    assert "docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform" in jetson
    assert res.probe.versions["jetson-linux"] == "R36.4.3"
    assert res.probe.devices[0].capability == (8, 7)


def test_x86_64_gets_no_platform_line() -> None:
    for spec in ("cuda:1", "cuda:1,host=x86_64", "cuda:1,name=NVIDIA H100", "cuda:2,variant=rocm,host=aarch64"):
        with simulate(spec):
            res = wd.resolve_device()
        assert res.probe.platform is None and not [s for s in res.trace if s.topic == "platform"], spec


def test_a_cpu_only_torch_on_arm64_names_the_platforms_line_not_the_generic_one() -> None:
    for spec, install in (
        ("cuda:1,name=NVIDIA GH200 480GB,missing", "pip install 'torch>=2.11'"),
        ("cuda:1,name=Orin,missing", "install-pytorch-jetson-platform"),
        ("cuda:1,name=NVIDIA GB10,missing", "nvcr.io/nvidia/pytorch"),
    ):
        with simulate(spec):
            res = wd.resolve_device()
            result = wd.probe("cuda")
        assert res.device == "cpu" and not result.installed
        reason = result.reason or ""
        assert "CPU-only build" in reason and install in reason and "pytorch.org/get-started" not in reason
        assert install in res.explain()
    with simulate("cuda:1,missing"):
        assert wd.get_backend("cuda").install_command in (wd.probe("cuda").reason or "")


# ------------------------------------------------------------------------------------- interpretation


@pytest.mark.parametrize(
    ("machine", "tegra", "names", "key"),
    [
        ("aarch64", JETSON_LINE, ["Orin"], "jetson"),
        ("aarch64", JETSON_LINE, [None], "jetson"),  # NVML is absent on a Jetson: the file decides
        ("aarch64", None, ["NVIDIA GH200 480GB"], "grace"),
        ("aarch64", None, ["NVIDIA GB200"], "grace"),
        ("aarch64", None, ["NVIDIA GB300"], "grace"),
        ("aarch64", None, ["NVIDIA GB10"], "dgx-spark"),
        ("aarch64", None, ["NVIDIA A100-SXM4-80GB"], "aarch64"),
        ("aarch64", None, [], "aarch64"),
        ("x86_64", None, ["NVIDIA GH200 480GB"], None),  # a name alone never makes ARM64
        ("x86_64", JETSON_LINE, ["Orin"], None),
        ("ppc64le", None, ["Tesla V100-SXM2-16GB"], None),
        ("aarch64", None, ["NVIDIA GB100"], "aarch64"),  # not a Grace part: no row claims it
    ],
)
def test_the_host_and_the_names_pick_one_row(
    machine: str, tegra: str | None, names: list[str | None], key: str | None
) -> None:
    row = platforms.nvidia_platform(machine, tegra, names)
    assert (row.key if row else None) == key


def test_the_jetson_release_is_read_strictly() -> None:
    assert platforms.tegra_release(JETSON_LINE) == "R36.4.3"
    assert platforms.tegra_release("# R35 (release), REVISION: 3.1, GCID: 1") == "R35.3.1"
    for line in (None, "", "garbage", "# R36 (release), REVISION: x", "R3 (release), REVISION: 1"):
        assert platforms.tegra_release(line) is None
    # A hostile release line never reaches the install line as text: only the parsed release does.
    row = ROWS["jetson"]
    assert "\x1b" not in platforms.install_line(row, "R36.4\x1b[2J")
    assert platforms.install_line(row, "R36.4\x1b[2J") == row.install


def test_interpret_cuda_reports_platform_and_jetson_release() -> None:
    backend = wd.get_backend("cuda")
    readings = CudaReadings(
        installed=True,
        available=True,
        devices=(DeviceReading("Orin", 64 * 1024**3, (8, 7)),),
        initialized=True,
        torch_version="2.8.0",
        cuda_version="12.6",
        machine="aarch64",
        tegra=JETSON_LINE,
    )
    result = cuda.interpret_cuda(backend, readings)
    assert result.available and result.platform == "jetson" and result.versions["jetson-linux"] == "R36.4.3"
    assert result.to_dict()["platform"] == "jetson"
    on_x86 = cuda.interpret_cuda(backend, CudaReadings(**{**readings.__dict__, "machine": "x86_64", "tegra": None}))
    assert on_x86.platform is None and "jetson-linux" not in on_x86.versions


# ------------------------------------------------------------------------------------------ reading


def test_read_host_reads_the_machine_and_the_release_files_first_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "nv_tegra_release"
    release.write_text(JETSON_LINE + "\n# second line\n" + "x" * 10_000)
    monkeypatch.setattr(platforms, "TEGRA_RELEASE_FILE", str(release))
    monkeypatch.setattr(platforms._platform, "machine", lambda: "aarch64")
    assert platforms.read_host() == ("aarch64", JETSON_LINE)
    release.write_text("y" * 100_000)  # not that file: bounded, and no release read from it
    _, line = platforms.read_host()
    assert line is not None and len(line) <= 200 and platforms.tegra_release(line) is None
    release.unlink()
    assert platforms.read_host() == ("aarch64", None)


def test_the_real_probe_reads_this_hosts_architecture() -> None:
    import platform

    readings = cuda.read_cuda(wd.get_backend("cuda"))
    assert readings.machine == platform.machine()
    expected = Path(platforms.TEGRA_RELEASE_FILE).is_file()
    assert (readings.tegra is not None) == expected


# ------------------------------------------------------------------------------- the table and its report


def test_every_row_cites_a_source_and_the_docs_and_schema_name_every_key() -> None:
    docs = (ROOT / "docs" / "backends" / "cuda.md").read_text(encoding="utf-8")
    schema = json.loads((ROOT / "src" / "whichdevice" / "report_schema.json").read_text(encoding="utf-8"))
    enum = schema["$defs"]["backend_row"]["properties"]["platform"]["oneOf"][1]["enum"]
    assert enum == [row.key for row in platforms.PLATFORMS]
    for row in platforms.PLATFORMS:
        assert row.source and row.install and f"(`{row.key}`)" in docs
        urls = [word for word in (row.source + " " + row.install).split() if "." in word and "/" in word]
        assert urls, f"{row.key}: no address cited"


def test_a_replayed_report_keeps_the_platform_and_a_damaged_key_says_nothing(tmp_path: Path) -> None:
    report = json.loads(json.dumps(wd_report.gather(simulate=["cuda:1,name=NVIDIA GH200 480GB"])))
    with simulate("cuda:1,name=NVIDIA GH200 480GB"):
        line = _platform_line(wd.resolve_device())
    with simulate(report=report):
        assert _platform_line(wd.resolve_device()) == line
    rows = [dict(r) for r in report["backends"]]
    for row in rows:
        if row["name"] == "cuda":
            row["platform"] = "grace\x1b[2J; rm -rf /"
    damaged = {**report, "backends": rows}
    with simulate(report=damaged):
        res = wd.resolve_device()
    assert not [s for s in res.trace if s.topic == "platform"] and "rm -rf" not in res.explain()


def test_a_probe_result_without_a_platform_says_nothing() -> None:
    result = ProbeResult("cuda", True, True, 1, (DeviceInfo(0, "NVIDIA GH200 480GB"),))
    assert platforms.platform_steps(result) == []
    assert platforms.platform_steps(ProbeResult("cuda", True, True, platform="nonsense")) == []
