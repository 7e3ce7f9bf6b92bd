"""The model read once: config.json and every safetensors header, checked, into one record.

``read_model_facts(model)`` is the one reader of ``model=`` (a local folder or safetensors file, a
cached model id, or a transformers config): it raises :class:`DamagedModelError` for a damaged
download, and keeps what the deciders ask (the checkpoint's dtype for precision, its size and shape
for placement, its config for the attention support of its classes: whichdevice.model.support),
so no decider opens a model file again. A size that needs transformers (a meta-device build, for
a model without safetensors) is computed on first access only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DamagedModelError, DeviceError
from whichdevice.core.frozen import frozen_record
from whichdevice.core.progress import working
from whichdevice.model.adapter import adapter_base_name
from whichdevice.model.built import meta_linear_layout
from whichdevice.model.files import ModelFiles, check_config, is_config_object, read_model_folder
from whichdevice.model.locate import NotHereError, resolve_model_path
from whichdevice.model.quantized import CheckpointQuantization, read_quantization
from whichdevice.model.shape import ModelShape, has_experts, shape_of_config
from whichdevice.model.size import (
    CheckpointDtype,
    ModelSize,
    StoredWeights,
    adapter_bytes,
    checkpoint_quantization,
    config_object_dtype,
    size_from_config,
    size_from_headers,
    size_of_config_folder,
    stored_dtype,
    stored_weights,
)
from whichdevice.model.support import AttentionSupport, support_of_config

if TYPE_CHECKING:
    from whichdevice.model.hub import HubFetch

__all__ = [
    "ModelFacts",
    "attention_support",
    "checkpoint_dtype",
    "estimate_model_size",
    "is_config_object",
    "model_config",
    "model_shape",
    "read_model_facts",
]


@frozen_record(eq=False)
class ModelFacts:
    """What ``model=`` is, read once: its config, stored dtype, weights per dtype and shape."""

    source: str  # the resolved path, or "model=<LlamaConfig>" for a config object
    config: Mapping[str, Any] | None  # config.json or the config's to_dict(), checked; None: no config.json
    checkpoint: CheckpointDtype  # the dtype the checkpoint stores, and where that was read
    shape: ModelShape | None  # layers, heads, KV heads, window: what the KV cache and activations need
    stored: StoredWeights | None = None  # the safetensors headers' figures; None without safetensors
    path: Path | None = None  # the folder or file read; None for a config object
    config_object: Any = field(default=None, repr=False)  # the transformers config passed as model=
    # The safetensors headers as read ((file, tensors) each), kept for the size: read once.
    headers: tuple[tuple[Path, Mapping[str, Mapping[str, Any]]], ...] = field(default=(), repr=False)
    adapter: Path | None = None  # a PEFT adapter folder given as model=: its base was read, the adapter adds
    hub: HubFetch | None = None  # a Hub id not in the local cache: where its metadata came from (model/hub.py)

    @property
    def model_type(self) -> str | None:
        found = self.config.get("model_type") if self.config is not None else None
        return found if isinstance(found, str) else None

    @property
    def architectures(self) -> tuple[str, ...]:
        found = self.config.get("architectures") if self.config is not None else None
        return tuple(a for a in found if isinstance(a, str)) if isinstance(found, list) else ()

    @property
    def quantization_config(self) -> Mapping[str, Any] | None:
        """The checkpoint's own quantization_config, as stored (not interpreted here)."""
        found = self.config.get("quantization_config") if self.config is not None else None
        return found if isinstance(found, dict) else None

    @property
    def sliding_window(self) -> int | None:
        return self.shape.sliding_window if self.shape is not None else None

    @cached_property
    def quantization(self) -> CheckpointQuantization | None:
        """The checkpoint's own quantization as its config states it (method, bits, group size); None
        for an unquantized model. Sizes come with ``size`` (from the headers, as stored)."""
        if self.config_object is not None:
            return checkpoint_quantization(self.config_object)
        where = str(self.path / "config.json") if self.path is not None and self.path.is_dir() else self.source
        return read_quantization(dict(self.config or {}), where)

    @cached_property
    def size(self) -> ModelSize:
        """The parameters and bytes of the weights: from the safetensors headers (a pre-quantized
        checkpoint as stored), else a meta-device build of the config (imports transformers; a
        DeviceError when neither can be had), plus a PEFT adapter's own weights."""
        if self.headers:
            files = [file for file, _ in self.headers]
            where = files[0].parent if len(files) > 1 else files[0]
            size = size_from_headers([tensors for _, tensors in self.headers], where, self.config)
            if size.quantized is None and has_experts(self.config):
                # The checkpoint stores one 2-D weight per expert; what transformers builds decides
                # which are linear layers (model/built.py).
                layout = meta_linear_layout(self.config)
                if layout is not None:
                    size = replace(size, linear_params=layout[0], lora_fan=layout[1], largest_linear=layout[2])
        elif self.config_object is not None:
            size = size_from_config(self.config_object)
        elif self.path is not None and self.config is not None:
            size = size_of_config_folder(self.path if self.path.is_dir() else self.path.parent, self.config)
        else:
            raise DeviceError(f"{self.path} has neither *.safetensors files nor a config.json to size the model from")
        if self.adapter is None:
            return size
        extra = adapter_bytes(self.adapter)
        return replace(
            size, other_bytes=size.other_bytes + extra, source=f"{size.source}, plus the adapter in {self.adapter}"
        )


