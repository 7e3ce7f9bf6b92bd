"""How big a model is in a given dtype, and the dtype its checkpoint stores.

Sizes come from safetensors headers (8-byte length + JSON; no tensor is read) or, without
safetensors, from a build of the config on the meta device. The headers and config are read once,
by :func:`whichdevice.model.facts.read_model_facts`; this module turns them into figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whichdevice.core.dtypes import FLOAT_CODES, NAMES, SAFETENSORS_BITS, code_name, item_size
from whichdevice.core.errors import DeviceError
from whichdevice.model.files import DamagedModelError, refetch_hint, resolve_model_path

__all__ = [
    "CheckpointDtype",
    "ModelSize",
    "StoredWeights",
    "auto_config",
    "config_object_dtype",
    "resolve_model_path",
    "size_from_config",
    "stored_dtype",
    "stored_weights",
]


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of a model, split the way dtype and quantization treat them."""

    source: str
    float_params: int
    # Weights of 2-D linear layers (what bitsandbytes quantizes); embeddings and lm_head excluded.
    linear_params: int
    other_bytes: int = 0

    @property
    def parameters(self) -> int:
        return self.float_params

    def bytes_in(self, dtype: str) -> int:
        return self.float_params * item_size(dtype) + self.other_bytes

    def bytes_quantized(self, bits: int, dtype: str) -> int:
        """Estimated weights in memory with linear layers in ``bits``-bit (bitsandbytes) and the rest in dtype."""
        rest = self.float_params - self.linear_params
        # 4-bit NF4 also stores one absmax per 64-weight block (double-quantized: ~0.127 bits/weight).
        per_weight = bits / 8 + (0.016 if bits == 4 else 0.0)
        return int(self.linear_params * per_weight + rest * item_size(dtype) + self.other_bytes)


def _is_linear(name: str, shape: list[int]) -> bool:
    lowered = name.lower()
    return (
        len(shape) == 2
        and lowered.endswith("weight")
        and "embed" not in lowered
        and "lm_head" not in lowered
        and "wte" not in lowered
        and "wpe" not in lowered
    )


@dataclass(frozen=True)
class StoredWeights:
    """What a checkpoint's safetensors headers say: parameters and bytes per safetensors dtype."""

    source: str
    float_params: int
    linear_params: int
    other_bytes: int
    # (safetensors code, parameters, bytes stored), one per code the headers name
    by_code: tuple[tuple[str, int, int], ...]

    def model_size(self) -> ModelSize:
        return ModelSize(self.source, self.float_params, self.linear_params, self.other_bytes)

    def most_float_code(self) -> str | None:
        """The floating-point code most weights are stored in; None when no weight is floating-point."""
        floats = {code: params for code, params, _ in self.by_code if code in FLOAT_CODES}
        return max(floats, key=lambda c: floats[c]) if floats else None


def stored_weights(headers: tuple[tuple[Path, Mapping[str, Mapping[str, Any]]], ...]) -> StoredWeights | None:
    """The figures of already read and checked headers ((file, tensors) each); None without a file."""
    if not headers:
        return None
    float_params = linear = other = 0
    by_code: dict[str, list[int]] = {}
    for _, tensors in headers:
        for name, info in tensors.items():
            code, count = info["dtype"], math.prod(info["shape"])
            stored = by_code.setdefault(code, [0, 0])
            stored[0] += count
            stored[1] += count * SAFETENSORS_BITS[code] // 8
            if code in FLOAT_CODES:
                float_params += count
                if _is_linear(name, info["shape"]):
                    linear += count
            else:
                other += count * SAFETENSORS_BITS[code] // 8
    files = [file for file, _ in headers]
    where = files[0].parent if len(files) > 1 else files[0]
    codes = tuple((code, p, b) for code, (p, b) in sorted(by_code.items()))
    return StoredWeights(f"safetensors headers ({len(files)} file(s) in {where})", float_params, linear, other, codes)


def size_from_config(config: Any) -> ModelSize:
    """The parameters of a transformers config's model, built on the meta device (imports transformers)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    model = None
    errors = []
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                model = auto.from_config(config)  # type: ignore[no-untyped-call]
            break
        except Exception as exc:
            errors.append(f"{auto.__name__}: {exc}")
    if model is None:
        raise DeviceError(
            f"cannot size a {type(config).__name__}: {'; '.join(errors)}; pass max_memory and a "
            "device explicitly, or a folder with safetensors weights"
        )
    float_params = linear = 0
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if param.is_floating_point():
            float_params += param.numel()
            if _is_linear(name, list(param.shape)):
                linear += param.numel()
    return ModelSize(f"a meta-device build of {type(config).__name__}", float_params, linear)


def auto_config(folder: Path) -> Any:
    """transformers' config for the config.json in ``folder`` (a model without safetensors weights)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # transformers' OSError/ValueError/KeyError, or arithmetic on a bad value
        raise DamagedModelError(
            f"{folder / 'config.json'}: transformers cannot build a config from it ({type(exc).__name__}: {exc}); "
            f"if this transformers knows the model, the file is damaged: {refetch_hint(folder)}"
        ) from None


@dataclass(frozen=True)
class CheckpointDtype:
    """The dtype a checkpoint's weights are stored in, its architecture, and where they were read."""

    dtype: str | None  # "bfloat16", "float16", "float32"; None when not stated (or another dtype)
    model_type: str | None
    source: str


def _canonical(value: Any) -> str | None:
    name = str(value).removeprefix("torch.") if value is not None else ""
    return name if name in NAMES else None


def stored_dtype(config: Mapping[str, Any] | None, stored: StoredWeights | None) -> CheckpointDtype:
    """What a checkpoint says about its own dtype, as vLLM reads it: config.json's ``dtype`` (or
    ``torch_dtype``), else the dtype most safetensors weights are stored in."""
    config = config or {}
    model_type = config.get("model_type") or None
    stated = config.get("dtype") or config.get("torch_dtype")
    if _canonical(stated):
        return CheckpointDtype(_canonical(stated), model_type, f"config.json's dtype {stated!r}")
    code = stored.most_float_code() if stored is not None else None
    if code is None:
        return CheckpointDtype(None, model_type, "neither config.json nor safetensors headers state a dtype")
    return CheckpointDtype(code_name(code), model_type, f"the safetensors headers: most weights are {code}")


def config_object_dtype(config: Any) -> CheckpointDtype:
    """What a transformers config object states about its dtype (its ``dtype`` or ``torch_dtype``)."""
    stated = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    where = f"the config's dtype {stated}" if stated is not None else "the config, which states no dtype"
    return CheckpointDtype(_canonical(stated), getattr(config, "model_type", None) or None, where)
