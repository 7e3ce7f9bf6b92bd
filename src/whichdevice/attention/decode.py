"""Attention for CPU generation in bf16/fp16: torch's fused sdpa for prompts, a plain matmul for one-token steps.

Why it exists: torch's fused CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``)
is built for blocks of queries, and for the one-token query of a decode step in bf16/fp16 it is
several times slower than the three plain ops of eager attention. ``benchmarks/attention.py`` on
torch 2.13 (AMD EPYC, 2 cores, batch 4, 12 heads of 64): one bf16 step over 160 cached tokens took
548 us fused against 162 us here, over 1,024 tokens 2,964 us against 382 us. For prompts the fused
kernel is kept: it never builds the L x L score matrix that makes eager slow on long prompts. In
fp32 the fused kernel is on par for one-token steps, and is kept throughout.

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
    # Grouped-query attention without repeating keys: the query heads that share a key/value head
    # become that head's rows, (B, H, 1, D) -> (B, Hkv, H/Hkv, D).
    q = query.reshape(batch, kv_heads, groups, head_dim)
    scores = torch.matmul(q, key.transpose(2, 3)) * (head_dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask
        if mask.shape[1] == heads and heads != 1:
            mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-1])
        mask = mask[..., : key.shape[2]]
        # transformers' sdpa masks are boolean (True: attend); a mask a caller built may be additive.
        is_bool = mask.dtype == torch.bool
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if is_bool else scores + mask
    # Softmax in fp32, as transformers' eager attention does.
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value)  # (B, Hkv, H/Hkv, Dv): heads in the order repeat_kv gives them
    return out.reshape(batch, 1, heads, value.shape[-1]), None
