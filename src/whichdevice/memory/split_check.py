"""Every split whichdevice hands over, checked with transformers' own placement on a meta-device build.

``from_pretrained(device_map="auto", max_memory=...)`` does not place by whichdevice's sums: it builds
the model, rebalances ``max_memory`` (``get_balanced_memory``: for "balanced_low_0" device 0 gets only
what the others cannot hold) and places whole no-split layers with ``infer_auto_device_map``, keeping
room for the largest layer; what does not fit goes to the CPU or disk. So a split is checked with
that same call (transformers 5: ``integrations.accelerate._get_device_map``, else accelerate's
``get_balanced_memory`` + ``infer_auto_device_map``) on ``AutoModelForCausalLM.from_config(config,
trust_remote_code=False)`` built under ``init_empty_weights``: no layer may land on the CPU or disk,
and each device's weights plus its share of the job (the KV cache or activations of the layers it
holds, gradients and optimizer state with its weights, the workspace) must stay under its limit.
A device over its limit gets its budget lowered by the excess and the placement is asked again;
where "balanced_low_0" cannot place the model, "auto" and then "sequential" are tried. A form whose
placement transformers itself refuses for these devices is passed over the same way: "balanced_low_0"
reads ``max_memory[0]`` and devices 1 to n-1 (``get_balanced_memory``), so budgets for devices 1 and 2
(``devices=[1, 2]``, or GPU 0 left out as unusable) raise ``KeyError: 0`` there, as ``from_pretrained``
would with the same keywords; the form handed over is one the check placed with those very budgets.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.frozen import frozen_record
from whichdevice.core.progress import working
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.job import JobMemory

__all__ = ["SplitCheck", "check_split"]

_PER_LAYER = ("KV cache", "state cache")  # terms held by each layer's device, in proportion to its layers
_WITH_WEIGHTS = ("gradients", "optimizer state")  # terms that sit beside the weights they belong to
_ROUNDS = 6


@frozen_record
class SplitCheck:
    """The device_map string and budgets that transformers' placement honours, and what each device holds."""

    device_map: str
    max_memory: dict[int | str, str]
    note: str
    passed_over: str = ""  # why the forms tried before ``device_map`` were not taken


def _meta_model(model: Any, dtype: str) -> Any:
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if hasattr(model, "config_object") and hasattr(model, "path"):  # model.facts.ModelFacts, as resolved
        model = model.config_object if model.config_object is not None else model.path
    if hasattr(model, "to_dict"):
        config = model
    else:
        folder = Path(model) if Path(model).is_dir() else Path(model).parent
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=getattr(torch, dtype))  # type: ignore[no-untyped-call]


def _place(meta: Any, device_map: str, budgets: dict[int | str, int]) -> dict[str, Any]:
    """The device map from_pretrained computes for ``device_map`` and ``budgets`` (bytes)."""
    # accelerate's get_max_memory warns "Device 0 is not available" for simulated devices, which are not torch's.
    quiet = [logging.getLogger(name) for name in ("transformers", "accelerate")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        try:
            from transformers.integrations.accelerate import _get_device_map
        except ImportError:  # transformers 4: accelerate's own functions, the ones it called
            from accelerate.utils import get_balanced_memory, infer_auto_device_map

            no_split = meta._no_split_modules
            if device_map != "sequential":
                budgets = get_balanced_memory(meta, budgets, no_split, low_zero=device_map == "balanced_low_0")  # type: ignore[assignment]
            placed: dict[str, Any] = infer_auto_device_map(meta, budgets, no_split)
            return placed
        found: dict[str, Any] = _get_device_map(meta, device_map, dict(budgets), None)
        return found
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)


def _sizes(meta: Any, placement: dict[str, Any]) -> Counter[Any]:
    weights: Counter[Any] = Counter()
    for prefix, where in placement.items():
        module = meta.get_submodule(prefix) if prefix else meta
        weights[where] += sum(p.numel() * p.element_size() for p in module.parameters())
    return weights


def _layers(meta: Any, placement: dict[str, Any]) -> Counter[Any]:
    no_split = set(meta._no_split_modules or ())
    layers: Counter[Any] = Counter()
    for prefix, where in placement.items():
        module = meta.get_submodule(prefix) if prefix else meta
        layers[where] += sum(1 for m in module.modules() if type(m).__name__ in no_split)
    return layers


def _said(err: Exception) -> str:
    # A KeyError's text is only the key's repr: name the exception and the call that raised it.
    where = err.__traceback__
    while where is not None and where.tb_next is not None:
        where = where.tb_next
    function = f" in {where.tb_frame.f_code.co_name}" if where is not None else ""
    return f"{type(err).__name__}: {str(err)[:200]}{function}"


def check_split(
    model: Any,
    dtype: str,
    device_map: str,
    limits: dict[int | str, int],
    memory: JobMemory,
    weights: int,
) -> SplitCheck:
    """The device_map and max_memory (bytes per device ``limits`` at most) that transformers' placement
    keeps on the devices with each device's share of ``memory``; DoesNotFitError where none does."""
    with working("checking the split with transformers' own placement"):
        meta = _meta_model(model, dtype)
    layer_count = sum(1 for m in meta.modules() if type(m).__name__ in set(meta._no_split_modules or ()))
    per_layer = sum(t.bytes for t in memory.terms if t.name in _PER_LAYER) / max(layer_count, 1)
    with_weights = sum(t.bytes for t in memory.terms if t.name in _WITH_WEIGHTS) / max(weights, 1)
    fixed = sum(t.bytes for t in memory.terms if t.name not in _PER_LAYER + _WITH_WEIGHTS)
    tried = []
    for candidate in dict.fromkeys((device_map, "auto", "sequential")):
        budgets = {k: max(0, int(v - fixed)) for k, v in limits.items()}
        for _ in range(_ROUNDS):
            try:
                placement = _place(meta, candidate, budgets)
            except (KeyError, IndexError, ValueError) as err:  # transformers' placement refuses these budgets
                keys = ", ".join(map(str, budgets))
                tried.append(f"transformers' placement refuses {candidate!r} for devices {keys} ({_said(err)})")
                break
            spilled = {w for w in placement.values() if not isinstance(w, int)}
            if spilled:
                tried.append(f"{candidate!r} puts layers on {', '.join(sorted(map(str, spilled)))}")
                break
            sizes, layers = _sizes(meta, placement), _layers(meta, placement)
            use = {k: int(sizes[k] * (1 + with_weights) + per_layer * layers[k] + fixed) for k in limits}
            over = {k: use[k] - limits[k] for k in limits if use[k] > limits[k]}
            if not over:
                held = ", ".join(
                    f"{k}: {layers[k]} layers, {format_bytes(use[k])} of {format_bytes(limits[k])}" for k in limits
                )
                note = f"checked with transformers' own placement on a meta build ({held})"
                budget = {k: f"{v // 1024**2}MiB" for k, v in budgets.items()}
                return SplitCheck(candidate, budget, note, "; ".join(tried))
            for k, excess in over.items():
                budgets[k] = max(0, budgets[k] - excess - 1024**2)
        else:
            tried.append(f"{candidate!r} leaves a device over its limit")
    raise DoesNotFitError(
        f"transformers' own placement cannot keep the split on the devices: {'; '.join(tried)} (checked on a "
        "meta build with each device's share of the job); use more devices, a shorter max_length or a smaller batch"
    )
