"""Whether the installed stack can run on this machine's hardware: the checks to make before a run.

Three mismatches that no device count shows, each turned into one sentence with its fix:

- the GPU's compute capability against the architectures the torch build has kernels for
  (``torch.cuda.get_arch_list()``): a new GPU on an old build fails at its first kernel with
  "no kernel image is available for execution on the device";
- the NVIDIA driver against the CUDA version the torch build was made with;
- torch against the torch a vendor plugin (torch_npu, habana's, torch_xla) was built for.

Everything here is pure: the probes read the facts and call these (``ProbeResult.incompatible``),
``whichdevice check`` fails on them, and ``simulate("cuda:1,cc=12.0,arch=sm_80+sm_90")`` feeds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

import re
from collections.abc import Iterable

from whichdevice.core.packages import pip_install

__all__ = [
    "MIN_DRIVER",
    "SAME_MINOR_PLUGINS",
    "arch_problem",
    "driver_problem",
    "kernels_cover",
    "min_driver",
    "plugin_problem",
]

# The oldest Linux x86_64 NVIDIA driver that runs a CUDA major release (minor version
# compatibility): CUDA Toolkit release notes, "CUDA Toolkit and Minimum Required Driver Version for
# CUDA Minor Version Compatibility", and
# https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html (Table 1:
# CUDA 13.x >= 580, 12.x >= 525, 11.x >= 450).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

# Plugins whose release X.Y is built for torch X.Y without saying so in their metadata.
SAME_MINOR_PLUGINS = ("torch_xla",)

_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")


def _version(text: str | None) -> Version | None:
    # packaging is imported where a version is compared: a bare resolve on a CPU compares none.
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def _major_minor(text: str | None) -> tuple[int, int] | None:
    v = _version(text)
    return (v.major, v.minor) if v is not None else None


def kernels_cover(capability: tuple[int, int], arch_list: Iterable[str]) -> bool:
    """Whether a build with ``arch_list`` (sm_80, sm_90a, compute_90, ...) runs on ``capability``.

    A cubin for sm_XY runs on X.Z with Z >= Y (an "a" one only on X.Y itself); PTX for compute_XY
    is compiled by the driver for any GPU from X.Y on.
    """
    for arch in arch_list:
        match = _ARCH.fullmatch(arch.strip())
        if match is None:
            continue
        kind, major, minor, suffix = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        if kind == "compute" and (major, minor) <= capability:
            return True
        if (
            kind == "sm"
            and major == capability[0]
            and (minor == capability[1] or (suffix != "a" and minor < capability[1]))
        ):
            return True
    return False


def arch_problem(
    capabilities: Iterable[tuple[int, int]], arch_list: Iterable[str], cuda_version: str | None
) -> str | None:
    """The GPUs whose architecture this torch build has no kernels for, with the fix (None: all run)."""
    archs = [a for a in arch_list if _ARCH.fullmatch(a.strip())]
    if not archs:
        return None  # not read (a CPU build, a ROCm build, or a report that does not say)
    missing = sorted({cc for cc in capabilities if not kernels_cover(cc, archs)})
    if not missing:
        return None
    gpus = ", ".join(f"{a}.{b} (sm_{a}{b})" for a, b in missing)
    build = f"CUDA {cuda_version} build" if cuda_version else "build"
    return (
        f"the GPU's compute capability {gpus} is not among this torch {build}'s architectures "
        f"({' '.join(archs)}): every CUDA kernel fails with 'no kernel image is available for execution "
        f"on the device'; install a torch build whose torch.cuda.get_arch_list() has sm_{missing[0][0]}"
        f"{missing[0][1]} (a newer torch, or one built for a newer CUDA: https://pytorch.org/get-started/)"
    )


def min_driver(cuda_version: str | None) -> str | None:
    """The oldest NVIDIA driver that runs a torch built with ``cuda_version`` (None: not known)."""
    mm = _major_minor(cuda_version)
    return MIN_DRIVER.get(mm[0]) if mm is not None else None


def driver_problem(driver: str | None, cuda_version: str | None) -> str | None:
    """An NVIDIA driver too old for the torch build's CUDA, with the fix (None: new enough or unknown)."""
    from packaging.version import Version

    needed = min_driver(cuda_version)
    have = _version(driver)
    if needed is None or have is None or have >= Version(needed):
        return None
    runnable = [major for major, least in sorted(MIN_DRIVER.items()) if have >= Version(least)]
    older = f", or install a torch build for CUDA {runnable[-1]}.x, which this driver runs" if runnable else ""
    return (
        f"the NVIDIA driver {driver} is older than this torch build's CUDA {cuda_version} needs "
        f"(driver {needed} or newer): CUDA fails to start ('The NVIDIA driver on your system is too old'); "
        f"upgrade the NVIDIA driver{older} (https://pytorch.org/get-started/ lists the builds)"
    )


def plugin_problem(
    plugin: str, plugin_version: str | None, torch_version: str | None, requirement: str | None
) -> str | None:
    """torch outside what the vendor plugin was built for, with the fix (None: it fits or is unknown).

    ``requirement`` is the plugin's torch specifier ("==2.13.0.*", from its Requires-Dist); for the
    plugins in :data:`SAME_MINOR_PLUGINS` it is derived from the plugin's own version.
    """
    torch = _version(torch_version)
    if torch is None or plugin_version is None:
        return None
    if requirement is None and plugin.replace("-", "_") in SAME_MINOR_PLUGINS:
        mm = _major_minor(plugin_version)
        requirement = f"=={mm[0]}.{mm[1]}.*" if mm is not None else None
    if not requirement:
        return None
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import Version

    try:
        wanted = SpecifierSet(requirement)
    except InvalidSpecifier:
        return None
    # The local label (+cpu, +cu130) names the build, not the release the plugin pins.
    if wanted.contains(Version(torch.public), prereleases=True):
        return None
    return (
        f"{plugin} {plugin_version} is built for torch{requirement} but torch {torch_version} is installed: "
        f"importing it fails or crashes on the mismatch; install the pair that belongs together: "
        f"{pip_install(f'torch{requirement}')} (or the {plugin} release for torch {torch.public})"
    )
