"""How big a model is in a given dtype, and where it fits: one device, several, or nowhere.

Sizes come from safetensors headers (8-byte length + JSON; no tensor is read) or, without
safetensors, from a build of the config on the meta device. A model id is looked up in the local
Hugging Face cache only: whichdevice never downloads.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whichdevice.errors import DeviceError
from whichdevice.modelfiles import (
    DamagedModelError,
    check_config,
    read_config,
    read_header,
    refetch_hint,
    resolve_model_path,
)

__all__ = [
    "FIT_FRACTION",
    "MAX_SIZE",
    "SPLIT_FRACTION",
    "CheckpointDtype",
    "ModelSize",
    "Placement",
    "checkpoint_dtype",
    "estimate_model_size",
    "format_bytes",
    "parse_size",
    "plan_placement",
    "resolve_model_path",
]

GiB = 1024**3
# A model "fits" one device when its weights take at most this share of the memory; the rest is
# for activations, the KV cache and the runtime's own allocations.
FIT_FRACTION = 0.8
# When a model must be split, each device offers this share to accelerate's max_memory.
SPLIT_FRACTION = 0.9

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}
_ST_ITEMSIZE = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}


# No machine has an exbibyte of memory: a larger size is a typo (1e30, a value in bits, ...).
MAX_SIZE = 2**60


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from 1234, "80GiB", "16GB", "512MiB" (accelerate's max_memory forms), below 1 EiB."""
    if isinstance(value, bool) or value is None:
        raise DeviceError(f"{what}={value!r} is not a size; write e.g. '20GiB' or a number of bytes")
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        if value < 0:
            raise DeviceError(f"{what}={value!r} is negative; write a size such as '20GiB'")
        if value >= MAX_SIZE:
            raise DeviceError(f"{what}={value!r} is larger than any machine's memory (1 EiB); write e.g. '20GiB'")
        return int(value)
    if not isinstance(value, str):
        raise DeviceError(f"{what}={value!r} is not a size; write e.g. '20GiB', '16GB' or a number of bytes")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(TiB|GiB|MiB|KiB|TB|GB|MB|KB|T|G|M|K|B)?\s*", str(value), re.IGNORECASE)
    if not match:
        raise DeviceError(f"{what}={value!r} is not a size; write e.g. '20GiB', '16GB' or a number of bytes")
    number = float(match.group(1))
    unit = (match.group(2) or "B").lower()
    scale = {
        "tib": 1024**4,
        "t": 1024**4,
        "tb": 1000**4,
        "gib": GiB,
        "g": GiB,
        "gb": 1000**3,
        "mib": 1024**2,
        "m": 1024**2,
        "mb": 1000**2,
        "kib": 1024,
        "k": 1024,
        "kb": 1000,
        "b": 1,
    }[unit]
    # A 400-digit number parses as float("inf"); no machine has that much memory.
    if not math.isfinite(number * scale) or number * scale >= MAX_SIZE:
        raise DeviceError(f"{what}={value!r} is larger than any machine's memory; write e.g. '20GiB'")
    return int(number * scale)


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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
        return self.float_params * _ITEMSIZE.get(dtype, 4) + self.other_bytes

    def bytes_quantized(self, bits: int, dtype: str) -> int:
        """Estimated weights in memory with linear layers in ``bits``-bit (bitsandbytes) and the rest in dtype."""
        rest = self.float_params - self.linear_params
        # 4-bit NF4 also stores one absmax per 64-weight block (double-quantized: ~0.127 bits/weight).
        per_weight = bits / 8 + (0.016 if bits == 4 else 0.0)
        return int(self.linear_params * per_weight + rest * _ITEMSIZE.get(dtype, 4) + self.other_bytes)


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


def _from_safetensors(files: list[Path]) -> ModelSize:
    float_params = linear = other = 0
    for path in files:
        for name, info in read_header(path).items():
            count = math.prod(info["shape"])
            if info["dtype"] in _FLOAT_CODES:
                float_params += count
                if _is_linear(name, info["shape"]):
                    linear += count
            else:
                other += count * _ST_ITEMSIZE.get(info["dtype"], 4)
    where = files[0].parent if len(files) > 1 else files[0]
    return ModelSize(f"safetensors headers ({len(files)} file(s) in {where})", float_params, linear, other)


def _from_config(config: Any) -> ModelSize:
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


def estimate_model_size(model: Any) -> ModelSize:
    """Size of ``model``: a local folder or file, a cached model id, or a transformers config."""
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):
        check_config(model.to_dict(), f"model=<{type(model).__name__}>")
        return _from_config(model)
    if not isinstance(model, (str, os.PathLike)):
        raise DeviceError(
            f"model= takes a local path, a cached model id or a transformers config, not {type(model).__name__}"
        )
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".safetensors":
        return _from_safetensors([path])
    files = sorted(path.glob("*.safetensors"))
    if files:
        return _from_safetensors(files)
    if read_config(path) is not None:
        return _from_config(_auto_config(path))
    raise DeviceError(f"{path} has neither *.safetensors files nor a config.json to size the model from")


