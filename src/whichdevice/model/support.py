"""Which attention a model's transformers classes support, and whether they compile whole, read from transformers.

transformers decides per class: ``_supports_sdpa``, ``_supports_flash_attn`` and ``_supports_flex_attn``
are class attributes, and ``from_pretrained(attn_implementation="sdpa")`` raises for a class whose
``_supports_sdpa`` is False (148 of the 613 base model classes of transformers 5.24), while
``from_pretrained`` without it falls back to eager. So whichdevice reads those attributes for the
classes a checkpoint can be loaded as: the config's ``architectures``, every class the auto mappings
(AutoModel, AutoModelForCausalLM, ...) give its ``model_type``, and the base class of each nested
sub-config (a vision tower, a text model). A setting is supported only when every one of them
supports it, since whichdevice cannot know which Auto class the caller loads with.

This is the one place that imports transformers (and through it torch) while resolving, and only
when ``model=`` is given: the classes are the ones ``from_pretrained`` loads next anyway.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.core.progress import working

__all__ = [
    "AttentionSupport",
    "ModelClass",
    "support_of_config",
    "transformers_default",
]

# The class attribute transformers checks before it runs each kind of attention (modeling_utils.py).
# Matched the way transformers matches names: "flash" anywhere (flash_attention_2, Hub flash
# kernels), then "flex_attention", then "sdpa" anywhere (sdpa, whichdevice_sdpa).
_FLAGS = (("flash", "_supports_flash_attn"), ("flex_attention", "_supports_flex_attn"), ("sdpa", "_supports_sdpa"))


# transformers' lazy module is not thread-safe on first use: threads that read a model class while
# another is importing its module get "module 'transformers' has no attribute 'LlamaForCausalLM'",
# which would be cached as "unknown" for the process. One reader at a time; a fork gets a fresh lock.
_classes_lock = [threading.Lock()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _classes_lock.__setitem__(0, threading.Lock()))


def support_flag(implementation: str) -> str | None:
    """The class attribute transformers checks for ``implementation``; None when it checks none (eager)."""
    for word, flag in _FLAGS:
        if word in implementation:
            return flag
    return None


@frozen_record
class ModelClass:
    """One transformers class a checkpoint may be loaded as, and its attention flags."""

    name: str
    part: str  # "" for the checkpoint's own classes, else the sub-config's key ("vision_config")
    flags: tuple[tuple[str, bool], ...]
    # _can_compile_fullgraph: transformers marks the class as compiling whole (no graph breaks).
    compiles: bool = False
    # supports_gradient_checkpointing: gradient_checkpointing_enable() raises for a class without it.
    checkpoints: bool = True

    def supports(self, implementation: str) -> bool:
        flag = support_flag(implementation)
        return flag is None or dict(self.flags).get(flag, False)


@frozen_record
class AttentionSupport:
    """What the classes behind ``model=`` support, or why that could not be read (``unknown``)."""

    model_type: str | None
    classes: tuple[ModelClass, ...] = ()
    unknown: str | None = None
    transformers_version: str | None = None

    def lacking(self, implementation: str) -> tuple[ModelClass, ...]:
        """The classes that refuse ``implementation`` (empty: all of them take it)."""
        return tuple(c for c in self.classes if not c.supports(implementation))

    def checked(self) -> str:
        """Which classes were read, for the trace."""
        return f"{self._names(self.classes)} on transformers {self.transformers_version}"

    def _names(self, classes: tuple[ModelClass, ...]) -> str:
        # The checkpoint's own class first (its config's architectures), the other heads counted.
        own = [c.name for c in classes if not c.part]
        text = own[0] if own else ""
        if len(own) > 1:
            text += f" and {len(own) - 1} other {self.model_type or 'model'} class{'es' if len(own) > 2 else ''}"
        parts = [f"{c.name} ({c.part})" for c in classes if c.part]
        return ", ".join([text, *parts] if text else parts)

    def not_compiling(self) -> str | None:
        """Which classes transformers does not mark as compiling whole (``_can_compile_fullgraph``); None: all are."""
        lacking = tuple(c for c in self.classes if not c.compiles)
        if not lacking:
            return None
        verb = "has" if len(lacking) == 1 else "have"
        return f"{self._names(lacking)} {verb} _can_compile_fullgraph=False on transformers {self.transformers_version}"

    def no_checkpointing(self) -> str | None:
        """Which classes cannot checkpoint activations (``supports_gradient_checkpointing=False``, so
        transformers' gradient_checkpointing_enable raises); None where all can or the classes are unknown."""
        lacking = tuple(c for c in self.classes if not c.checkpoints and not c.part)
        if not lacking:
            return None
        verb = "has" if len(lacking) == 1 else "have"
        return (
            f"{self._names(lacking)} {verb} supports_gradient_checkpointing=False on transformers "
            f"{self.transformers_version}"
        )

    def refusal(self, implementation: str) -> str | None:
        """Why ``implementation`` cannot be loaded, naming the class and its flag; None when it can."""
        lacking = self.lacking(implementation)
        if not lacking:
            return None
        verb = "has" if len(lacking) == 1 else "have"
        flag = support_flag(implementation)
        return f"{self._names(lacking)} {verb} {flag}=False on transformers {self.transformers_version}"


def transformers_default(support: AttentionSupport) -> str | None:
    """What transformers runs when ``attn_implementation`` is not passed: sdpa for a class that
    supports it, else eager; None when the classes differ (each submodel picks its own) or are unknown."""
    if support.unknown is not None or not support.classes:
        return None
    picks = {"sdpa" if c.supports("sdpa") else "eager" for c in support.classes}
    return picks.pop() if len(picks) == 1 else None


def support_of_config(config: Mapping[str, Any] | None) -> AttentionSupport:
    """The attention support of the classes a model with this config (config.json's content) loads as."""
    if config is None:
        return AttentionSupport(None, unknown="model= has no readable config.json")
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    if config.get("auto_map"):
        return AttentionSupport(model_type, unknown="the model brings its own code (auto_map), which decides")
    architectures = config.get("architectures")
    names = tuple(a for a in architectures if isinstance(a, str)) if isinstance(architectures, list) else ()
    if model_type is None and not names:
        return AttentionSupport(None, unknown="model= has no readable model_type or architectures")
    parts = tuple(sorted(_sub_configs(config)))
    from whichdevice.core.packages import package_version

    return _read_classes(package_version("transformers"), model_type, names, parts)


def _sub_configs(config: Mapping[str, Any]) -> set[tuple[str, str]]:
    """(key, model_type) of every nested config that is a model of its own (a vision tower, ...)."""
    found: set[tuple[str, str]] = set()
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(value.get("model_type"), str):
            found.add((key, value["model_type"]))
            found |= {(f"{key}.{k}", t) for k, t in _sub_configs(value)}
    return found


@lru_cache(maxsize=128)
def _read_classes(
    metadata_version: str | None,
    model_type: str | None,
    architectures: tuple[str, ...],
    parts: tuple[tuple[str, str], ...],
) -> AttentionSupport:
    if metadata_version is None:
        return AttentionSupport(model_type, unknown="transformers is not installed")
    # The first such read imports transformers and the architecture's module: seconds, shown at once.
    slow = "transformers" not in sys.modules
    what = "importing transformers to read the model's classes" if slow else "reading the model's classes"
    with _classes_lock[0], working(what, at_once=slow):
        return _import_classes(metadata_version, model_type, architectures, parts)


def _import_classes(
    metadata_version: str,
    model_type: str | None,
    architectures: tuple[str, ...],
    parts: tuple[tuple[str, str], ...],
) -> AttentionSupport:
    try:
        import transformers
        from transformers.models.auto import modeling_auto
    except Exception as exc:  # a broken installation: transformers reports it when loading
        return AttentionSupport(model_type, unknown=f"transformers cannot be imported ({type(exc).__name__}: {exc})")
    version = str(transformers.__version__)
    if version != metadata_version:
        # testing.simulate(packages=...) changed the version: the installed classes would answer for another one
        return AttentionSupport(model_type, unknown=f"transformers {metadata_version} is not the importable {version}")
    wanted = [(name, "") for name in architectures]
    if model_type is not None:
        wanted += [(name, "") for name in _mapped_classes(modeling_auto, model_type, every_head=True)]
    for part, sub_type in parts:
        wanted += [(name, part) for name in _mapped_classes(modeling_auto, sub_type, every_head=False)]
    classes = []
    for name, part in dict.fromkeys(wanted):
        try:
            cls = getattr(transformers, name)
            flags = tuple((flag, bool(getattr(cls, flag))) for _, flag in _FLAGS)
            compiles = getattr(cls, "_can_compile_fullgraph", False) is True
            checkpoints = getattr(cls, "supports_gradient_checkpointing", False) is True
        except Exception:
            if part:
                continue  # a sub-config whose class is not in this transformers: its own model decides
            return AttentionSupport(model_type, unknown=f"{name} is not a class of transformers {version}")
        classes.append(ModelClass(name, part, flags, compiles, checkpoints))
    if not classes:
        return AttentionSupport(
            model_type, unknown=f"transformers {version} has no class for model_type {model_type!r}"
        )
    return AttentionSupport(model_type, tuple(classes), transformers_version=version)


def _mapped_classes(modeling_auto: Any, model_type: str, *, every_head: bool) -> list[str]:
    """The class names the auto mappings give ``model_type``: every Auto class's (``every_head``)
    or only AutoModel's (a sub-config is built with ``AutoModel.from_config``)."""
    tables = [modeling_auto.MODEL_MAPPING_NAMES]
    if every_head:
        tables = [
            getattr(modeling_auto, name)
            for name in dir(modeling_auto)
            if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES")
        ]
    names: list[str] = []
    for table in tables:
        found = table.get(model_type) if isinstance(table, dict) else None
        for name in found if isinstance(found, (list, tuple)) else [found]:
            if isinstance(name, str):
                names.append(name)
    return names
