"""How big a model is in a given dtype, and the dtype its checkpoint stores.

Sizes come from safetensors headers (8-byte length + JSON; no tensor is read) or, without
safetensors, from a build of the config on the meta device. The headers and config are read once,
by :func:`whichdevice.model.facts.read_model_facts`; this module turns them into figures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from pathlib import Path
from typing import Any, cast

from whichdevice.core.dtypes import FLOAT_CODES, NAMES, SAFETENSORS_BITS, code_name, item_size
from whichdevice.core.errors import DeviceError
from whichdevice.core.frozen import frozen_record
from whichdevice.model.built import build_on_meta, linear_layout
from whichdevice.model.files import (
    DamagedModelError,
    read_config,
    read_header,
    refetch_hint,
)
from whichdevice.model.locate import resolve_model_path
from whichdevice.model.quantized import CAST_CODES, CheckpointQuantization, estimate_stored, read_quantization
from whichdevice.model.step_weights import StepWeights

__all__ = [
    "CheckpointDtype",
    "ModelSize",
    "StepWeights",
    "StoredWeights",
    "auto_config",
    "config_object_dtype",
    "resolve_model_path",
    "size_from_config",
    "size_of_config_folder",
    "stored_dtype",
    "stored_weights",
]


@frozen_record
class ModelSize:
    """Parameter counts of a model, split the way dtype and quantization treat them."""

    source: str
    float_params: int
    # Weights of 2-D linear layers (what bitsandbytes quantizes); embeddings and lm_head excluded.
    linear_params: int
    other_bytes: int = 0
    # The checkpoint's own quantization: its packed weights are other_bytes, kept as stored.
    quantized: CheckpointQuantization | None = None
    # The parameters of the module that holds the most of its own (DeepSpeed's "largest layer",
    # deepspeed/runtime/zero/stage3.py model_to_params: each module's parameters(recurse=False)); 0: unknown.
    largest_module: int = 0
    # The element count of every floating-point tensor (tied ones once), largest first, and of the
    # largest linear weight: what a load allocates tensor by tensor (memory/load_peak.py). Empty where
    # the source does not say.
    tensors: tuple[int, ...] = field(default=(), repr=False, compare=False)
    largest_linear: int = 0
    # The rows plus columns of every linear weight LoRA adapts by default (lora_training: every linear
    # layer but the head): rank r adds r x this many parameters. 0: unknown.
    lora_fan: int = 0

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
        return ModelSize(
            f"{self.source}, dequantized",
            self.parameters,
            self.linear_params,
            0,
            self.quantized,
            lora_fan=self.lora_fan,
        )

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


def _is_head(name: str, shape: list[int]) -> bool:
    return len(shape) == 2 and name.lower().endswith("weight") and "lm_head" in name.lower()


def _is_token_embedding(name: str, shape: list[int]) -> bool:
    lowered = name.lower()
    return (
        len(shape) == 2
        and lowered.endswith("weight")
        and ("embed" in lowered or "wte" in lowered)
        and "position" not in lowered
        and "wpe" not in lowered
    )


@frozen_record
class StoredWeights:
    """What a checkpoint's safetensors headers say: parameters and bytes per safetensors dtype."""

    source: str
    float_params: int
    linear_params: int
    other_bytes: int
    # (safetensors code, parameters, bytes stored), one per code the headers name
    by_code: tuple[tuple[str, int, int], ...]
    # How many linear weight matrices hold linear_params: the matmuls of one forward pass.
    linear_count: int = 0
    # The output head's weights (lm_head; where the checkpoint has none, the token embedding a tied
    # head reads): a decode step multiplies every row by it too, and packing copies it.
    head_params: int = 0
    head_count: int = 0

    def step_weights(self) -> StepWeights:
        """The weights one decode step reads (the linear layers' and the head's) and its matmuls."""
        return StepWeights(self.linear_params + self.head_params, self.linear_count + self.head_count)

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
    float_params = linear = other = matrices = head = heads = embedding = 0
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
                    matrices += 1
                elif _is_head(name, info["shape"]):
                    head, heads = head + count, heads + 1
                elif _is_token_embedding(name, info["shape"]):
                    embedding = max(embedding, count)
            else:
                other += count * SAFETENSORS_BITS[code] // 8
    if not heads and embedding:  # no head of its own: a tied head reads the token embedding
        head, heads = embedding, 1
    files = [file for file, _ in headers]
    where = files[0].parent if len(files) > 1 else files[0]
    codes = tuple((code, p, b) for code, (p, b) in sorted(by_code.items()))
    source = f"safetensors headers ({len(files)} file(s) in {where})"
    return StoredWeights(source, float_params, linear, other, codes, matrices, head, heads)


