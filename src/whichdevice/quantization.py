"""bitsandbytes quantization when a model does not fit, on the backends bitsandbytes supports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from whichdevice.errors import ConfigConflictError, DeviceError, DoesNotFitError
from whichdevice.probes import package_version
from whichdevice.sizing import FIT_FRACTION, ModelSize, format_bytes

if TYPE_CHECKING:
    from whichdevice.probing import ProbeResult
    from whichdevice.registry import Backend

__all__ = ["QUANTIZE_CHOICES", "QuantizationPlan", "bitsandbytes_supports", "plan_quantization"]

QUANTIZE_CHOICES = ("auto", "4bit", "8bit", None)


@dataclass(frozen=True)
class QuantizationPlan:
    """Load with bitsandbytes in ``bits`` bits, computing in ``compute_dtype``."""

    bits: int
    compute_dtype: str
    full_bytes: int
    quantized_bytes: int
    budget_bytes: int
    explanation: str

    def config(self) -> Any:
        """The ``transformers.BitsAndBytesConfig`` for from_pretrained's ``quantization_config``."""
        import torch
        from transformers import BitsAndBytesConfig

        if self.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
            bnb_4bit_use_double_quant=True,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "method": "bitsandbytes-nf4" if self.bits == 4 else "bitsandbytes-int8",
            "compute_dtype": self.compute_dtype,
            "full_bytes": self.full_bytes,
            "quantized_bytes": self.quantized_bytes,
            "budget_bytes": self.budget_bytes,
        }


def bitsandbytes_supports(backend: Backend, result: ProbeResult) -> tuple[bool, str]:
    """Whether bitsandbytes runs on this backend (its own device list; Gaudi 2 and 3 only)."""
    if not backend.bitsandbytes:
        return False, (
            f"bitsandbytes does not support {backend.name} ({backend.hardware}); it supports cuda "
            "(NVIDIA and ROCm), xpu, hpu (Gaudi 2/3), npu, mps and cpu"
        )
    if backend.name == "hpu" and any(d.generation == "gaudi1" for d in result.devices):
        return False, "bitsandbytes 4-bit and 8-bit need Gaudi 2 or newer; this is Gaudi 1"
    return True, f"bitsandbytes supports {backend.name}"


def plan_quantization(
    size: ModelSize,
    backend: Backend,
    result: ProbeResult,
    dtype: str,
    capacities: dict[int | str, int],
    quantize: str | None,
    does_not_fit: str,
    budget_given: bool,
) -> QuantizationPlan:
    """The quantization that makes ``size`` fit the first device, or a DeviceError with the numbers."""
    if quantize not in QUANTIZE_CHOICES:
        raise DeviceError(f"quantize={quantize!r}: use 'auto', '4bit', '8bit' or None")
    full = size.bytes_in(dtype)
    budget = next(iter(capacities.values()))
    usable = budget if budget_given else int(budget * FIT_FRACTION)
    if quantize is None:
        raise DoesNotFitError(
            f"{does_not_fit}. Pass quantize='auto' to load it in 4-bit with bitsandbytes "
            f"(about {format_bytes(size.bytes_quantized(4, dtype))}), give more memory (max_memory), "
            "or use a machine with more devices"
        )
    ok, why = bitsandbytes_supports(backend, result)
    if not ok:
        raise ConfigConflictError(f"{does_not_fit}, and quantizing it is not possible: {why}")
    if package_version("bitsandbytes") is None:
        raise DoesNotFitError(
            f"{does_not_fit}; 4-bit loading would fit it but bitsandbytes is not installed: "
            "pip install bitsandbytes (or pip install 'whichdevice[quantization]')"
        )
    bits = 8 if quantize == "8bit" else 4
    quantized = size.bytes_quantized(bits, dtype)
    if quantized > usable:
        raise DoesNotFitError(
            f"{does_not_fit}; even in {bits}-bit it needs {format_bytes(quantized)} against "
            f"{format_bytes(usable)} usable. Give more memory (max_memory) or use more devices"
        )
    explanation = (
        f"{bits}-bit {'NF4' if bits == 4 else 'int8'} with bitsandbytes, computing in {dtype}: "
        f"{format_bytes(full)} in {dtype} needs more than the {format_bytes(usable)} usable; "
        f"{bits}-bit needs about {format_bytes(quantized)} (saves {format_bytes(full - quantized)})"
    )
    return QuantizationPlan(bits, dtype, full, quantized, usable, explanation)
