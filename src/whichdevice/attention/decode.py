"""Attention for CPU generation in bf16/fp16: torch's fused sdpa for prompts, one-token steps laid out to be fast.

Why it exists: torch's fused CPU attention kernel is built for blocks of queries, and transformers
calls it with a decode step's one query row per head. For grouped-query models the query heads
that share a key/value head are laid out as that head's rows, (B, H, 1, D) -> (B, Hkv, H/Hkv, D),
and the fused kernel kept; for multi-head models, with nothing to group, eager's three plain ops are
the faster. Prompts, and fp32 throughout, keep the fused kernel. The figures (``benchmarks/attention.py``)
are in docs/backends/cpu.md, "What whichdevice decides".

The resolver passes this name on its own only for grouped-query models: the plain matmuls compute
bf16 scores, as eager attention does, and their logits measured further from eager fp32 than sdpa's
(``benchmarks/decode_accuracy.py``); a user may still ask for them. They never touch torch's global
oneDNN switch: under the single-row tuning (``whichdevice.tuning.single_row``) a batch-1 step's
matmuls run with it off, as every other matmul of that step does.

transformers calls attention through a registry (``AttentionInterface``), so this is registered
under its own name, ``ATTENTION_NAME``, with sdpa's mask function: "sdpa" itself stays as
transformers defines it. The resolver only picks this name for architectures in ``VERIFIED_MODEL_TYPES``,
whose modelling code reaches attention only through that registry and does not treat the literal
name "sdpa" differently on the decoder path (some models do: gemma4 compares the name with "sdpa"
to decide whether it may drop query tokens, falcon and bark look attention classes up by name);
tests/attention/test_decode_attention.py checks each of them against eager attention.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ATTENTION_NAME",
    "VERIFIED_MODEL_TYPES",
    "decode_attention_forward",
    "ensure_registered",
    "model_type_of",
]

# Contains "sdpa" so that transformers 5 runs its sdpa support checks for the model it loads.
ATTENTION_NAME = "whichdevice_sdpa"

# model_type values (config.json) whose every decode step tests/attention/test_decode_attention.py checks
# against eager attention, on transformers 5.x and 4.57. Dense decoders only: in a mixture of
# experts a bf16 rounding difference can flip an expert choice, so comparing logits with eager's
# would test the router, not the attention.
VERIFIED_MODEL_TYPES = frozenset(
    {
        "gemma",
        "gemma3_text",
        "gpt2",
        "gpt_neox",
        "granite",
        "llama",
        "mistral",
        "olmo2",
        "phi",
        "phi3",
        "qwen2",
        "qwen3",
        "smollm3",
        "starcoder2",
    }
)

_REGISTERED: list[bool] = []


def model_type_of(model: Any) -> str | None:
    """``model_type`` of a transformers config or ModelFacts, or of the config.json in a local or cached model
    folder; None when it cannot be read (placement reports a bad ``model=`` with the reason)."""
    from whichdevice.model.facts import model_config

    config = model_config(model)
    found = config.get("model_type") if config is not None else None
    return found if isinstance(found, str) else None


def ensure_registered() -> None:
    """Register ``ATTENTION_NAME`` with transformers (once per process; imports transformers)."""
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, decode_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _REGISTERED.append(True)


def decode_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention signature: query (B, H, 1, D) -> (B, 1, H, Dv) as eager computes it.

    Everything but a one-token query in bf16/fp16 on the CPU, and every feature the matmul path
    does not implement (position bias, soft-capping, attention sinks, dropout, returned weights),
    goes to transformers' own sdpa function unchanged.
    """
    import torch

    if (
        query.shape[2] != 1
        or query.device.type != "cpu"
        or query.dtype not in (torch.bfloat16, torch.float16)
        or (dropout and module.training)
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))
        or kwargs.get("output_attentions")
    ):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        result: tuple[Any, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
        return result

    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    mask = attention_mask
    if mask is not None:
        if mask.shape[1] == heads and heads != 1:
            mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-1])
        mask = mask[..., : key.shape[2]]
    # The query heads that share a key/value head become that head's rows, (B, H, 1, D) -> (B, Hkv,
    # H/Hkv, D): no key is repeated, and each head's rows attend to every cached key (a one-token query
    # comes last, so nothing is causal-masked; a padding mask broadcasts over the rows).
    q = query.reshape(batch, kv_heads, groups, head_dim)
    if groups > 1 and key.shape[-1] == value.shape[-1]:
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    else:
        out = _by_matmuls(torch, q, key, value, mask, scaling)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def _by_matmuls(torch: Any, q: Any, key: Any, value: Any, mask: Any, scaling: float | None) -> Any:
    """Eager attention's three ops for grouped rows q (B, Hkv, G, D): (B, Hkv, G, Dv)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, key.transpose(2, 3)) * scale
    if mask is not None:
        # transformers' sdpa masks are boolean (True: attend); a mask a caller built may be additive.
        is_bool = mask.dtype == torch.bool
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if is_bool else scores + mask
    # Softmax in fp32, as transformers' eager attention does.
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, value)  # heads in the order repeat_kv gives them
