"""Whether a backend's own package (or torch's build of its runtime) is here, asked before its probe module is imported.

Most machines lack most backends. The probes of neuron, tpu, npu, hpu, mlu and musa live in modules
(hpu.py, tpu.py, vendor.py) whose import, readings records included, is paid for nothing where the
package is absent; the registry's rows name the functions here, which answer "not installed" without
that import and hand over to the module's own probe when the package is there. Each reader asks the
same function first, so what counts as installed is written once.

cuda, xpu and mps come with torch itself, so there the question is torch's build: a CPU-only torch
(what a CPU machine installs) has no CUDA, ROCm or XPU runtime, and MPS exists only on macOS. Their
"not built" answers and reasons are made here, and the probe modules (cuda.py with NVML and nvidia-smi,
xpu.py, mps.py) say the same words through the same functions when their readings say the same.
"""

from __future__ import annotations

import importlib
import platform
import sys
from importlib.util import find_spec

import whichdevice.hardware.probes.nvidia_platforms as platforms
from whichdevice.core.packages import package_version
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.probes.common import not_installed

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = [
    "XLA_PACKAGE",
    "absent_answer",
    "cpu_only_reason",
    "cuda_built",
    "hpu_installed",
    "mps_built",
    "no_mps_reason",
    "no_xpu_reason",
    "probe_cuda",
    "probe_hpu",
    "probe_mlu",
    "probe_mps",
    "probe_musa",
    "probe_neuron",
    "probe_npu",
    "probe_tpu",
    "probe_xpu",
    "tpu_installed",
    "vendor_installed",
    "xpu_built",
]

# torch_xla is not the tpu row's package, but users with a TPU often have it: the tpu probe's reason
# names it, so its presence sends the tpu row to its full probe.
XLA_PACKAGE = "torch_xla"


def vendor_installed(backend: Backend) -> bool:
    """An out-of-tree torch device module (npu, mlu, musa, neuron, a plugin's): its top module is importable."""
    return find_spec(backend.module.split(".")[0]) is not None


def hpu_installed() -> bool:
    """The Gaudi bridge, ``habana_frameworks.torch``, is importable (finding it imports ``habana_frameworks``)."""
    return find_spec("habana_frameworks") is not None and find_spec("habana_frameworks.torch") is not None


def tpu_installed(backend: Backend) -> bool:
    """Native TorchTPU: its module is importable, or its distribution is installed."""
    return find_spec("torch_tpu") is not None or package_version(backend.package) is not None


def _full_probe(module: str, name: str, backend: Backend) -> ProbeResult:
    # The module's own probe, read then interpret, imported only now that its package is here. Named,
    # not derived from the row: a plugin's row may reuse probe_npu under a name of its own.
    probe = getattr(importlib.import_module(f"whichdevice.hardware.probes.{module}"), name)
    result: ProbeResult = probe(backend)
    return result


def _absent_hpu(backend: Backend) -> ProbeResult | None:
    return None if hpu_installed() else not_installed(backend)


def _absent_gaudi_bridge(backend: Backend) -> ProbeResult | None:
    # Only the top module: finding habana_frameworks.torch imports habana_frameworks, a vendor import.
    return None if find_spec("habana_frameworks") is not None else not_installed(backend)


def _absent_tpu(backend: Backend) -> ProbeResult | None:
    # Without torch-tpu but with torch_xla, the tpu probe's reason says whose devices those are.
    present = tpu_installed(backend) or package_version(XLA_PACKAGE) is not None
    return None if present else not_installed(backend)


def _absent_vendor(backend: Backend) -> ProbeResult | None:
    return None if vendor_installed(backend) else not_installed(backend)


def probe_hpu(backend: Backend) -> ProbeResult:
    return _absent_hpu(backend) or _full_probe("hpu", "probe_hpu", backend)


def probe_tpu(backend: Backend) -> ProbeResult:
    return _absent_tpu(backend) or _full_probe("tpu", "probe_tpu", backend)


def probe_npu(backend: Backend) -> ProbeResult:
    return _absent_vendor(backend) or _full_probe("vendor", "probe_npu", backend)


def probe_mlu(backend: Backend) -> ProbeResult:
    return _absent_vendor(backend) or _full_probe("vendor", "probe_mlu", backend)


def probe_musa(backend: Backend) -> ProbeResult:
    return _absent_vendor(backend) or _full_probe("vendor", "probe_musa", backend)


