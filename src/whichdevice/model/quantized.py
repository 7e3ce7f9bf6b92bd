"""The checkpoint's own quantization: which method, how many bits, how many bytes stored, what it needs.

Pure functions over data already read (a config dict, safetensors header entries). The method is
recognised by transformers' own ``AUTO_QUANTIZATION_CONFIG_MAPPING`` (transformers/quantizers/auto.py),
the same way ``AutoQuantizationConfig.from_dict`` reads it, so a method transformers adds is known
here without an edit, and one this transformers does not know fails closed with the fix.

What each method needs to run (``NEEDS``) is typed from the installed transformers' quantizer sources
(``validate_environment`` of transformers/quantizers/quantizer_*.py, 5.25): one row per method with its
file:line; a method without a row is reported as unchecked (transformers decides at load), never as
runnable. ``tests/model/test_quantized.py`` checks every row's packages against that source, so drift shows.
"""

from __future__ import annotations

import math
from typing import Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.frozen import frozen_record
from whichdevice.core.sizes import format_bytes

__all__ = [
    "NEEDS",
    "CheckpointQuantization",
    "MethodNeeds",
    "known_methods",
    "quant_method_of",
    "read_quantization",
]

# safetensors dtype codes whose tensors transformers casts to the load dtype; every other code
# (packed integers, FP8, FP4, E8M0 scales) stays as stored in a quantized checkpoint.
CAST_CODES = frozenset({"F64", "F32", "F16", "BF16"})
_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16}


@frozen_record
class MethodNeeds:
    """What a quantization method needs, as its transformers quantizer checks it."""

    packages: tuple[str, ...]  # pip distribution names
    backends: frozenset[str] | None  # registry names that run it; None: any backend transformers loads on
    min_capability: tuple[int, int] | None  # CUDA compute capability for its kernels
    dequantizes: bool  # transformers loads it dequantized (to bf16) where it cannot run it, instead of refusing
    source: str


_Q = "transformers/quantizers/"
# Typed from the installed quantizers' validate_environment (transformers 5.25); a row per method.
NEEDS: dict[str, MethodNeeds] = {
    # optimum always; gptqmodel for any device (without it, CUDA only and then an ImportError anyway)
    "gptq": MethodNeeds(
        ("optimum", "gptqmodel"), frozenset({"cuda", "cpu"}), None, False, f"{_Q}quantizer_gptq.py:58-73"
    ),
    # gptqmodel's kernels; bf16 is cast to fp16 on CUDA/XPU (update_dtype, l.54-62)
    "awq": MethodNeeds(("gptqmodel",), frozenset({"cuda", "xpu", "cpu"}), None, False, f"{_Q}quantizer_awq.py:45-62"),
    # without a GPU/XPU, or below cc 8.9, transformers dequantizes a pre-quantized FP8 model to bf16
    "fp8": MethodNeeds((), frozenset({"cuda", "xpu"}), (8, 9), True, f"{_Q}quantizer_finegrained_fp8.py:31-58"),
    "mxfp8": MethodNeeds((), frozenset({"cuda", "xpu"}), (8, 9), True, f"{_Q}quantizer_finegrained_fp8.py:31-58"),
    # fbgemm-gpu on CUDA, cc >= 9.0; an ImportError/ValueError otherwise (no dequantizing load)
    "fbgemm_fp8": MethodNeeds(
        ("fbgemm-gpu",), frozenset({"cuda"}), (9, 0), False, f"{_Q}quantizer_fbgemm_fp8.py:54-75"
    ),
    # cuda (cc >= 7.5), xpu or cpu, with triton and kernels; otherwise dequantized to bf16
    "mxfp4": MethodNeeds(
        ("triton", "kernels"), frozenset({"cuda", "xpu", "cpu"}), (7, 5), True, f"{_Q}quantizer_mxfp4.py:50-121"
    ),
    # bitsandbytes' own device list, as the registry rows record it (memory/quantization.py BNB_DEVICES)
    "bitsandbytes_4bit": MethodNeeds(("bitsandbytes",), None, None, False, f"{_Q}quantizer_bnb_4bit.py:56-68"),
    "bitsandbytes_8bit": MethodNeeds(("bitsandbytes",), None, None, False, f"{_Q}quantizer_bnb_8bit.py:56-68"),
    "compressed-tensors": MethodNeeds(
        ("compressed-tensors",), None, None, False, f"{_Q}quantizer_compressed_tensors.py:67-72"
    ),
    "torchao": MethodNeeds(("torchao",), None, None, False, f"{_Q}quantizer_torchao.py:67-69"),
    "quanto": MethodNeeds(("optimum-quanto",), None, None, False, f"{_Q}quantizer_quanto.py:46-50"),
    # hqq checked in __init__ (l.44-47); validate_environment refuses cpu/disk in a device_map (l.50-57)
    "hqq": MethodNeeds(("hqq",), None, None, False, f"{_Q}quantizer_hqq.py:44-57"),
}

