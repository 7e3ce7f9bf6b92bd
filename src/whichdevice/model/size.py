"""How big a model is in a given dtype, and the dtype its checkpoint stores.

Sizes come from safetensors headers (8-byte length + JSON; no tensor is read) or, without
safetensors, from a build of the config on the meta device. A model id is looked up in the local
Hugging Face cache only: whichdevice never downloads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from whichdevice.core.errors import DeviceError
from whichdevice.model.files import (
    DamagedModelError,
    check_config,
    read_config,
    read_header,
    refetch_hint,
    resolve_model_path,
)

__all__ = [
    "CheckpointDtype",
    "ModelSize",
    "checkpoint_dtype",
    "estimate_model_size",
    "resolve_model_path",
]


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
                model = auto.from_config(config, trust_remote_code=False)  # type: ignore[no-untyped-call]
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
    config = read_config(path)
    if config is not None:
        unknown = _own_code(config)
        if unknown is not None:
            raise DeviceError(
                f"{path} cannot be sized: {unknown}, and whichdevice never runs a model's own code; save "
                "the weights as safetensors (save_pretrained writes them) so their headers give the size, "
                "or leave model= out and pass device= (and device_map=) yourself; if it is a newer "
                "architecture, a newer transformers may have it (pip install -U transformers)"
            )
        size = _from_config(_auto_config(path))
        if config.get("auto_map"):
            not_run = "transformers' own classes: the folder's code, auto_map, was not run"
            return replace(size, source=f"{size.source} ({not_run})")
        return size
    raise DeviceError(f"{path} has neither *.safetensors files nor a config.json to size the model from")


def _own_code(config: dict[str, Any]) -> str | None:
    """Why only the model's own code could build ``config`` (an architecture the installed
    transformers does not have), or None when transformers builds it with its own classes."""
    from transformers import __version__
    from transformers.models.auto import configuration_auto

    if config["model_type"] in getattr(configuration_auto, "CONFIG_MAPPING_NAMES", {}):
        return None
    brings = " and the folder brings its own code (auto_map)" if config.get("auto_map") else ""
    return f"transformers {__version__} has no model_type {config['model_type']!r}{brings}"


def _auto_config(folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        # trust_remote_code=False: never the folder's configuration_*.py, and never the question on
        # stdin that a piped `yes` (or a user) would answer by running it.
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:  # transformers' OSError/ValueError/KeyError, or arithmetic on a bad value
        raise DamagedModelError(
            f"{folder / 'config.json'}: transformers cannot build a config from it ({type(exc).__name__}: {exc}); "
            f"if this transformers knows the model, the file is damaged: {refetch_hint(folder)}"
        ) from None


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
