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
from importlib.util import find_spec

import whichdevice.hardware.probes.nvidia_platforms as platforms
from whichdevice.core.packages import package_version
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.probes.common import not_installed

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "XLA_PACKAGE",
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


def probe_hpu(backend: Backend) -> ProbeResult:
    return _full_probe("hpu", "probe_hpu", backend) if hpu_installed() else not_installed(backend)


def probe_tpu(backend: Backend) -> ProbeResult:
    # Without torch-tpu but with torch_xla, the tpu probe's reason says whose devices those are.
    present = tpu_installed(backend) or package_version(XLA_PACKAGE) is not None
    return _full_probe("tpu", "probe_tpu", backend) if present else not_installed(backend)


def probe_npu(backend: Backend) -> ProbeResult:
    return _full_probe("vendor", "probe_npu", backend) if vendor_installed(backend) else not_installed(backend)


def probe_mlu(backend: Backend) -> ProbeResult:
    return _full_probe("vendor", "probe_mlu", backend) if vendor_installed(backend) else not_installed(backend)


def probe_musa(backend: Backend) -> ProbeResult:
    return _full_probe("vendor", "probe_musa", backend) if vendor_installed(backend) else not_installed(backend)


def probe_neuron(backend: Backend) -> ProbeResult:
    return _full_probe("vendor", "probe_neuron", backend) if vendor_installed(backend) else not_installed(backend)


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


def probe_cuda(backend: Backend) -> ProbeResult:
    import torch

    if cuda_built(torch):
        return _full_probe("cuda", "probe_cuda", backend)
    return not_installed(backend, cpu_only_reason(str(torch.__version__), backend.install_command))


def probe_xpu(backend: Backend) -> ProbeResult:
    import torch

    if xpu_built(torch):
        return _full_probe("xpu", "probe_xpu", backend)
    return not_installed(backend, no_xpu_reason(str(torch.__version__), backend.install_command))


def probe_mps(backend: Backend) -> ProbeResult:
    import torch

    system = platform.system()
    if mps_built(torch, system):
        return _full_probe("mps", "probe_mps", backend)
    return not_installed(backend, no_mps_reason(system))