def _auto_config(folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # transformers' OSError/ValueError/KeyError, or arithmetic on a bad value
        raise DamagedModelError(
            f"{folder / 'config.json'}: transformers cannot build a config from it ({type(exc).__name__}: {exc}); "
            f"if this transformers knows the model, the file is damaged: {refetch_hint(folder)}"
        ) from None


@dataclass(frozen=True)
class Placement:
    """Where the weights go: ``device_map`` and, when split, ``max_memory``."""

    device_map: str | dict[str, Any]
    max_memory: dict[int | str, str] | None
    note: str
    fits: bool = True


def plan_placement(
    weights: int,
    device: str,
    capacities: dict[int | str, int],
    *,
    budget_given: bool,
    can_split: bool,
    backend: str,
    what: str = "the weights",
) -> Placement:
    """Place ``weights`` bytes: on ``device`` when it fits there, split with "auto" when it needs
    several of ``capacities`` (device key -> bytes), else a Placement with ``fits=False``.
    ``what`` names the bytes in the notes (the job's memory can be more than the weights)."""
    fraction = 1.0 if budget_given else FIT_FRACTION
    need = format_bytes(weights)
    first_key = next(iter(capacities))
    first = capacities[first_key]
    if weights <= first * fraction:
        return Placement(
            device,
            None,
            f"{what} ({need}) fit on {device} ({format_bytes(first)}"
            + (" budget)" if budget_given else f", {int(FIT_FRACTION * 100)}% usable)"),
        )
    split_fraction = 1.0 if budget_given else SPLIT_FRACTION
    total = sum(capacities.values()) * split_fraction
    if can_split and len(capacities) > 1 and weights <= total:
        max_memory = {key: f"{int(cap * split_fraction // (1024**2))}MiB" for key, cap in capacities.items()}
        return Placement(
            "auto",
            max_memory,
            f"{what} ({need}) do not fit one {backend} device ({format_bytes(first)}); split over "
            f"{len(capacities)} devices with device_map='auto' ({format_bytes(total)} usable)",
        )
    where = (
        f"{len(capacities)} {backend} devices ({format_bytes(total)} usable)"
        if len(capacities) > 1 and can_split
        else f"{device} ({format_bytes(first * fraction)} usable)"
    )
    return Placement(device, None, f"{what} ({need}) do not fit {where}", fits=False)


_DTYPE_CODES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class CheckpointDtype:
    """The dtype a checkpoint's weights are stored in, its architecture, and where they were read."""

    dtype: str | None  # "bfloat16", "float16", "float32"; None when not stated (or another dtype)
    model_type: str | None
    source: str


def _canonical(value: Any) -> str | None:
    name = str(value).removeprefix("torch.") if value is not None else ""
    return name if name in _ITEMSIZE else None


def checkpoint_dtype(model: Any) -> CheckpointDtype | None:
    """What ``model`` says about its own dtype, as vLLM reads it: the config's ``dtype`` (or
    ``torch_dtype``), else the dtype most safetensors weights are stored in. None when ``model``
    cannot be read here (placement then says why)."""
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):
        stated = getattr(model, "dtype", None) or getattr(model, "torch_dtype", None)
        where = f"the config's dtype {stated}" if stated is not None else "the config, which states no dtype"
        return CheckpointDtype(_canonical(stated), getattr(model, "model_type", None) or None, where)
    if not isinstance(model, (str, os.PathLike)):
        return None
    try:
        path = resolve_model_path(model)
    except DamagedModelError:
        raise
    except DeviceError:
        return None  # placement says why the model cannot be found
    folder = path if path.is_dir() else path.parent
    config = read_config(folder) or {}
    model_type = config.get("model_type") or None
    stated = config.get("dtype") or config.get("torch_dtype")
    if _canonical(stated):
        return CheckpointDtype(_canonical(stated), model_type, f"config.json's dtype {stated!r}")
    files = [path] if path.is_file() else sorted(folder.glob("*.safetensors"))
    counts: dict[str, int] = {}
    for file in files:
        for info in read_header(file).values():
            if info["dtype"] in _FLOAT_CODES:
                counts[info["dtype"]] = counts.get(info["dtype"], 0) + math.prod(info["shape"])
    if not counts:
        return CheckpointDtype(None, model_type, "neither config.json nor safetensors headers state a dtype")
    code = max(counts, key=lambda c: counts[c])
    return CheckpointDtype(_DTYPE_CODES.get(code), model_type, f"the safetensors headers: most weights are {code}")