# How a method's name reads in the trace.
_LABELS = {"gptq": "GPTQ", "awq": "AWQ", "fp8": "FP8", "mxfp8": "MXFP8", "mxfp4": "MXFP4", "fbgemm_fp8": "FP8 (fbgemm)"}
_LABELS |= {"bitsandbytes_4bit": "bitsandbytes", "bitsandbytes_8bit": "bitsandbytes", "hqq": "HQQ", "nvfp4": "NVFP4"}

# Bits per weight of methods whose config states no bit width: their format fixes it.
_FORMAT_BITS = {"fp8": 8, "mxfp8": 8, "fbgemm_fp8": 8, "mxfp4": 4, "nvfp4": 4, "bitsandbytes_4bit": 4}
_FORMAT_BITS |= {"bitsandbytes_8bit": 8, "eetq": 8, "bitnet": 2}


def known_methods() -> tuple[str, ...]:
    """The quant_method values the installed transformers loads (its own mapping)."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    return tuple(AUTO_QUANTIZATION_CONFIG_MAPPING)


def quant_method_of(quantization_config: Any, where: str) -> str:
    """The method key, read as ``AutoQuantizationConfig.from_dict`` reads it (transformers/quantizers/auto.py)."""
    if not isinstance(quantization_config, dict):
        raise DeviceError(f"{where}: quantization_config is a {type(quantization_config).__name__}, not an object")
    method = quantization_config.get("quant_method")
    # bitsandbytes saves quant_method "bitsandbytes" and the bit width in load_in_4bit/load_in_8bit.
    if quantization_config.get("load_in_4bit") is True:
        method = "bitsandbytes_4bit"
    elif quantization_config.get("load_in_8bit") is True:
        method = "bitsandbytes_8bit"
    known = known_methods()
    if not isinstance(method, str) or method not in known:
        import transformers

        raise DeviceError(
            f"{where}: quantization_config has quant_method={str(method)[:60]!r}, which transformers "
            f"{transformers.__version__} does not load (it knows {', '.join(known)}); upgrade transformers "
            "(pip install -U transformers) if the method is newer, or fix the file"
        )
    return method


@frozen_record
class CheckpointQuantization:
    """A pre-quantized checkpoint: its method, bit width, group size, compute dtype and stored size."""

    method: str
    bits: int | None
    group_size: int | None
    compute_dtype: str | None
    stored_bytes: int | None  # the weights as stored (headers), None when only a config was read
    estimated_bytes: int | None  # from bits and group size, when only a config was read
    source: str

    @property
    def label(self) -> str:
        return _LABELS.get(self.method, self.method)

    @property
    def loads_as_stored(self) -> bool:
        """Whether from_pretrained loads this checkpoint's float weights as stored and computes in its saved
        compute dtype whatever dtype= says: bitsandbytes (transformers 5.25, merge_quantization_configs keeps
        the model's own config; read back in tests/model/test_quantized.py)."""
        return self.method.startswith("bitsandbytes")

    @property
    def needs(self) -> MethodNeeds | None:
        return NEEDS.get(self.method)

    @property
    def size_bytes(self) -> int | None:
        return self.stored_bytes if self.stored_bytes is not None else self.estimated_bytes

    def describe(self) -> str:
        parts = [self.label + (f" {self.bits}-bit" if self.bits else "")]
        if self.group_size:
            parts.append(f"group {self.group_size}")
        if self.stored_bytes is not None:
            parts.append(f"{format_bytes(self.stored_bytes)} stored")
        elif self.estimated_bytes is not None:
            parts.append(f"about {format_bytes(self.estimated_bytes)} from its bits and group size")
        return ", ".join(parts)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 2**20 else None


def _bits_and_group(method: str, qc: dict[str, Any]) -> tuple[int | None, int | None]:
    if method in _FORMAT_BITS:
        block = qc.get("weight_block_size")
        group = _int(block[-1]) if isinstance(block, list) and block else None
        return _FORMAT_BITS[method], group or (32 if method in ("mxfp4", "mxfp8") else None)
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict):
                return _int(weights.get("num_bits")), _int(weights.get("group_size"))
        return None, None
    if method == "hqq":
        inner: Any = qc.get("quant_config") if isinstance(qc.get("quant_config"), dict) else qc
        params: Any = inner.get("weight_quant_params", inner)
        if not isinstance(params, dict):
            return None, None
        return _int(params.get("nbits")), _int(params.get("group_size"))
    if method == "quanto":
        text = str(qc.get("weights", ""))
        return (8 if "8" in text else 4 if "4" in text else 2 if "2" in text else None), None
    if method == "torchao":
        text = str(qc.get("quant_type", ""))
        return (8 if "Int8" in text or "int8" in text else 4 if "Int4" in text or "int4" in text else None), None
    return _int(qc.get("bits")), _int(qc.get("group_size"))