def size_from_headers(
    headers: Sequence[Mapping[str, Mapping[str, Any]]], where: Path, config: Mapping[str, Any] | None = None
) -> ModelSize:
    """The size of already read and checked safetensors headers. In a quantized checkpoint only the
    float tensors (F64/F32/F16/BF16) follow the load dtype; FP8/FP4 and packed integers stay as stored."""
    float_params = linear = other = largest = fan = 0
    quantized = read_quantization(dict(config or {}), f"{where}", cast(Any, list(headers)))
    floats = CAST_CODES if quantized is not None else FLOAT_CODES
    modules: dict[str, int] = {}
    tensors = []
    for header in headers:
        for name, info in header.items():
            count = math.prod(info["shape"])
            module = name.rpartition(".")[0]  # "model.layers.0.mlp.up_proj" of "...up_proj.weight"
            modules[module] = modules.get(module, 0) + count
            if info["dtype"] in floats:
                float_params += count
                tensors.append(count)
                if _is_linear(name, info["shape"]):
                    linear += count
                    largest = max(largest, count)
                    fan += sum(info["shape"])
            else:
                other += count * SAFETENSORS_BITS[info["dtype"]] // 8
    source = f"safetensors headers ({len(headers)} file(s) in {where})"
    return ModelSize(
        source,
        float_params,
        linear,
        other,
        quantized,
        max(modules.values(), default=0),
        tuple(sorted(tensors, reverse=True)),
        largest,
        fan,
    )


def _config_dict(config: Any) -> dict[str, Any]:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return {}
    return {"quantization_config": qc if isinstance(qc, dict) else qc.to_dict()}


def size_from_config(config: Any) -> ModelSize:
    """The parameters of a transformers config's model, built on the meta device (imports transformers)."""
    model, errors = build_on_meta(config)
    if model is None:
        raise DeviceError(
            f"cannot size a {type(config).__name__}: {'; '.join(errors)}; pass max_memory and a "
            "device explicitly, or a folder with safetensors weights"
        )
    float_params = matrices = 0
    seen: set[int] = set()
    tensors = []
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if param.is_floating_point():
            float_params += param.numel()
            tensors.append(param.numel())
            if param.dim() > 2 and _is_linear(name + ".weight", [1, 1]):
                matrices += param.numel()  # fused MoE experts ([experts, in, out]): a checkpoint's method may pack them
    linear, fan, largest = linear_layout(model)
    source = f"a meta-device build of {type(config).__name__}"
    # DeepSpeed's largest layer: the module whose own parameters (not its children's) are the most.
    largest_module = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    quantizable = linear + matrices
    params = (quantizable, float_params - quantizable)
    quantized = read_quantization(_config_dict(config), source, params=params)
    if quantized is None or quantized.estimated_bytes is None:
        return ModelSize(
            source,
            float_params,
            linear,
            0,
            quantized,
            largest_module,
            tuple(sorted(tensors, reverse=True)),
            largest,
            fan,
        )
    # The quantized layers' packed bytes, estimated from bits and group size; the rest stays float.
    packed = estimate_stored(quantized.bits or 16, quantized.group_size, quantizable, 0)
    return ModelSize(source, float_params - quantizable, 0, packed, quantized, largest_module)


def size_of_config_folder(folder: Path, config: Mapping[str, Any]) -> ModelSize:
    """The size of a folder without safetensors weights, from a meta-device build of its config.json
    with transformers' own classes (imports transformers); never the folder's own code."""
    unknown = _own_code(config)
    if unknown is not None:
        raise DeviceError(
            f"{folder} cannot be sized: {unknown}, and whichdevice never runs a model's own code; save "
            "the weights as safetensors (save_pretrained writes them) so their headers give the size, "
            "or leave model= out and pass device= (and device_map=) yourself; if it is a newer "
            "architecture, a newer transformers may have it (pip install -U transformers)"
        )
    size = size_from_config(auto_config(folder))
    if config.get("auto_map"):
        not_run = "transformers' own classes: the folder's code, auto_map, was not run"
        return replace(size, source=f"{size.source} ({not_run})")
    return size


def _own_code(config: Mapping[str, Any]) -> str | None:
    """Why only the model's own code could build ``config`` (an architecture the installed
    transformers does not have), or None when transformers builds it with its own classes."""
    from transformers import __version__
    from transformers.models.auto import configuration_auto

    if config["model_type"] in getattr(configuration_auto, "CONFIG_MAPPING_NAMES", {}):
        return None
    brings = " and the folder brings its own code (auto_map)" if config.get("auto_map") else ""
    return f"transformers {__version__} has no model_type {config['model_type']!r}{brings}"


def auto_config(folder: Path) -> Any:
    """transformers' config for the config.json in ``folder`` (a model without safetensors weights)."""
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


def adapter_bytes(folder: Path) -> int:
    """An adapter's weights in bytes: safetensors headers, else the .bin file's length (never unpickled)."""
    total = 0
    for file in sorted(folder.glob("adapter_model*.safetensors")):
        for info in read_header(file).values():
            total += math.prod(info["shape"]) * SAFETENSORS_BITS.get(info["dtype"], 32) // 8
    return total or sum(f.stat().st_size for f in folder.glob("adapter_model*.bin"))


@frozen_record
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
    """What a transformers config object states about its dtype (its ``dtype``; ``torch_dtype`` only as
    an attribute of its own, since reading transformers 5's deprecated alias prints a warning the user
    did not cause)."""
    stated = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    where = f"the config's dtype {stated}" if stated is not None else "the config, which states no dtype"
    return CheckpointDtype(_canonical(stated), getattr(config, "model_type", None) or None, where)


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