def probe_neuron(backend: Backend) -> ProbeResult:
    return _absent_vendor(backend) or _full_probe("vendor", "probe_neuron", backend)


def cuda_built(torch: Any) -> bool:
    """This torch has a CUDA or ROCm runtime compiled in. On an ARM64 host the cuda probe runs even
    without one: the GPUs NVML lists there say which machine it is (Jetson, DGX Spark, Grace) and so
    which torch to install (cuda.py, ``read_cuda``)."""
    return hasattr(torch._C, "_cuda_getDeviceCount") or platforms.read_host()[0] == platforms.ARM64


def cpu_only_reason(torch_version: str, install: str, where: str = "") -> str:
    """Why cuda is not installed with a CPU-only torch (``where``: "; for <the NVIDIA machine>")."""
    return f"this torch ({torch_version}) is a CPU-only build without CUDA or ROCm{where}: {install}"


def xpu_built(torch: Any) -> bool:
    """This torch has the Intel GPU (XPU) runtime compiled in."""
    return hasattr(torch, "xpu") and hasattr(torch._C, "_xpu_getDeviceCount")


def no_xpu_reason(torch_version: str, install: str) -> str:
    return f"this torch ({torch_version}) was built without Intel GPU (XPU) support: {install}"


def mps_built(torch: Any, system: str) -> bool:
    """This is macOS and its torch has MPS built in."""
    return system == "Darwin" and bool(torch.backends.mps.is_built())


def no_mps_reason(system: str) -> str:
    return f"MPS needs macOS on Apple Silicon with a macOS build of torch; this is {system}"


def _absent_cuda(backend: Backend, torch: Any) -> ProbeResult | None:
    if cuda_built(torch):
        return None
    return not_installed(backend, cpu_only_reason(str(torch.__version__), backend.install_command))


def _absent_xpu(backend: Backend, torch: Any) -> ProbeResult | None:
    if xpu_built(torch):
        return None
    return not_installed(backend, no_xpu_reason(str(torch.__version__), backend.install_command))


def _absent_mps(backend: Backend, torch: Any) -> ProbeResult | None:
    system = platform.system()
    return None if mps_built(torch, system) else not_installed(backend, no_mps_reason(system))


def probe_cuda(backend: Backend) -> ProbeResult:
    import torch

    return _absent_cuda(backend, torch) or _full_probe("cuda", "probe_cuda", backend)


def probe_xpu(backend: Backend) -> ProbeResult:
    import torch

    return _absent_xpu(backend, torch) or _full_probe("xpu", "probe_xpu", backend)


def probe_mps(backend: Backend) -> ProbeResult:
    import torch

    return _absent_mps(backend, torch) or _full_probe("mps", "probe_mps", backend)


# Each probe above -> its "not installed" answer. These read only find_spec, package metadata, a
# release file and the flags of a torch already imported: nothing that waits on a driver or runs a
# vendor import, so the runner asks them on the calling thread (absent_answer) and hands the probe
# to a bounded thread only when the package is there (measured: a hand-over costs 0.1-0.3 ms, the
# first one 1.3 ms with its thread start; docs/performance.md).
_ABSENT_VENDOR: dict[Callable[[Backend], ProbeResult], Callable[[Backend], ProbeResult | None]] = {
    probe_hpu: _absent_gaudi_bridge,
    probe_tpu: _absent_tpu,
    probe_npu: _absent_vendor,
    probe_mlu: _absent_vendor,
    probe_musa: _absent_vendor,
    probe_neuron: _absent_vendor,
}
_ABSENT_TORCH_BUILD: dict[Callable[[Backend], ProbeResult], Callable[[Backend, Any], ProbeResult | None]] = {
    probe_cuda: _absent_cuda,
    probe_xpu: _absent_xpu,
    probe_mps: _absent_mps,
}


def absent_answer(probe: Callable[[Backend], ProbeResult], backend: Backend) -> ProbeResult | None:
    """The "not installed" result of ``probe`` when it is one of this module's and its package (or
    torch's build of the runtime) is absent, found without a vendor import; None otherwise: the package
    is there, torch is not imported yet (or still importing), or the probe is another's (a plugin's, a
    simulation's), and the probe must run as the runner runs every probe."""
    vendor = _ABSENT_VENDOR.get(probe)
    if vendor is not None:
        return vendor(backend)
    build = _ABSENT_TORCH_BUILD.get(probe)
    torch = sys.modules.get("torch")
    if build is None or torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return build(backend, torch)