def read_model_facts(model: Any, *, weights: bool = True, revision: str | None = None) -> ModelFacts:
    """``model=`` (a folder, a safetensors file, a Hub model id or a transformers config) read and
    checked once. ``weights=False`` reads the config only (no safetensors header, no link check). A
    Hub id not in the local cache at ``revision`` has its metadata fetched (model/hub.py), never its weights."""
    if isinstance(model, ModelFacts):  # read already (whichdevice.report.plan resolves one model many times)
        return model
    if is_config_object(model):
        where = f"model=<{type(model).__name__}>"
        config = check_config(model.to_dict(), where)
        return ModelFacts(where, config, config_object_dtype(model), shape_of_config(config), config_object=model)
    if not isinstance(model, (str, os.PathLike)):
        raise DeviceError(
            f"model= takes a local path, a Hub model id or a transformers config, not {type(model).__name__}"
        )
    hub = None
    try:
        path = resolve_model_path(model, revision)
    except NotHereError as error:
        if error.hub_id is None:
            raise
        files, hub = _from_hub(error.hub_id, revision)
        path = files.folder
    else:
        with working("reading the model's config and safetensors headers"):
            files = read_model_folder(path, weights=weights)
    stored = stored_weights(files.headers)
    checkpoint = stored_dtype(files.config, stored)
    # A PEFT adapter folder is sized and placed as the base it names (resolve_model_path followed it).
    folder = Path(model).expanduser()
    adapter = folder if adapter_base_name(folder) is not None else None
    facts = ModelFacts(str(path), files.config, checkpoint, shape_of_config(files.config), stored, path)
    return replace(facts, headers=files.headers, adapter=adapter, hub=hub)


def _from_hub(repo: str, revision: str | None) -> tuple[ModelFiles, HubFetch]:
    from whichdevice.model.hub import read_hub_model  # imports huggingface_hub: only for a Hub id

    with working(f"fetching {repo}'s config and safetensors headers (no weights)"):
        return read_hub_model(repo, revision)


def estimate_model_size(model: Any) -> ModelSize:
    """The size of ``model`` (a folder, a safetensors file, a cached model id, a transformers config
    or ModelFacts): one read of its files, as resolve_device() makes."""
    facts = model if isinstance(model, ModelFacts) else read_model_facts(model)
    return facts.size


def model_config(model: Any) -> Mapping[str, Any] | None:
    """The config of ``model`` (or of ``ModelFacts``); None when it cannot be found or read. For the
    helpers that answer one question about a model outside resolve_device()."""
    if model is None:
        return None
    if isinstance(model, ModelFacts):
        return model.config
    try:
        return read_model_facts(model, weights=False).config
    except (DamagedModelError, DeviceError):
        return None


def checkpoint_dtype(model: Any) -> CheckpointDtype | None:
    """What ``model`` says about its own dtype (see :func:`whichdevice.model.size.stored_dtype`); None
    when ``model`` cannot be found here (placement then says why). A damaged model raises DamagedModelError."""
    try:
        return read_model_facts(model).checkpoint
    except DamagedModelError:
        raise
    except DeviceError:
        return None


def model_shape(model: Any) -> ModelShape | None:
    """The shape facts of ``model``'s config (a config, a local folder, a cached id or ModelFacts);
    None where it lacks them or cannot be read."""
    if isinstance(model, ModelFacts):
        return model.shape
    return shape_of_config(model_config(model))


def attention_support(model: Any) -> AttentionSupport:
    """The attention support of the classes ``model`` (a path, cached id, config or ModelFacts) loads as."""
    return support_of_config(model_config(model))
