"""NVIDIA machines on ARM64 (Jetson, DGX Spark, Grace): which one, and where their PyTorch comes from.

On an x86_64 machine ``pip install torch`` is the line for an NVIDIA GPU. On ARM64 it is not one
line: a Jetson takes the wheel NVIDIA builds for its JetPack release, a DGX Spark NVIDIA's PyTorch
container (or pytorch.org's CUDA 13 aarch64 wheels), a Grace server the CUDA aarch64 wheels PyPI
has carried since torch 2.11. The probe reads the host architecture and the Tegra release file
(``read_host``); ``nvidia_platform`` matches them, and the GPU names NVML or torch report, against
the rows below. The table is typed, so every row cites where its install line was read, and it
fails closed: an ARM64 machine no row names gets the ARM64 server row, an x86_64 machine none.
"""

from __future__ import annotations

import platform as _platform
import re
from collections.abc import Iterable

from whichdevice.core.frozen import NamedTuple
from whichdevice.core.records import ProbeResult, TraceStep

__all__ = [
    "ARM64",
    "HOSTS",
    "PLATFORMS",
    "TEGRA_RELEASE_FILE",
    "NvidiaPlatform",
    "install_line",
    "nvidia_platform",
    "platform_line",
    "platform_row",
    "platform_steps",
    "read_host",
    "tegra_release",
]

# platform.machine() on Linux: the hosts NVIDIA ships CUDA for (ARM64 servers and Jetson, x86_64, POWER).
ARM64 = "aarch64"
HOSTS = ("x86_64", ARM64, "ppc64le")

# Jetson Linux (L4T) writes its release here ("# R36 (release), REVISION: 4.3, ..."); no other
# NVIDIA machine has it. NVIDIA's Jetson PyTorch wheels are built per JetPack, which this names.
TEGRA_RELEASE_FILE = "/etc/nv_tegra_release"
_MAX_LINE = 200  # the file's first line is about 110 characters; anything longer is not that file

_JETSON_PAGE = "https://docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform/index.html"
_SPARK_PLAYBOOK = "https://github.com/NVIDIA/dgx-spark-playbooks/blob/main/nvidia/pytorch-fine-tune/README.md"
_AARCH64_WHEELS = (
    "PyTorch 2.11 publishes CUDA-enabled aarch64 Linux wheels on PyPI, as the PyTorch and vLLM post 'vLLM and "
    "PyTorch work together to improve the developer experience on aarch64' says (read at https://"
    "theneuralfeed.com/article/vllm-and-pytorch-work-together-to-improve-the-developer-experience-on-aarch64/k7voSkfH)"
)


class NvidiaPlatform(NamedTuple):
    """One row: how the machine is recognised, what its users install, and where that was read."""

    key: str  # in ProbeResult.platform and the --json report
    name: str
    names: str  # a regular expression over the GPU names NVML or torch report ("" : by the host alone)
    install: str
    source: str