def _compute_dtype(method: str, qc: dict[str, Any]) -> str | None:
    if method == "bitsandbytes_4bit":
        # Saved by BitsAndBytesConfig.to_dict() as a name ("float32", "bfloat16", ...).
        name = str(qc.get("bnb_4bit_compute_dtype", "")).removeprefix("torch.")
        return name if name in ("float32", "bfloat16", "float16") else None
    return None


def stored_bytes(headers: list[dict[str, dict[str, Any]]]) -> int:
    """The bytes every tensor takes as stored: packed integers, scales, zeros and float weights."""
    from whichdevice.core.dtypes import SAFETENSORS_BITS

    return sum(math.prod(i["shape"]) * SAFETENSORS_BITS.get(i["dtype"], 32) // 8 for h in headers for i in h.values())


def estimate_stored(bits: int, group_size: int | None, quantized_params: int, other_params: int) -> int:
    """Stored bytes from the config alone: each quantized weight in ``bits`` bits plus, per group,
    an fp16 scale and a zero point in ``bits`` bits (GPTQ/AWQ layout); other weights in 16 bits."""
    per_group = (2 + bits / 8) / group_size if group_size else 0.0
    return int(quantized_params * (bits / 8 + per_group) + other_params * 2)


def read_quantization(
    config: dict[str, Any],
    where: str,
    headers: list[dict[str, dict[str, Any]]] | None = None,
    params: tuple[int, int] | None = None,
) -> CheckpointQuantization | None:
    """The checkpoint's quantization from its config.json dict (None when it has none).

    ``headers``: the safetensors header entries when the weights are here (stored bytes are then
    summed from them); ``params``: (weights quantized, other weights) to estimate the stored bytes
    from bits and group size when only a config was read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = quant_method_of(qc, where)
    bits, group = _bits_and_group(method, qc)
    stored = stored_bytes(headers) if headers else None
    estimated = None
    if stored is None and params is not None and bits:
        estimated = estimate_stored(bits, group, *params)
    return CheckpointQuantization(method, bits, group, _compute_dtype(method, qc), stored, estimated, where)
