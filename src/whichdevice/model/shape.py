"""The shape facts of a model's config that its KV cache and activations depend on (layers, heads, window)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from whichdevice.model.context import Context, model_context

__all__ = ["ModelShape", "shape_of_config"]


@dataclass(frozen=True)
class ModelShape:
    """The config facts the KV cache and activations depend on."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    sliding_window: int | None = None
    sliding_layers: int = 0
    # The model's context: its stated positions, stretched where its RoPE scaling says so (model/context.py).
    max_positions: int | None = None
    context: Context | None = None


def _first(config: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return None


def _language_part(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # A multimodal config keeps the decoder's shape in text_config.
    text = config.get("text_config")
    if _first(config, "num_hidden_layers", "n_layer", "num_layers") is None and isinstance(text, dict):
        return text
    return config


def shape_of_config(data: Mapping[str, Any] | None) -> ModelShape | None:
    """The shape facts of a config (config.json's content or a config's to_dict()); None where it lacks them."""
    if data is None:
        return None
    config = _language_part(data)
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden)):
        return None
    kv_heads = _first(config, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if config.get("multi_query") is True:
        kv_heads = 1
    head_dim = _first(config, "head_dim") or hidden // heads
    context = model_context(config)
    window = _first(config, "sliding_window", "attention_chunk_size")
    types = config.get("layer_types")
    if isinstance(types, list):
        sliding = sum(1 for t in types if "sliding" in str(t) or t == "chunked_attention")
    else:
        sliding = layers if window else 0  # transformers' DynamicCache: every layer slides then
    return ModelShape(
        layers=layers,
        heads=heads,
        kv_heads=int(kv_heads or heads),
        head_dim=int(head_dim),
        hidden=hidden,
        intermediate=int(_first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden),
        vocab=int(_first(config, "vocab_size") or 0),
        sliding_window=int(window) if window else None,
        sliding_layers=sliding if window else 0,
        max_positions=context.tokens if context is not None else None,
        context=context,
    )
