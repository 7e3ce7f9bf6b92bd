"""Per-backend probe functions: ask each runtime what it has without starting a device context.

Every function takes the registry record and returns a :class:`~whichdevice.probing.ProbeResult`;
:mod:`whichdevice.probing` runs them (time limit, exception capture, cache). Rules they keep:
an absent package is found with ``importlib.util.find_spec`` and never imported; CUDA and MLU are
counted through their management libraries (NVML, CNDEV) so a process can still fork afterwards;
anything that would initialise a device is avoided or done only when the runtime already is.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from functools import lru_cache
from importlib.util import find_spec
from typing import Any

from whichdevice.envhooks import apply_env_defaults, scoped_env
from whichdevice.packages import package_version, version_at_least, version_before
from whichdevice.records import Backend, DeviceInfo, ProbeResult
from whichdevice.visible import Visibility, visible_devices

__all__ = [
    "finish",
    "not_installed",
    "package_version",
    "probe_cpu",
    "probe_cuda",
    "probe_hpu",
    "probe_mlu",
    "probe_mps",
    "probe_musa",
    "probe_neuron",
    "probe_npu",
    "probe_tpu",
    "probe_xpu",
]

# CPU flags that mean bf16 runs natively (x86 AVX512-BF16 / AMX, Arm BF16): fast bf16 matmuls.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def _versions(backend: Backend) -> dict[str, str]:
    out = {}
    for dist in dict.fromkeys(("torch", backend.package)):
        v = package_version(dist)
        if v:
            out[dist] = v
    return out


def not_installed(backend: Backend, why: str | None = None, *, simulated: bool = False) -> ProbeResult:
    """The result for a backend whose package (or torch build) is not here, naming the install."""
    reason = why or f"{backend.package} is not installed: {backend.install_command}"
    return ProbeResult(
        backend.name,
        installed=False,
        available=False,
        versions=_versions(backend),
        reason=reason,
        simulated=simulated,
    )


def finish(
    backend: Backend,
    devices: Sequence[DeviceInfo],
    *,
    visibility: Visibility | None = None,
    variant: str | None = None,
    warnings: Sequence[str] = (),
    env_set: Sequence[Any] = (),
    features: frozenset[str] = frozenset(),
    os_version: str | None = None,
    versions: dict[str, str] | None = None,
    unavailable_reason: str | None = None,
    simulated: bool = False,
) -> ProbeResult:
    """Build the result for an installed backend from its visible devices (shared with simulate)."""
    vis = visibility if visibility is not None else Visibility()
    if unavailable_reason is not None:
        devices = ()  # an unusable backend lists no devices, matching device_count == 0
    devices = tuple(
        d
        if d.physical_id is not None or vis.ids is None or d.index >= len(vis.ids)
        else _with_physical(d, vis.physical_id(d.index))
        for d in devices
    )
    all_warnings = list(vis.warnings) + list(warnings)
    reason = unavailable_reason
    if not devices and reason is None:
        if vis.ids is not None and not vis.ids:
            reason = (
                f"{vis.variable}={vis.raw!r} hides every {backend.name} device; "
                f"unset it (unset {vis.variable}) or list the devices to use"
            )
        else:
            reason = f"{backend.package} is installed but finds no {backend.hardware} device"
    return ProbeResult(
        backend.name,
        installed=True,
        available=bool(devices) and unavailable_reason is None,
        device_count=len(devices),
        devices=devices,
        versions=versions if versions is not None else _versions(backend),
        variant=variant,
        reason=reason,
        warnings=tuple(dict.fromkeys(all_warnings)),
        env_set=tuple(env_set),
        features=features,
        os_version=os_version,
        visible=vis,
        simulated=simulated,
    )


def _with_physical(device: DeviceInfo, physical_id: str) -> DeviceInfo:
    from dataclasses import replace

    return replace(device, physical_id=physical_id)


# --------------------------------------------------------------------------------------------- cpu


@lru_cache(maxsize=1)
def cpu_facts() -> tuple[str | None, frozenset[str], int | None]:
    """CPU model name, bf16-relevant flags and total memory, read once per process."""
    name: str | None = platform.processor() or None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in (None, "", platform.machine()):
                    name = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        if platform.system() == "Darwin" and platform.machine() == "arm64":
            flags.update(_darwin_arm_flags())
    memory: int | None = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    return name, frozenset(flags & BF16_CPU_FLAGS), memory


def _darwin_arm_flags() -> set[str]:
    try:
        out = subprocess.run(
            ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=2
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return set()
    return {"bf16"} if out == "1" else set()


# oneDNN runs torch's CPU matmuls; capped below AVX512_CORE_BF16 it emulates bf16 even on a CPU that
# has the instructions (bf16 matmuls measured 3.4x slower than fp32 here under AVX512_CORE).
ONEDNN_ISA_VARIABLE = "ONEDNN_MAX_CPU_ISA"
_ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


def bf16_cap(isa: str | None) -> str | None:
    """Why ``ONEDNN_MAX_CPU_ISA=isa`` turns native bf16 off, or None when it leaves it on."""
    if isa is None or isa.strip().upper() not in _ONEDNN_ISAS_WITHOUT_BF16:
        return None
    return (
        f"{ONEDNN_ISA_VARIABLE}={isa} caps oneDNN below AVX512_CORE_BF16, so torch emulates bf16 "
        f"on this CPU; unset {ONEDNN_ISA_VARIABLE} to use its native bf16"
    )


def cpu_result(
    backend: Backend,
    name: str | None,
    flags: frozenset[str],
    memory: int | None,
    isa: str | None,
    *,
    simulated: bool = False,
) -> ProbeResult:
    """The CPU's result from its readings (model name, bf16 flags, memory, oneDNN's ISA cap)."""
    cap = bf16_cap(isa) if flags else None
    device = DeviceInfo(0, name=name, total_memory=memory, bf16=bool(flags) and cap is None)
    return finish(backend, [device], features=flags, warnings=[cap] if cap else [], simulated=simulated)


def probe_cpu(backend: Backend) -> ProbeResult:
    name, flags, memory = cpu_facts()
    return cpu_result(backend, name, flags, memory, os.environ.get(ONEDNN_ISA_VARIABLE))


# -------------------------------------------------------------------------------------------- cuda

_cuda_visible_seen: list[str | None] = []


def probe_cuda(backend: Backend) -> ProbeResult:
    import torch

    variant = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if not hasattr(torch._C, "_cuda_getDeviceCount"):
        return not_installed(
            backend,
            f"this torch ({torch.__version__}) is a CPU-only build without CUDA or ROCm: {backend.install_command}",
        )
    vis = visible_devices("cuda", variant=variant)
    warnings: list[str] = []
    initialized = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
    if initialized:
        count = torch.cuda.device_count()
    else:
        # NVML-based counting does not call cuInit, so the process can still fork afterwards.
        with scoped_env(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = _cuda_details(torch, count, vis, initialized, warnings)
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if initialized:
        expected = vis.count(None)
        seen_before = [v for v in _cuda_visible_seen if v != current]
        if (expected is not None and expected != count) or seen_before:
            warnings.append(
                f"CUDA_VISIBLE_DEVICES is now {current!r} but CUDA was already initialised in this "
                f"process with {count} GPU(s); the change takes effect only in a new process"
            )
    if current not in _cuda_visible_seen:  # distinct values only: refreshed probes must not grow it
        _cuda_visible_seen.append(current)
    warnings += cuda_order_warnings(vis, devices)
    versions = _versions(backend)
    runtime = torch.version.hip if variant == "rocm" else torch.version.cuda
    if runtime:
        versions["rocm" if variant == "rocm" else "cuda"] = str(runtime)
    return finish(backend, devices, visibility=vis, variant=variant, warnings=warnings, versions=versions)


def cuda_order_warnings(vis: Visibility, devices: Sequence[DeviceInfo]) -> list[str]:
    """CUDA numbers GPUs fastest first, nvidia-smi by PCI bus: mixed models make indices differ."""
    if (
        vis.variable == "CUDA_VISIBLE_DEVICES"
        and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
        and len({d.name for d in devices if d.name}) > 1
    ):
        return [
            "CUDA_VISIBLE_DEVICES is set but CUDA_DEVICE_ORDER is not PCI_BUS_ID and the GPUs are "
            "different models: CUDA numbers them fastest first, nvidia-smi by PCI bus, so the "
            "indices may not be the GPUs you meant; export CUDA_DEVICE_ORDER=PCI_BUS_ID"
        ]
    return []


def _cuda_details(torch: Any, count: int, vis: Visibility, initialized: bool, warnings: list[str]) -> list[DeviceInfo]:
    if count <= 0:
        return []
    if initialized:
        out = []
        for i in range(count):
            p = torch.cuda.get_device_properties(i)
            out.append(
                DeviceInfo(
                    i,
                    p.name,
                    int(p.total_memory),
                    (p.major, p.minor),
                    physical_id=vis.physical_id(i) if vis.ids is not None and i < len(vis.ids) else str(i),
                )
            )
        return out
    physical = _nvml_devices() or _smi_devices()
    if not physical:
        warnings.append(
            "GPU model and compute capability are unknown without initialising CUDA; "
            "pip install nvidia-ml-py lets whichdevice read them through NVML"
        )
        return [DeviceInfo(i) for i in range(count)]
    out = []
    for i in range(count):
        pid = vis.physical_id(i) if vis.ids is not None and i < len(vis.ids) else str(i)
        info = _match_physical(physical, pid)
        if info is None:
            out.append(DeviceInfo(i, physical_id=pid))
        else:
            out.append(DeviceInfo(i, info["name"], info["memory"], info["cc"], physical_id=pid))
    return out


def _match_physical(physical: list[dict[str, Any]], pid: str) -> dict[str, Any] | None:
    if pid.isdigit():
        index = int(pid)
        return physical[index] if index < len(physical) else None
    for dev in physical:
        if dev["uuid"] and (dev["uuid"].startswith(pid) or pid.startswith(dev["uuid"])):
            return dev
    return None


def _nvml_devices() -> list[dict[str, Any]]:
    if find_spec("pynvml") is None:
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out.append(
                {
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    "cc": tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                    "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                }
            )
        return out
    except Exception:
        return []


def _smi_devices() -> list[dict[str, Any]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total,compute_cap,uuid", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            major, minor = (int(x) for x in parts[2].split("."))
            memory = int(float(parts[1])) * 1024**2
        except ValueError:
            continue
        devices.append({"name": parts[0], "memory": memory, "cc": (major, minor), "uuid": parts[3]})
    return devices


# ------------------------------------------------------------------ out-of-tree and stock backends


def _torch_module_devices(module: Any, count: int, vis: Visibility) -> list[DeviceInfo]:
    """Names and memory from a torch device module (torch.npu, torch.xpu, ...), where it offers them."""
    out = []
    bf16 = None
    if hasattr(module, "is_bf16_supported"):
        try:
            bf16 = bool(module.is_bf16_supported())
        except Exception:
            bf16 = None
    for i in range(count):
        name = memory = None
        try:
            props = module.get_device_properties(i)
            name = getattr(props, "name", None)
            memory = getattr(props, "total_memory", None)
        except Exception:
            try:
                name = module.get_device_name(i)
            except Exception:
                name = None
        pid = vis.physical_id(i) if vis.ids is not None and i < len(vis.ids) else str(i)
        out.append(DeviceInfo(i, name, int(memory) if memory else None, physical_id=pid, bf16=bf16))
    return out


def _vendor_probe(backend: Backend, attr: str, env: dict[str, str] | None = None) -> ProbeResult:
    top = backend.module.split(".")[0]
    if find_spec(top) is None:
        return not_installed(backend)
    env_set = apply_env_defaults(backend, "import")
    import importlib

    import torch

    importlib.import_module(backend.module)
    module = getattr(torch, attr, None)
    if module is None:
        raise RuntimeError(f"{backend.module} imported but torch.{attr} does not exist")
    vis = visible_devices(backend.name)
    with scoped_env(**(env or {})):
        available = bool(module.is_available())
        count = int(module.device_count()) if available else 0
    devices = _torch_module_devices(module, count, vis)
    return finish(backend, devices, visibility=vis, env_set=env_set)


def probe_npu(backend: Backend) -> ProbeResult:
    return _vendor_probe(backend, "npu")


def probe_mlu(backend: Backend) -> ProbeResult:
    # The CNDEV-based check answers without starting the MLU driver (fork-safe, like NVML).
    return _vendor_probe(backend, "mlu", {"PYTORCH_CNDEV_BASED_MLU_CHECK": "1"})


def probe_musa(backend: Backend) -> ProbeResult:
    return _vendor_probe(backend, "musa")


def probe_neuron(backend: Backend) -> ProbeResult:
    return _vendor_probe(backend, "neuron")


GAUDI_GROUP_SIZES = (2, 4)


def probe_hpu(backend: Backend) -> ProbeResult:
    if find_spec("habana_frameworks") is None or find_spec("habana_frameworks.torch") is None:
        return not_installed(backend)
    accelerate_version = package_version("accelerate")
    if accelerate_version is not None and version_before(accelerate_version, "1.5.0"):
        return finish(
            backend,
            [],
            unavailable_reason=(
                f"accelerate {accelerate_version} is too old for Gaudi (transformers and accelerate "
                "ignore HPUs before 1.5.0): pip install 'accelerate>=1.5.0'"
            ),
        )
    env_set = apply_env_defaults(backend, "import")
    try:
        import habana_frameworks.torch  # noqa: F401 - registers torch.hpu (and patches torch)
    except Exception as exc:
        # The hook's variable stays set (the user may retry after fixing the install); say so.
        done = "; ".join(a.message for a in env_set if a.action == "set")
        raise ImportError(f"{exc}" + (f" (whichdevice had {done})" if done else "")) from exc
    import torch

    hpu: Any = getattr(torch, "hpu")  # noqa: B009 - registered at run time by the import above
    vis = visible_devices("hpu")
    available = bool(hpu.is_available())
    count = int(hpu.device_count()) if available else 0
    devices = []
    for info in _torch_module_devices(hpu, count, vis):
        name = info.name or ""
        gen = re.search(r"gaudi\s*(\d)", name, re.IGNORECASE)
        generation = f"gaudi{gen.group(1)}" if gen else ("gaudi1" if "gaudi" in name.lower() else None)
        devices.append(_with(info, generation=generation, bf16=True))
    warnings = hpu_group_warnings(vis)
    warnings += [a.message for a in env_set if a.action == "kept"]
    return finish(backend, devices, visibility=vis, warnings=warnings, env_set=env_set)


def hpu_group_warnings(vis: Visibility) -> list[str]:
    """Intel supports partial-server distributed work only in groups of 2 or 4 Gaudis."""
    if vis.ids is None or not vis.ids:
        return []
    n = len(vis.ids)
    if n == 1 or n in GAUDI_GROUP_SIZES or n >= 8:
        return []
    return [
        f"{vis.variable}={vis.raw!r} selects {n} Gaudi devices; on a partial server Intel supports "
        "distributed work only in groups of 2 or 4 (hl-smi -Q index,module_id -f csv maps indices "
        "to module ids)"
    ]


def _with(info: DeviceInfo, **changes: Any) -> DeviceInfo:
    from dataclasses import replace

    return replace(info, **changes)


def probe_tpu(backend: Backend) -> ProbeResult:
    if find_spec("torch_tpu") is None and package_version(backend.package) is None:
        return not_installed(backend)
    import importlib

    import torch

    if find_spec("torch_tpu") is not None:
        importlib.import_module("torch_tpu")
    vis = visible_devices("tpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "tpu":
        return finish(backend, [], visibility=vis)
    count = int(torch.accelerator.device_count())
    devices = [
        DeviceInfo(i, physical_id=vis.physical_id(i) if vis.ids is not None and i < len(vis.ids) else str(i))
        for i in range(count)
    ]
    return finish(backend, devices, visibility=vis)


def probe_xpu(backend: Backend) -> ProbeResult:
    import torch

    if not (hasattr(torch, "xpu") and hasattr(torch._C, "_xpu_getDeviceCount")):
        return not_installed(
            backend,
            f"this torch ({torch.__version__}) was built without Intel GPU (XPU) support: {backend.install_command}",
        )
    vis = visible_devices("xpu")
    available = bool(torch.xpu.is_available())
    count = int(torch.xpu.device_count()) if available else 0
    return finish(backend, _torch_module_devices(torch.xpu, count, vis), visibility=vis)


def probe_mps(backend: Backend) -> ProbeResult:
    import torch

    if platform.system() != "Darwin" or not torch.backends.mps.is_built():
        return not_installed(
            backend,
            f"MPS needs macOS on Apple Silicon with a macOS build of torch; this is {platform.system()}",
        )
    mac = platform.mac_ver()[0] or None
    if not torch.backends.mps.is_available():
        return finish(
            backend,
            [],
            os_version=mac,
            unavailable_reason=f"MPS is built into torch but not available (macOS {mac}; needs 12.3+)",
        )
    _, _, memory = cpu_facts()
    bf16 = mac is not None and version_at_least(mac, "14")
    device = DeviceInfo(0, name=platform.processor() or "Apple Silicon", total_memory=memory, bf16=bf16)
    return finish(backend, [device], os_version=mac)
