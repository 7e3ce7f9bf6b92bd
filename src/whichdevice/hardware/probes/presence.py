"""Whether a backend's own package is here, asked before its probe module is imported.

Most machines lack most backends. The probes of neuron, tpu, npu, hpu, mlu and musa live in modules
(hpu.py, tpu.py, vendor.py) whose import, readings records included, is paid for nothing where the
package is absent; the registry's rows name the functions here, which answer "not installed" without
that import and hand over to the module's own probe when the package is there. Each reader asks the
same function first, so what counts as installed is written once.
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec

from whichdevice.core.packages import package_version
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.probes.common import not_installed

__all__ = [
    "XLA_PACKAGE",
    "hpu_installed",
    "probe_hpu",
    "probe_mlu",
    "probe_musa",
    "probe_neuron",
    "probe_npu",
    "probe_tpu",
    "tpu_installed",
    "vendor_installed",
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
