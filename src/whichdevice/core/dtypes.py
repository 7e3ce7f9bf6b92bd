"""The dtype vocabulary: torch's names, TrainingArguments' short flags, safetensors' codes, item sizes.

One table so that "bfloat16", "bf16" and "BF16" are one fact: whichdevice decides among the three
floating dtypes below, and every module that spells one of them another way asks here.
"""

from __future__ import annotations

__all__ = [
    "FLOAT_CODES",
    "NAMES",
    "SAFETENSORS_BITS",
    "code_name",
    "from_short",
    "item_size",
    "short_name",
]

# (torch's name, TrainingArguments' flag / accelerate's mixed_precision, safetensors' code, bytes).
_DTYPES = (
    ("float32", "fp32", "F32", 4),
    ("bfloat16", "bf16", "BF16", 2),
    ("float16", "fp16", "F16", 2),
)
NAMES = tuple(row[0] for row in _DTYPES)
_SHORT = {name: short for name, short, _, _ in _DTYPES}
_LONG = {short: name for name, short, _, _ in _DTYPES}
_FROM_CODE = {code: name for name, _, code, _ in _DTYPES}
_SIZE = {name: size for name, _, _, size in _DTYPES}

# safetensors' Dtype names and bits per element (safetensors/src/tensor.rs).
SAFETENSORS_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# The floating-point codes: the weights a dtype choice or quantization applies to.
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"})


def short_name(name: str) -> str:
    """The short name of ``name``: bf16 for bfloat16, fp16 for float16, fp32 for float32 (KeyError otherwise)."""
    return _SHORT[name]


def from_short(short: str) -> str:
    """The name of a short name: bfloat16 for bf16, float16 for fp16, float32 for fp32 (KeyError otherwise)."""
    return _LONG[short]


def code_name(code: str) -> str | None:
    """torch's name of a safetensors code ("BF16" -> "bfloat16"); None outside the three floats."""
    return _FROM_CODE.get(code)


def item_size(name: str | None) -> int:
    """Bytes per element of ``name``; 4 (float32's) for None or a dtype whichdevice does not choose."""
    return _SIZE.get(name, 4) if name is not None else 4
