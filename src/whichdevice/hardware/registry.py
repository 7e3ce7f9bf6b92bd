"""The backend registry: one record per device string, in one declared detection order.

The detection order is written once, here (``_BUILTIN``), and every other part of whichdevice reads
it through :func:`backends`. Why this order:

1. ``neuron``, ``tpu``, ``npu``, ``hpu``, ``mlu``, ``musa`` come first. Each needs a vendor package
   the user installed on purpose, so a usable one is the accelerator the machine was built for. Some
   of them also make CUDA *look* available: ``torch_npu.contrib.transfer_to_npu`` redirects
   ``torch.cuda`` to the NPU (accelerate#3020) and the Neuron extension loads into CUDA builds of
   torch, so they must be asked before ``cuda``.
2. ``cuda`` (NVIDIA, and AMD through the ROCm build), then ``xpu`` and ``mps``, which stock torch
   builds report on their own.
3. ``cpu`` last: always there, the fallback.

Static facts (visible-devices variables, distributed backends, compile backends) live in these
records; ``tests/hardware/test_registry.py`` compares them with accelerate's own constants so drift fails.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from whichdevice.core.entry_points import WHICHDEVICE_GROUP, entry_points
from whichdevice.core.errors import UnknownDeviceError, closest_match, shown
from whichdevice.core.records import Backend, EnvDefault
from whichdevice.hardware import plugin_loading

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "EnvDefault",
    "backend_names",
    "backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
]

ENTRY_POINT_GROUP = WHICHDEVICE_GROUP

_PROBES = "whichdevice.hardware.probes"

_BUILTIN: tuple[Backend, ...] = (
    Backend(
        name="neuron",
        hardware="AWS Trainium / Inferentia",
        package="torch-neuronx",
        module="torch_neuronx",
        probe_ref=f"{_PROBES}:probe_neuron",
        visible_devices_env=("NEURON_RT_VISIBLE_CORES",),
        distributed_backend="neuron",
        other_distributed_backends=("xla",),
        compile_backend="neuron",
        device_map_auto=False,
        fast_fp16=False,
        kernels_key="neuron",
        indexed=False,
        default_dtype="bfloat16",
        install_hint="pip install torch-neuronx --extra-index-url https://pip.repos.neuron.amazonaws.com",
        docs="neuron",
    ),
    Backend(
        name="tpu",
        hardware="Google TPU",
        package="torch-tpu",
        module="torch_tpu",
        probe_ref=f"{_PROBES}:probe_tpu",
        visible_devices_env=("TPU_VISIBLE_CHIPS",),
        distributed_backend="xla",
        compile_backend=None,
        device_map_auto=False,
        fast_fp16=False,
        kernels_key="tpu",
        indexed=False,
        default_dtype="bfloat16",
        docs="tpu",
    ),
    Backend(
        name="npu",
        hardware="Huawei Ascend",
        package="torch-npu",
        module="torch_npu",
        probe_ref=f"{_PROBES}:probe_npu",
        visible_devices_env=("ASCEND_RT_VISIBLE_DEVICES",),
        distributed_backend="hccl",
        bitsandbytes=True,
        kernels_key="npu",
        flash_attention=(2,),
        flash_attention_native=(2,),
        default_dtype="bfloat16",
        docs="npu",
    ),
    Backend(
        name="hpu",
        hardware="Intel Gaudi",
        package="habana-torch-plugin",
        module="habana_frameworks",
        probe_ref=f"{_PROBES}:probe_hpu",
        visible_devices_env=("HABANA_VISIBLE_MODULES", "HABANA_VISIBLE_DEVICES"),
        distributed_backend="hccl",
        compile_backend="hpu_backend",
        bitsandbytes=True,
        indexed=False,
        one_device_a_process=True,  # no hpu:N (optimum-habana #637; accelerate/state.py's current_device())
        default_dtype="bfloat16",
        env_defaults=(
            EnvDefault(
                "PT_ENABLE_INT64_SUPPORT",
                "1",
                "token ids are int64; without it Gaudi kernels fail or truncate them",
            ),
        ),
        install_hint="pip install habana-torch-plugin, which ships with the Intel Gaudi software stack",
        docs="hpu",
    ),
    Backend(
        name="mlu",
        hardware="Cambricon MLU",
        package="torch-mlu",
        module="torch_mlu",
        probe_ref=f"{_PROBES}:probe_mlu",
        visible_devices_env=("MLU_VISIBLE_DEVICES",),
        distributed_backend="cncl",
        flash_attention=(2,),
        default_dtype="float16",
        docs="mlu",
    ),
    Backend(
        name="musa",
        hardware="Moore Threads GPU",
        package="torch-musa",
        module="torch_musa",
        probe_ref=f"{_PROBES}:probe_musa",
        visible_devices_env=("MUSA_VISIBLE_DEVICES",),
        distributed_backend="mccl",
        flash_attention=(2,),
        default_dtype="float16",
        docs="musa",
    ),
    Backend(
        name="cuda",
        hardware="NVIDIA GPU, or AMD GPU through the ROCm build of torch",
        package="torch",
        module="torch",
        probe_ref=f"{_PROBES}:probe_cuda",
        visible_devices_env=(
            "CUDA_VISIBLE_DEVICES",
            "HIP_VISIBLE_DEVICES",
            "ROCR_VISIBLE_DEVICES",
        ),
        distributed_backend="nccl",
        other_distributed_backends=("gloo",),
        bitsandbytes=True,
        kernels_key="cuda",
        flash_attention=(2, 3, 4),
        default_dtype="float16",
        install_hint="pip install torch, a CUDA or ROCm build: see https://pytorch.org/get-started/",
        docs="cuda",
    ),
    Backend(
        name="xpu",
        hardware="Intel GPU",
        package="torch",
        module="torch",
        probe_ref=f"{_PROBES}:probe_xpu",
        visible_devices_env=("ZE_AFFINITY_MASK",),
        distributed_backend="xccl",
        other_distributed_backends=("ccl", "gloo"),
        bitsandbytes=True,
        kernels_key="xpu",
        flash_attention=(2,),
        # flash-attn builds for CUDA and ROCm only (Dao-AILab/flash-attention README, "Installation
        # and features"); FlashAttention-2 on Intel GPUs is the Hub kernel kernels-community/flash-attn2.
        flash_attn_builds=False,
        default_dtype="bfloat16",
        install_hint="pip install torch --index-url https://download.pytorch.org/whl/xpu",
        docs="xpu",
    ),
    Backend(
        name="mps",
        hardware="Apple Silicon GPU",
        package="torch",
        module="torch",
        probe_ref=f"{_PROBES}:probe_mps",
        distributed_backend=None,
        memory_by_name=True,
        bitsandbytes=True,
        kernels_key="mps",
        indexed=False,
        default_dtype="float16",
        env_defaults=(
            EnvDefault(
                "PYTORCH_ENABLE_MPS_FALLBACK",
                "1",
                "operators MPS lacks run on the CPU instead of raising (accelerate sets it too)",
                stage="select",
            ),
        ),
        install_hint="pip install torch, on macOS 12.3 or newer with Apple Silicon",
        docs="mps",
    ),
    Backend(
        name="cpu",
        hardware="CPU",
        package="torch",
        module="torch",
        probe_ref=f"{_PROBES}:probe_cpu",
        distributed_backend="gloo",
        other_distributed_backends=("mpi", "ccl"),
        memory_by_name=True,
        bitsandbytes=True,
        indexed=False,
        shared_device=True,
        fast_fp16=False,
        default_dtype="float32",
        docs="cpu",
    ),
)

_lock = threading.RLock()
# Called with a backend's name when its row is added (register_backend, an entry point), replaced
# or removed (unregister_backend, _reset): the probe layer forgets what it cached about it, the
# memo key its variables. A callback, because the registry sits below the layers that cache.
_listeners: list[Callable[[str], None]] = []
_registry: dict[str, Backend] = {}
_order: list[str] = []
_entry_points_loaded = False


def on_change(listener: Callable[[str], None]) -> None:
    """Call ``listener(name)`` whenever backend ``name`` is registered, replaced or removed."""
    if listener not in _listeners:
        _listeners.append(listener)


def _changed(name: str) -> None:
    for listener in tuple(_listeners):
        listener(name)


def _reset() -> None:
    """Back to the built-in records (tests use this; entry points load again on next read)."""
    global _entry_points_loaded
    with _lock:
        before = dict.fromkeys(_order)
        _registry.clear()
        _order.clear()
        for record in _BUILTIN:
            _registry[record.name] = record
            _order.append(record.name)
        _entry_points_loaded = False
        plugin_loading.forget()
    for name in {**before, **dict.fromkeys(_order)}:
        _changed(name)


_reset()


def _after_fork_in_child() -> None:
    # A fork taken while another thread held the lock would leave the child waiting forever.
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _load_entry_points() -> None:
    # Third-party backends register through the entry-point group; an entry point may name a
    # Backend record or a callable returning one. A broken plugin must not break detection, so
    # failures become warnings.
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        added: list[str] = []
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj: Any = plugin_loading.load(ep)
                record = obj() if callable(obj) and not isinstance(obj, Backend) else obj
                if not isinstance(record, Backend):
                    raise TypeError(f"entry point gave {type(record).__name__}, not a whichdevice.Backend")
                _check_name(record)
                if record.name not in _registry:
                    _insert(record, before="cpu")
                    plugin_loading.remember_source(record.name, ep)
                    added.append(record.name)
            # SystemExit too: a plugin calling sys.exit() must not end the program that asked for a device.
            except (Exception, SystemExit) as exc:
                import warnings

                warnings.warn(f"whichdevice: {plugin_loading.record(ep, exc)}", stacklevel=2)
        for name in added:
            _changed(name)


def _check_name(record: Backend) -> None:
    # Device strings are parsed as "<name>[:<index>]" in lower case; any other name could never
    # be asked for by string.
    if not record.name or not record.name.isidentifier() or record.name != record.name.lower():
        raise ValueError(f"a backend name is a lower-case identifier like 'cuda', not {record.name!r}")


def _insert(record: Backend, before: str | None) -> None:
    _registry[record.name] = record
    if record.name in _order:
        return
    if before is None:
        before = "cpu"
    if before not in _order:
        raise UnknownDeviceError(
            f"register_backend(before={before!r}): no backend named {before!r}; valid names: {', '.join(_order)}"
        )
    _order.insert(_order.index(before), record.name)


def backends() -> tuple[Backend, ...]:
    """Every registered backend, in detection order."""
    _load_entry_points()
    with _lock:
        return tuple(_registry[name] for name in _order)


def backend_names() -> tuple[str, ...]:
    """The valid device-string prefixes, in detection order."""
    return tuple(b.name for b in backends())


def registry_view() -> Mapping[str, Backend]:
    """A read-only name -> record view of the registry."""
    _load_entry_points()
    return MappingProxyType(dict(_registry))


def get_backend(name: str) -> Backend:
    """The record for ``name`` ("cuda", "hpu", ...); an unknown name raises with the closest match."""
    _load_entry_points()
    if not isinstance(name, str):
        raise UnknownDeviceError(
            f"a backend name is a string such as 'cuda', not {type(name).__name__} {shown(name)}; "
            f"valid names: {', '.join(_order)}"
        )
    record = _registry.get(name)
    if record is not None:
        return record
    raise UnknownDeviceError(unknown_name_message(name, what="backend"))


def unknown_name_message(name: str, what: str = "device") -> str:
    """The text for a name no backend answers to: the valid names and the closest match."""
    names = backend_names()
    hint = closest_match(name, names)
    guess = f" Did you mean {hint!r}?" if hint else ""
    return f"unknown {what} {shown(name)}.{guess} Valid {what} names: {', '.join(names)}."


def register_backend(record: Backend, *, replace: bool = False, before: str | None = None) -> Backend:
    """Add a third-party backend, detected just before ``before`` (default: before "cpu").

    Registering a name that exists is an error unless ``replace=True``; a replaced record keeps its
    place in the detection order unless ``before`` moves it.
    """
    if not isinstance(record, Backend):
        raise TypeError(f"register_backend takes a whichdevice.Backend, not {type(record).__name__}")
    _check_name(record)
    _load_entry_points()
    with _lock:
        if record.name in _registry and not replace:
            raise ValueError(f"a backend named {record.name!r} is already registered; pass replace=True to replace it")
        # Check ``before`` first so a bad one leaves the registry exactly as it was.
        if before is not None and (before not in _order or before == record.name):
            others = [n for n in _order if n != record.name]
            raise UnknownDeviceError(
                f"register_backend(before={before!r}): no other backend named {before!r}; "
                f"valid names: {', '.join(others)}"
            )
        if before is not None and record.name in _order:
            _order.remove(record.name)
        _insert(record, before)
    _changed(record.name)
    return record


def unregister_backend(name: str) -> None:
    """Remove a backend (built-in ones too; ``_reset`` restores them)."""
    with _lock:
        get_backend(name)
        del _registry[name]
        _order.remove(name)
    _changed(name)
