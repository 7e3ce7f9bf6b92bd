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
transformers defines it. The function and its registration are in ``decode_forward``; the keywords
name sdpa, and ``res.prepare(model)`` runs this in its place (whichdevice.tuning.decode_attention).
The resolver only picks this name for architectures in ``VERIFIED_MODEL_TYPES``,
whose modelling code reaches attention only through that registry and does not treat the literal
name "sdpa" differently on the decoder path (some models do: gemma4 compares the name with "sdpa"
to decide whether it may drop query tokens, falcon and bark look attention classes up by name);
tests/attention/test_decode_attention.py checks each of them against eager attention.
"""

from __future__ import annotations

from typing import Any

# The function and its registered name live in decode_forward (imported by what installs it on a model);
# named here too, where they have always been importable from.
from whichdevice.attention.decode_forward import ATTENTION_NAME, decode_attention_forward, ensure_registered

__all__ = [
    "ATTENTION_NAME",
    "VERIFIED_MODEL_TYPES",
    "decode_attention_forward",
    "ensure_registered",
    "model_type_of",
]

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


def model_type_of(model: Any) -> str | None:
    """``model_type`` of a transformers config or ModelFacts, or of the config.json in a local or cached model
    folder; None when it cannot be read (placement reports a bad ``model=`` with the reason)."""
    from whichdevice.model.facts import model_config

    config = model_config(model)
    found = config.get("model_type") if config is not None else None
    return found if isinstance(found, str) else None
