"""whichdevice's decode attention as transformers calls it: the function, and the name it is registered under.

What it computes and why is in whichdevice.attention.decode, which decides for which models it is
chosen. This module imports nothing of whichdevice's, so that what installs and registers it on a
loaded model (whichdevice.tuning.decode_attention, a prepared model's pickle) stays a short import away.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ATTENTION_NAME", "decode_attention_forward", "ensure_registered"]

# Contains "sdpa" so that transformers 5 runs its sdpa support checks for the model it loads.
ATTENTION_NAME = "whichdevice_sdpa"

_REGISTERED: list[bool] = []


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
