"""Which dtype this hardware computes fastest in, and why (rules from BACKENDS.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from whichdevice.core.dtypes import NAMES, short_name
from whichdevice.core.errors import DeviceError

if TYPE_CHECKING:
    from whichdevice.device.target import Target

__all__ = ["DTYPE_NAMES", "choose_dtype", "dtype_name", "parse_dtype", "supports"]

# Every spelling parse_dtype takes: torch's names, the short names, and torch's aliases.
DTYPE_NAMES = {
    **{name: name for name in NAMES},
    **{short_name(name): name for name in NAMES},
    "half": "float16",
    "float": "float32",
}


def parse_dtype(value: Any) -> str:
    """Canonical name ("bfloat16", "float16", "float32") of a dtype given as string or torch dtype."""
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
    elif type(value).__name__ == "dtype":
        name = str(value).removeprefix("torch.")
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    raise DeviceError(
        f"dtype={value!r} is not one whichdevice chooses between; pass 'auto', 'bfloat16', "
        "'float16', 'float32' (or the torch dtype)"
    )


def dtype_name(name: str) -> str:
    """The short name ("bf16") of a dtype name ("bfloat16"), as TrainingArguments' flags spell it."""
    return short_name(name)


def supports(target: Target, dtype: str) -> tuple[bool, str]:
    """Whether ``dtype`` runs *natively and fast* here, with the fact that decides it."""
    if dtype == "float32":
        return True, "fp32 runs everywhere"
    # Four vendors have rules of their own (_RULES), read from what their probes report: NVIDIA's compute
    # capability (AMD's GPU names under the ROCm build), the Gaudi generation, the macOS version, the
    # CPU's flags. Every other row, plugins included, is decided by its fields and its runtime's answer.
    return _RULES.get(target.name, _from_the_row)(target, dtype)


def _cuda(target: Target, dtype: str) -> tuple[bool, str]:
    """NVIDIA: the compute capability; AMD (the ROCm build of the cuda backend): the GPU's generation."""
    from whichdevice.precision.generations import amd_half_precision, nvidia_fp16  # GPUs' tables: cuda only

    if target.variant == "rocm":
        slower = amd_half_precision(target.first_name(), target.capability)
        if dtype == "bfloat16" and slower is not None:
            return False, slower[1]
        return True, "AMD GPUs (ROCm) support bf16 and fp16"
    cc = target.capability
    if cc is None:
        return dtype == "float16", "compute capability unknown; fp16 is the safe half precision"
    cc_text = f"{cc[0]}.{cc[1]}"
    if dtype == "bfloat16":
        if cc >= (8, 0):
            return True, f"this GPU has compute capability {cc_text}; bf16 runs natively from 8.0 (Ampere)"
        return False, (
            f"this GPU has compute capability {cc_text}; bf16 runs natively only from 8.0 (Ampere), "
            "below it torch emulates bf16"
        )
    if cc >= (7, 0):
        return True, f"fp16 tensor cores from compute capability 7.0 (Volta); this GPU has {cc_text}"
    rate = nvidia_fp16(cc)
    if rate is not None:
        return rate.fast, rate.why
    return False, f"fp16 arithmetic needs compute capability 5.3 or newer; this GPU has {cc_text}"


def _gaudi(target: Target, dtype: str) -> tuple[bool, str]:
    gen = next((d.generation for d in target.probe.devices if d.generation), None)
    if dtype == "float16" and gen == "gaudi1":
        return False, "Gaudi 1 has no fp16; it runs bf16"
    return True, f"{gen or 'Gaudi'} supports {dtype_name(dtype)}"


def _apple(target: Target, dtype: str) -> tuple[bool, str]:
    if dtype == "float16":
        return True, "Apple GPUs run fp16"
    version = target.probe.os_version or "unknown"
    ok = bool(target.probe.devices and target.probe.devices[0].bf16)
    return ok, f"MPS supports bf16 from macOS 14; this is macOS {version}"


def _cpu(target: Target, dtype: str) -> tuple[bool, str]:
    flags = sorted(target.probe.features)
    if dtype == "bfloat16":
        if flags and target.probe.devices and target.probe.devices[0].bf16:
            return True, f"this CPU has native bf16 ({', '.join(flags)})"
        if flags:
            cap = next((w for w in target.probe.warnings if "AVX512_CORE_BF16" in w), "its native bf16 is turned off")
            return False, f"this CPU has {', '.join(flags)}, but {cap}"
        return False, "this CPU lacks native bf16 (no avx512_bf16/amx_bf16 or Arm bf16), so bf16 is emulated and slow"
    # No figure here: this CPU's own fp16 timing, where calibrated, is quoted by the flag's check.
    return False, "CPUs compute fp16 slowly (most have no fp16 arithmetic: oneDNN converts to fp32)"


def _from_the_row(target: Target, dtype: str) -> tuple[bool, str]:
    """xpu, npu, mlu, musa, tpu, neuron and third-party backends: the row's facts and the runtime's answer."""
    if not target.backend.fast_fp16 and target.backend.default_dtype == "bfloat16":
        # Built for bf16 (TPU, Trainium).
        if dtype == "bfloat16":
            return True, f"{target.backend.hardware} computes in bf16 natively"
        return False, f"{target.backend.hardware} is built for bf16; fp16 is not its native half precision"
    bf16 = next((d.bf16 for d in target.probe.devices if d.bf16 is not None), None)
    if dtype == "bfloat16":
        if bf16 is None:
            return target.backend.default_dtype == "bfloat16", f"{target.backend.hardware}: bf16 support not reported"
        return bf16, f"{target.backend.hardware} {'supports' if bf16 else 'does not support'} bf16"
    if not target.backend.fast_fp16:
        return False, f"{target.backend.hardware} has no fast fp16"
    return True, f"{target.backend.hardware} runs fp16"


# The vendor families with rules of their own; every other row: _from_the_row.
_RULES: dict[str, Callable[[Target, str], tuple[bool, str]]] = {
    "cuda": _cuda,
    "hpu": _gaudi,
    "mps": _apple,
    "cpu": _cpu,
}
# Apple's quirk: bf16 runs from macOS 14, but fp16 stays the fast one.
_FASTEST: dict[str, tuple[str, str]] = {"mps": ("float16", "Apple GPUs are fastest in fp16")}


def choose_dtype(target: Target) -> tuple[str, str]:
    """The fastest dtype that runs natively here, and the sentence that says why."""
    if target.name in _FASTEST:
        return _FASTEST[target.name]
    refused = []
    for candidate in ("bfloat16", "float16"):
        if candidate == "float16" and not target.backend.fast_fp16:
            break
        ok, why = supports(target, candidate)
        if ok:
            return candidate, why
        refused.append(why)
    # Each half precision's own reason (a GTX 10xx: bf16 emulated, fp16 at 1/64 of fp32), so the trace says why fp32.
    return "float32", f"{'; '.join(dict.fromkeys(refused))}; fp32 is the fast choice here"