PLATFORMS: tuple[NvidiaPlatform, ...] = (
    NvidiaPlatform(
        "jetson",
        "NVIDIA Jetson",
        "",  # recognised by the Tegra release file, not a name: torch reports "Orin", NVML is absent
        f"the torch wheel NVIDIA builds for this JetPack release, from {_JETSON_PAGE}",
        f"NVIDIA, 'Installing PyTorch for Jetson Platform' ({_JETSON_PAGE}); the wheels are per JetPack "
        "release (forums.developer.nvidia.com/t/pytorch-for-jetson/72048)",
    ),
    NvidiaPlatform(
        "dgx-spark",
        "NVIDIA DGX Spark (GB10 Grace Blackwell)",
        r"\bGB10\b",
        "NVIDIA's PyTorch container (docker pull nvcr.io/nvidia/pytorch:25.11-py3), or pytorch.org's CUDA 13.0 "
        "aarch64 wheels: pip install torch --index-url https://download.pytorch.org/whl/cu130",
        f"NVIDIA's DGX Spark playbook 'Fine-tune with Pytorch' ({_SPARK_PLAYBOOK}, 12/16/2025) pulls "
        "nvcr.io/nvidia/pytorch:25.11-py3; the cu130 index for aarch64 as the DGX Spark stack matrix of "
        "wshobson/agents (plugins/dgx-spark-ops) lists it",
    ),
    NvidiaPlatform(
        "grace",
        "NVIDIA Grace Hopper / Grace Blackwell",
        r"\b(GH200|GB200|GB300)\b",  # the Grace superchips by name: another part is no Grace
        "pip install 'torch>=2.11' (CUDA-enabled aarch64 wheels on PyPI from 2.11; before it, pip install torch "
        "--index-url https://download.pytorch.org/whl/cu128)",
        _AARCH64_WHEELS,
    ),
    NvidiaPlatform(
        "aarch64",
        "an ARM64 (aarch64) server with NVIDIA GPUs",
        "",
        "pip install 'torch>=2.11' (CUDA-enabled aarch64 wheels on PyPI from 2.11; before it, pip install torch "
        "--index-url https://download.pytorch.org/whl/cu128)",
        _AARCH64_WHEELS,
    ),
)
_BY_KEY = {row.key: row for row in PLATFORMS}


def read_host() -> tuple[str, str | None]:
    """(platform.machine(), the first line of the Tegra release file or None): the probe's reading."""
    machine = _platform.machine()
    try:
        with open(TEGRA_RELEASE_FILE, encoding="utf-8", errors="replace") as fh:
            line = fh.readline(_MAX_LINE + 1).strip()
    except OSError:
        return machine, None
    return machine, line[:_MAX_LINE] or None


def tegra_release(line: str | None) -> str | None:
    """ "R36.4.3" from "# R36 (release), REVISION: 4.3, ..." (Jetson Linux's release, which names the
    JetPack); None when the line says no release."""
    match = re.search(r"\bR(\d{2,3}) \(release\), REVISION: (\d{1,3}(?:\.\d{1,3}){0,2})\b", line or "")
    return f"R{match.group(1)}.{match.group(2)}" if match else None


def nvidia_platform(machine: str, tegra: str | None, names: Iterable[str | None]) -> NvidiaPlatform | None:
    """The row for this machine: the Tegra release file makes it a Jetson; on ARM64 a GPU name picks
    DGX Spark or Grace, else the ARM64 server row; None on any other host (x86_64's line is torch's own)."""
    if machine != ARM64:
        return None
    if tegra is not None:
        return _BY_KEY["jetson"]
    for row in PLATFORMS:
        if row.names and any(name and re.search(row.names, name) for name in names):
            return row
    return _BY_KEY["aarch64"]


def platform_row(key: str | None) -> NvidiaPlatform | None:
    """The row ``key`` names (a replayed report's value is looked up, never printed as given)."""
    return _BY_KEY.get(key or "")


def install_line(row: NvidiaPlatform, l4t: str | None = None) -> str:
    """What to install on ``row``'s machines, naming a Jetson's Jetson Linux release where it was read."""
    if row.key == "jetson" and l4t is not None and re.fullmatch(r"R\d{2,3}(\.\d{1,3}){0,3}", l4t):
        return row.install.replace("this JetPack release", f"this JetPack release (Jetson Linux {l4t})")
    return row.install


def platform_line(row: NvidiaPlatform, gpu: str | None, l4t: str | None = None) -> str:
    """The trace line: which machine this is, its install line and the line's source."""
    what = row.name + (f" ({gpu})" if gpu else "")
    return f"{what}, {ARM64}: PyTorch for it: {install_line(row, l4t)} (source: {row.source})"


def platform_steps(result: ProbeResult) -> list[TraceStep]:
    """The chosen device's platform line for the trace (none off ARM64, or for a replayed key no row has)."""
    row = platform_row(result.platform)
    if row is None:
        return []
    gpu = next((d.name for d in result.devices if d.name), None)
    return [TraceStep("platform", platform_line(row, gpu, result.versions.get("jetson-linux")))]
