"""The shape facts of a model's config that its KV cache and activations depend on (layers, heads, window)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.model.context import Context, model_context

__all__ = ["ModelShape", "has_experts", "shape_of_config"]


@frozen_record
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
    # What training activations are priced by besides the widths above (memory/activations.py): the
    # config's model_type, routed experts (how many, how many each token takes, each one's
    # intermediate width, and the dense MLP width beside them: a shared expert, or 0), a state-space
    # layer's state size, and an encoder-decoder's decoder layers.
    model_type: str | None = None
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    dense_intermediate: int | None = None
    state_size: int = 0
    decoder_layers: int = 0
    # The head shares the input embedding's weight (tie_word_embeddings): one vocab x hidden matrix
    # outside the layers, not two. Absent from the config: what the installed config class sets.
    tied_embeddings: bool = False
    # A state-space layer's convolution: its window (conv_kernel) and the groups of B and C that Mamba2
    # convolves beside the intermediate channels (n_groups; 0 for Mamba, whose conv has only those).
    conv_kernel: int = 0
    ssm_groups: int = 0

    @property
    def conv_channels(self) -> int:
        """The channels a state-space layer's convolution runs over: the intermediate ones, and Mamba2's
        B and C (n_groups x state size each)."""
        return self.intermediate + 2 * self.ssm_groups * self.state_size

    @property
    def mlp_intermediate(self) -> int:
        """The dense MLP width every token goes through: the intermediate size, or beside routed experts
        a shared expert's (0 where every MLP is routed)."""
        return self.intermediate if self.dense_intermediate is None else self.dense_intermediate


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
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers", "encoder_layers")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    state_space = _positive(config.get("state_size")) > 0 and _first(config, "num_attention_heads", "n_head") is None
    if state_space:
        heads = 0  # Mamba, Mamba2: no attention, so no KV cache (Mamba2's num_heads are its scan's heads)
    elif not all(isinstance(v, int) and v > 0 for v in (heads,)):
        return None
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden)):
        return None
    kv_heads = _first(config, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if config.get("multi_query") is True:
        kv_heads = 1
    head_dim = (_first(config, "head_dim", "d_kv") or hidden // heads) if heads else 0
    context = model_context(config)
    window = _first(config, "sliding_window", "attention_chunk_size")
    types = config.get("layer_types")
    if isinstance(types, list):
        sliding = sum(1 for t in types if "sliding" in str(t) or t == "chunked_attention")
    else:
        sliding = layers if window else 0  # transformers' DynamicCache: every layer slides then
    # Mamba2 states no intermediate size: its mixer's is expand x hidden (transformers' Mamba2Mixer).
    widened = _positive(config.get("expand")) * hidden if state_space else 0
    intermediate = int(
        _first(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim") or widened or 4 * hidden
    )
    return ModelShape(
        layers=layers,
        heads=heads,
        kv_heads=int(kv_heads or heads),
        head_dim=int(head_dim),
        hidden=hidden,
        intermediate=intermediate,
        vocab=int(_first(config, "vocab_size") or 0),
        sliding_window=int(window) if window else None,
        sliding_layers=sliding if window else 0,
        max_positions=context.tokens if context is not None else None,
        context=context,
        model_type=str(config.get("model_type") or data.get("model_type") or "") or None,
        **_experts(config, intermediate),
        state_size=_positive(config.get("state_size")) if config.get("ssm_cfg") is None else 0,
        decoder_layers=_positive(_first(config, "num_decoder_layers", "decoder_layers")),
        conv_kernel=_positive(config.get("conv_kernel")) if state_space else 0,
        ssm_groups=_positive(config.get("n_groups")) if state_space else 0,
        tied_embeddings=_tied(config, data),
    )


def _tied(config: Mapping[str, Any], data: Mapping[str, Any]) -> bool:
    stated = [c["tie_word_embeddings"] for c in (config, data) if c.get("tie_word_embeddings") is not None]
    if stated:
        return any(value is True for value in stated)
    # transformers 4 saved only the values that differ from the defaults (to_diff_dict), so the config.json
    # of a class that ties by default leaves the key out (GPT-2's on the Hub, for one): the absent value
    # is the one the installed config class gives when it loads the file. Where no class of the installed
    # transformers answers (a model with its own code, whose config class is never imported; a model_type
    # it does not know), tied: the larger training estimate (memory/activations.py), since the head's
    # matrix then counts with the layers' parameters.
    model_type = data.get("model_type")
    if data.get("auto_map") or not isinstance(model_type, str):
        return True
    return _ties_by_default(model_type)


@functools.lru_cache(maxsize=64)
def _ties_by_default(model_type: str) -> bool:
    """tie_word_embeddings of transformers' config class for ``model_type`` built with its defaults (True
    where none answers)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.for_model(model_type)
    except Exception:
        return True
    return getattr(config, "tie_word_embeddings", True) is not False


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _experts(config: Mapping[str, Any], intermediate: int) -> dict[str, Any]:
    """Routed experts as the config states them (Mixtral's num_local_experts with intermediate_size per
    expert, Qwen-MoE's num_experts with moe_intermediate_size and a shared expert beside them)."""
    experts = _positive(_first(config, "num_local_experts", "num_experts", "n_routed_experts"))
    per_token = _positive(config.get("num_experts_per_tok"))
    if not experts or not per_token:
        return {}
    own = _positive(config.get("moe_intermediate_size"))
    shared = _positive(config.get("shared_expert_intermediate_size"))
    return {
        "experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate": own or intermediate,
        "dense_intermediate": shared,
    }


def has_experts(config: Mapping[str, Any] | None) -> bool:
    """Whether a config.json's model routes tokens to experts (a mixture of experts)."""
    shape = shape_of_config(config)
    return shape is not None and shape.experts > 0
