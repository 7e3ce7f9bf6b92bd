"""Architectures known to run in fp16: a documented allow-list, failing closed.

On hardware whose half precision is fp16 (T4, V100, older MPS), a bf16 or fp32 checkpoint is cast to
fp16 only for a ``model_type`` listed here; any other architecture (including every one released after
this list was written) gets fp32, because bf16-trained activations beyond fp16's 65504 become inf and
then NaN without a word (transformers #39686, #39972). Each entry says what it rests on: its authors
published the weights in fp16 (the reference checkpoint's config.json ``torch_dtype``), or it was
trained in fp16. ``benchmarks/fp16_check.py`` also runs a tiny model of each listed architecture in fp16
and fp32 and prints the largest logit difference and any inf/NaN; a tiny random model is weak evidence
of how trained weights behave, so a measurement alone never puts an architecture on this list.
An fp16 checkpoint is its authors' own choice and keeps fp16, unless its architecture is known to
overflow in fp16 (``KNOWN_OVERFLOW``, each with its report): there even fp16 weights compute in fp32.
"""

from __future__ import annotations

__all__ = ["FP16_SAFE", "KNOWN_OVERFLOW", "fp16_evidence", "known_overflow"]

FP16_SAFE: dict[str, str] = {
    "llama": "Meta published Llama 2 in fp16 (meta-llama/Llama-2-7b-hf config.json torch_dtype float16); "
    "Llama 3 ships bf16 and is run in fp16 by vLLM on T4/V100 (no entry in vLLM's _FLOAT16_NOT_SUPPORTED_MODELS)",
    "opt": "trained in fp16 mixed precision (Zhang et al. 2022, OPT paper, section 2.2); facebook/opt-* config.json "
    "torch_dtype float16",
    "gpt_neox": "Pythia and GPT-NeoX-20B were trained in fp16 (Biderman et al. 2023, Pythia, appendix E); "
    "EleutherAI/pythia-* config.json torch_dtype float16",
    "gptj": "EleutherAI/gpt-j-6b publishes a float16 revision as its recommended half-precision weights (model card)",
}
# Not listed although its weights ship in fp16: phi (phi-2's attention overflows fp16 into NaN logits
# unless queries and keys are upcast, transformers #28163), so it fails closed like any other.


# Known to overflow in fp16 even from fp16 weights: activations beyond fp16's 65504 become inf, then NaN.
_VLLM = "vLLM's _FLOAT16_NOT_SUPPORTED_MODELS (vllm/config/model.py): numerical instability in fp16"
KNOWN_OVERFLOW: dict[str, str] = {
    "gemma2": _VLLM,
    "gemma3": f"{_VLLM}; NaN in fp16, transformers #39686 and #39972",
    "gemma3_text": f"{_VLLM}; NaN in fp16, transformers #39686 and #39972",
    "glm4": _VLLM,
    "plamo2": _VLLM,
    "t5": "feed-forward outputs overflow fp16 (transformers #4586, #5651, #9295, #10956); "
    "trained with bf16 activations (google-research/text-to-text-transfer-transformer #539)",
    "mt5": "T5's architecture and bf16 training: the same fp16 overflow (transformers #10956)",
    "umt5": "T5's architecture and bf16 training: the same fp16 overflow (transformers #10956)",
}


def fp16_evidence(model_type: str | None) -> str | None:
    """Why ``model_type`` may run in fp16 (None: not known to be safe, so it does not)."""
    if model_type is None:
        return None
    return FP16_SAFE.get(model_type)


def known_overflow(model_type: str | None) -> str | None:
    """The report that ``model_type`` overflows in fp16 (None: none known)."""
    return KNOWN_OVERFLOW.get(model_type) if model_type is not None else None
