"""The layer classes a model is split and sharded by, read from its transformers class's ``_no_split_modules``.

accelerate never splits one of these across devices (``infer_auto_device_map(no_split_module_classes=)``)
and FSDP wraps each of them as one shard unit (``fsdp_config["transformer_layer_cls_to_wrap"]``). The
class is the one ``from_pretrained`` builds for the config's ``architectures`` (else the causal-LM
class of its ``model_type``), looked up in the installed transformers; a model that brings its own
code (``auto_map``) is not imported, so its classes are unknown.
"""

from __future__ import annotations

from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.model.facts import model_config

__all__ = ["LayerClasses", "layer_classes"]


@frozen_record
class LayerClasses:
    """The model class and its no-split layer classes, or why they are unknown (``names`` empty)."""

    model_class: str | None
    names: tuple[str, ...] = ()
    unknown: str | None = None


def layer_classes(model: Any) -> LayerClasses:
    """The ``_no_split_modules`` of the transformers class ``model`` (a path, cached id or config) loads as."""
    config = model_config(model)
    if config is None:
        return LayerClasses(None, unknown="model= has no readable config.json")
    if config.get("auto_map"):
        return LayerClasses(None, unknown="the model brings its own code (auto_map), which whichdevice never imports")
    try:
        import transformers
        from transformers.models.auto import modeling_auto
    except Exception as exc:  # a broken installation: from_pretrained reports it
        return LayerClasses(None, unknown=f"transformers cannot be imported ({type(exc).__name__})")
    architectures = config.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    mapped = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
    if isinstance(mapped, str):
        names.append(mapped)
    for name in names:
        cls = getattr(transformers, name, None)
        found = getattr(cls, "_no_split_modules", None) if cls is not None else None
        if isinstance(found, (list, tuple, set)) and found and all(isinstance(n, str) for n in found):
            return LayerClasses(name, tuple(sorted(found)))
    return LayerClasses(
        names[0] if names else None,
        unknown=f"no class of transformers {transformers.__version__} for this config declares _no_split_modules",
    )
