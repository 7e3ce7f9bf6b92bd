"""A model built on the meta device with transformers' own classes, and the linear layers it has.

What transformers builds decides which weights are linear layers, which safetensors headers cannot tell:
transformers 5 fuses a mixture of experts' weights into [experts, in, out] parameters that bitsandbytes
does not quantize and LoRA does not adapt, where the checkpoint stores one 2-D weight per expert. Never
a model's own code: a config whose model brings its own (``auto_map``) is not built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["build_on_meta", "linear_layout", "meta_linear_layout"]


def linear_layout(model: Any) -> tuple[int, int, int]:
    """(weights of the linear layers bitsandbytes quantizes, their rows plus columns, the largest one) of a
    built model: every ``nn.Linear`` (and GPT-2's Conv1D) but the output head, which transformers keeps
    unquantized (``get_keys_to_not_convert``) and LoRA leaves alone. A fused expert parameter is no linear
    layer (transformers' ``replace_with_bnb_linear`` swaps ``nn.Linear`` modules only)."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weights = fan = largest = 0
    for module in model.modules():
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        if not linear or module is head or getattr(module, "weight", None) is None:
            continue
        count = module.weight.numel()
        weights += count
        fan += sum(module.weight.shape)
        largest = max(largest, count)
    return weights, fan, largest


def meta_linear_layout(config: Mapping[str, Any] | None) -> tuple[int, int, int] | None:
    """linear_layout of a config.json's model built on the meta device with transformers' own classes;
    None where it cannot be built (a model with its own code is never built)."""
    if config is None or config.get("auto_map") or not isinstance(config.get("model_type"), str):
        return None
    try:
        from transformers import AutoConfig

        built, _ = build_on_meta(AutoConfig.for_model(**dict(config)))
    except Exception:
        return None
    return linear_layout(built) if built is not None else None


def build_on_meta(config: Any) -> tuple[Any, list[str]]:
    """transformers' own model for ``config`` built on the meta device (no memory for weights, never
    the model's own code), as a causal LM else a base model; (None, why each failed) when neither builds."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    errors = []
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(config, trust_remote_code=False), []  # type: ignore[no-untyped-call]
        except Exception as exc:
            errors.append(f"{auto.__name__}: {exc}")
    return None, errors
