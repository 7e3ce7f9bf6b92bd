"""Inference on several devices as transformers runs it: a device_map split or tensor parallelism.

A model that fits no single device is run by transformers in one of two ways. ``device_map="auto"``
(accelerate's big-model inference) puts whole layers on each device and runs them one device at a
time: it fits the sum of the devices' memory, and a decode step reads every weight through one
device's memory at a time. ``from_pretrained(..., tp_plan="auto")`` under ``torchrun`` (one process
per device) shards every layer by the config class's ``base_model_tp_plan``: each device holds 1/N of
the sharded weights and of the KV cache, and all N read their share at once, so a decode step is
about N times faster where the link between devices keeps up. Tensor parallelism needs a
``base_model_tp_plan`` on the installed transformers' config class, heads and KV heads that divide by
N, and a launch; the split needs neither. Both are sized here per device; the choice and the
handover are the resolver's and the plan's.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes

if TYPE_CHECKING:
    from whichdevice.device.target import Target
    from whichdevice.memory.job import JobMemory

__all__ = [
    "TensorParallel",
    "tensor_parallel",
    "tensor_parallel_steps",
    "tp_keywords",
    "tp_keywords_text",
    "tp_plan_of",
]


@frozen_record
class TensorParallel:
    """Tensor parallelism over ``devices`` devices: bytes per device and whether it can run, or why not."""

    devices: int
    per_device: int
    fits: bool
    unavailable: str | None = None  # why transformers cannot shard this model N ways; None when it can

    def line(self, budget: int) -> str:
        if self.unavailable:
            return f"tensor parallel over {self.devices} devices: not possible, {self.unavailable}"
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"tensor parallel over {self.devices} devices (tp_plan='auto' under torchrun): weights and KV cache "
            f"/ {self.devices} + activations = {format_bytes(self.per_device)} per device, {verdict} "
            f"{format_bytes(budget)}; every device reads its share of each token at once"
        )


def tp_plan_of(config: Mapping[str, Any] | None) -> tuple[dict[str, str] | None, str]:
    """(the installed transformers' base_model_tp_plan for ``config``'s model_type, or None; why not)."""
    model_type = config.get("model_type") if config is not None else None
    if not isinstance(model_type, str):
        return None, "the model has no model_type to look its config class up by"
    if config is not None and config.get("auto_map"):
        return None, "the model brings its own code (auto_map), which whichdevice never imports"
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except Exception as exc:  # a broken installation: from_pretrained reports it
        return None, f"transformers cannot be imported ({type(exc).__name__})"
    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return None, f"the installed transformers has no config class for model_type {model_type!r}"
    plan = getattr(cls, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return None, f"{cls.__name__} declares no base_model_tp_plan in the installed transformers"
    return dict(plan), f"{cls.__name__}.base_model_tp_plan"


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_attention_heads" in inner else config


def tensor_parallel(
    config: Mapping[str, Any] | None, devices: int, weights: int, kv_cache: int, other: int, budget: int
) -> TensorParallel:
    """Tensor parallelism of a model (``config``) over ``devices`` devices of ``budget`` bytes each: the
    weights and KV cache sharded N ways, the activations and workspace (``other``) on every device."""
    per_device = -(-(weights + kv_cache) // devices) + other
    plan, why = tp_plan_of(config)
    if plan is None:
        return TensorParallel(devices, per_device, False, why)
    text = _text_config(config or {})
    heads, kv_heads = (
        text.get("num_attention_heads"),
        text.get("num_key_value_heads") or text.get("num_attention_heads"),
    )
    for name, count in (("attention heads", heads), ("KV heads", kv_heads)):
        # Each rank takes whole heads of the column-sharded projections; a remainder cannot be placed.
        if isinstance(count, int) and count % devices:
            return TensorParallel(devices, per_device, False, f"its {count} {name} do not divide by {devices}")
    return TensorParallel(devices, per_device, per_device <= budget)


def tp_keywords() -> dict[str, Any]:
    """What from_pretrained takes for tensor parallelism on the installed transformers:
    ``distributed_config=DistributedConfig(tp_plan="auto")`` where it has that class (passing
    ``tp_plan=`` directly is deprecated there), else ``tp_plan="auto"``."""
    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def tp_keywords_text() -> dict[str, str]:
    """tp_keywords() as the code that makes them (DistributedConfig's repr is its whole JSON)."""
    return {
        k: "DistributedConfig(tp_plan='auto')" if k == "distributed_config" else repr(v)
        for k, v in tp_keywords().items()
    }


def tensor_parallel_steps(
    config: Mapping[str, Any] | None,
    devices: int,
    budget: int,
    weights: int,
    memory: JobMemory,
    target: Target,
) -> list[TraceStep]:
    """For a split one process runs (one device at a time): tensor parallelism over the same
    ``devices`` devices of ``budget`` bytes, and how to launch it where it fits."""
    from whichdevice.device.launch_command import launch_command

    kv = sum(t.bytes for t in memory.terms if t.name == "KV cache")
    option = tensor_parallel(config, devices, weights, kv, memory.bytes - kv, budget)
    if not option.fits:
        return [TraceStep("placement", f"the split, since {option.line(budget)}", chosen=False)]
    launch = " ".join(shlex.quote(a) for a in launch_command(target, ["your_script.py"]))
    keywords = ", ".join(f"{k}={v}" for k, v in tp_keywords_text().items())
    return [
        TraceStep(
            "placement",
            f"faster: {option.line(budget)}, where the split reads one device at a time; for it, launch "
            f"`{launch}` and load with from_pretrained(..., {keywords}) in each process (no device_map)",
        )
    ]
