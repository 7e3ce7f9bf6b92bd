"""A bitsandbytes quantization plan: the bits, the compute dtype, the bytes saved, and the config that loads it."""

from __future__ import annotations

from typing import Any

from whichdevice.core.frozen import frozen_record

__all__ = ["QuantizationPlan"]


@frozen_record
class QuantizationPlan:
    """Load with bitsandbytes in ``bits`` bits, computing in ``compute_dtype``.

    The byte counts are None when the model's size (or the memory) was not known.
    """

    bits: int
    compute_dtype: str
    full_bytes: int | None
    quantized_bytes: int | None
    budget_bytes: int | None
    explanation: str
    requested: bool = False

    @property
    def method(self) -> str:
        return "bitsandbytes-nf4" if self.bits == 4 else "bitsandbytes-int8"

    @property
    def saved_bytes(self) -> int | None:
        if self.full_bytes is None or self.quantized_bytes is None:
            return None
        return self.full_bytes - self.quantized_bytes

    def config(self) -> Any:
        """The ``transformers.BitsAndBytesConfig`` for from_pretrained's ``quantization_config``."""
        import torch
        from transformers import BitsAndBytesConfig

        make: Any = BitsAndBytesConfig  # untyped in transformers
        if self.bits == 8:
            return make(load_in_8bit=True)
        return make(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
            bnb_4bit_use_double_quant=True,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "method": self.method,
            "compute_dtype": self.compute_dtype,
            "reason": "requested" if self.requested else "does-not-fit",
            "full_bytes": self.full_bytes,
            "quantized_bytes": self.quantized_bytes,
            "saved_bytes": self.saved_bytes,
            "budget_bytes": self.budget_bytes,
            "explanation": self.explanation,
        }
