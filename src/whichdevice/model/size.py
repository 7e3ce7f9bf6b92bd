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
from whichdevice.model.adapter import adapter_base_name
from whichdevice.model.files import (
    SAFETENSORS_DTYPES,
    DamagedModelError,
    check_config,
    read_config,
    read_header,
    refetch_hint,
    resolve_model_path,
)
from whichdevice.model.quantized import CAST_CODES, CheckpointQuantization, estimate_stored, read_quantization

__all__ = [
    "CheckpointDtype",
    "ModelSize",
    "checkpoint_dtype",
    "estimate_model_size",
    "resolve_model_path",
]


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of a model, split the way dtype and quantization treat them."""

    source: str
    float_params: int
    # Weights of 2-D linear layers (what bitsandbytes quantizes); embeddings and lm_head excluded.
    linear_params: int
    other_bytes: int = 0
    # The checkpoint's own quantization: its packed weights are other_bytes, kept as stored.
    quantized: CheckpointQuantization | None = None

    @property
    def parameters(self) -> int:
        quant = self.quantized
        if quant is not None and quant.bits:
            # Packed bytes per weight: the bits, plus a scale and a zero point per group (estimate_stored).
            per_weight = quant.bits / 8 + ((2 + quant.bits / 8) / quant.group_size if quant.group_size else 0.0)
            return self.float_params + int(self.other_bytes / per_weight)
        return self.float_params

    def dequantized(self) -> ModelSize:
        """The same model with its packed weights unpacked to floats (transformers' dequantizing load)."""
        return ModelSize(f"{self.source}, dequantized", self.parameters, self.linear_params, 0, self.quantized)

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


def _from_safetensors(files: list[Path], config: dict[str, Any] | None = None) -> ModelSize:
    float_params = linear = other = 0
    headers = [read_header(path) for path in files]
    where = files[0].parent if len(files) > 1 else files[0]
    quantized = read_quantization(config or {}, f"{where}", headers)
    # In a quantized checkpoint only the float tensors follow the load dtype; FP8/FP4 stay as stored.
    floats = CAST_CODES if quantized is not None else _FLOAT_CODES
    for header in headers:
        for name, info in header.items():
            count = math.prod(info["shape"])
            if info["dtype"] in floats:
                float_params += count
                if _is_linear(name, info["shape"]):
                    linear += count
            else:
                other += count * SAFETENSORS_DTYPES.get(info["dtype"], 32) // 8
    source = f"safetensors headers ({len(files)} file(s) in {where})"
    return ModelSize(source, float_params, linear, other, quantized)


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
    float_params = linear = matrices = 0
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if param.is_floating_point():
            float_params += param.numel()
            if _is_linear(name, list(param.shape)):
                linear += param.numel()
            if param.dim() > 2 and _is_linear(name + ".weight", [1, 1]):
                matrices += param.numel()  # fused MoE experts ([experts, in, out]): quantized like linears
    source = f"a meta-device build of {type(config).__name__}"
    quantizable = linear + matrices
    params = (quantizable, float_params - quantizable)
    quantized = read_quantization(_config_dict(config), source, params=params)
    if quantized is None or quantized.estimated_bytes is None:
        return ModelSize(source, float_params, linear, 0, quantized)
    # The quantized layers' packed bytes, estimated from bits and group size; the rest stays float.
    packed = estimate_stored(quantized.bits or 16, quantized.group_size, quantizable, 0)
    return ModelSize(source, float_params - quantizable, 0, packed, quantized)


def _config_dict(config: Any) -> dict[str, Any]:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return {}
    return {"quantization_config": qc if isinstance(qc, dict) else qc.to_dict()}


def estimate_model_size(model: Any) -> ModelSize:
    """Size of ``model``: a local folder or file, a cached model id, or a transformers config."""
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):
        check_config(model.to_dict(), f"model=<{type(model).__name__}>")
        return _from_config(model)
    if not isinstance(model, (str, os.PathLike)):
        raise DeviceError(
            f"model= takes a local path, a cached model id or a transformers config, not {type(model).__name__}"
        )
    size = _from_path(resolve_model_path(model))
    folder = Path(model).expanduser()
    if adapter_base_name(folder) is None:
        return size
    # An adapter folder: its base model (resolve_model_path followed it) plus the adapter's weights.
    extra = adapter_bytes(folder)
    return replace(size, other_bytes=size.other_bytes + extra, source=f"{size.source}, plus the adapter in {folder}")


def adapter_bytes(folder: Path) -> int:
    """An adapter's weights in bytes: safetensors headers, else the .bin file's length (never unpickled)."""
    total = 0
    for file in sorted(folder.glob("adapter_model*.safetensors")):
        for info in read_header(file).values():
            total += math.prod(info["shape"]) * SAFETENSORS_DTYPES.get(info["dtype"], 32) // 8
    return total or sum(f.stat().st_size for f in folder.glob("adapter_model*.bin"))


def _from_path(path: Path) -> ModelSize:
    if path.is_file() and path.suffix == ".safetensors":
        return _from_safetensors([path], read_config(path.parent))
    files = sorted(path.glob("*.safetensors"))
    if files:
        return _from_safetensors(files, read_config(path))
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
        if "auto_map" in (read_config(folder) or {}):
            raise DeviceError(
                f"{folder / 'config.json'} names the folder's own code (auto_map), which whichdevice never runs, "
                f"and this transformers has no built-in class for it ({type(exc).__name__}): pass max_memory and a "
                "device explicitly, or save the weights as safetensors (sized from their headers)"
            ) from None
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


def checkpoint_quantization(model: Any) -> CheckpointQuantization | None:
    """The checkpoint's own quantization as its config states it (method, bits, group size), without
    sizes; None for an unquantized model or one that cannot be read here (placement says why)."""
    if hasattr(model, "model_type") and hasattr(model, "to_dict"):
        return read_quantization(_config_dict(model), f"model=<{type(model).__name__}>")
    if not isinstance(model, (str, os.PathLike)):
        return None
    try:
        path = resolve_model_path(model)
    except DamagedModelError:
        raise
    except DeviceError:
        return None
    folder = path if path.is_dir() else path.parent
    return read_quantization(read_config(folder) or {}, str(folder / "config.json"))
