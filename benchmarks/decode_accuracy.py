"""How far the CPU decode attention (whichdevice_sdpa) is from eager fp32, next to plain sdpa.

For a set of prompts, a tiny random Llama decodes greedily in fp32 with eager attention; the same
tokens are then fed one step at a time (teacher forcing, so every run sees the same sequence) in
bf16 and fp16 with ``sdpa`` and with ``whichdevice_sdpa``, with a dynamic and a static cache. The
figure is the largest absolute logit difference from eager fp32 over every decode step and prompt.
The decode attention is as accurate as sdpa where its figure is no larger than sdpa's. Both head
layouts, as the decode attention runs each its own way: multi-head (8 key/value heads for 8 query
heads: plain matmuls) and grouped-query (4 for 8: torch's fused kernel with the heads grouped).

Run: PYTHONPATH=src python benchmarks/decode_accuracy.py
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from whichdevice.attention.decode import ATTENTION_NAME, ensure_registered

PROMPT_LENGTHS = (5, 17, 40)
NEW_TOKENS = 12
SEED = 0


def _model(dtype: torch.dtype, attn: str, kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = attn
    return model.to(dtype)


def _reference(prompt: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = _model(torch.float32, "eager", kv_heads)
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    return out.sequences, [step.float() for step in out.logits]


def _forced(model: LlamaForCausalLM, sequence: torch.Tensor, prompt_len: int, static: bool) -> list[torch.Tensor]:
    cache = (
        StaticCache(config=model.config, max_cache_len=sequence.shape[1] + 1)
        if static
        else DynamicCache(config=model.config)
    )
    logits = []
    with torch.no_grad():
        out = model(sequence[:, :prompt_len], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
        for pos in range(prompt_len, sequence.shape[1] - 1):
            position = torch.tensor([[pos]])
            out = model(
                sequence[:, pos : pos + 1],
                cache=cache,
                use_cache=True,
                position_ids=position,
                cache_position=torch.tensor([pos]),
            )
            logits.append(out.logits[:, -1].float())
    return logits


def main() -> None:
    ensure_registered()
    torch.manual_seed(SEED + 1)
    prompts = [torch.randint(0, 512, (1, n)) for n in PROMPT_LENGTHS]
    print(f"max |logit - eager fp32| over {len(prompts)} prompts x {NEW_TOKENS} steps (tiny Llama, seed {SEED})")
    print(f"{'heads':<14} {'dtype':<9} {'cache':<8} {'sdpa':>9} {ATTENTION_NAME:>17}  decode no further than sdpa")
    for layout, kv_heads in (("8 over 8", 8), ("8 over 4", 4)):
        refs = [_reference(p, kv_heads) for p in prompts]
        for dtype in (torch.bfloat16, torch.float16):
            for static in (False, True):
                worst = {}
                for attn in ("sdpa", ATTENTION_NAME):
                    model = _model(dtype, attn, kv_heads)
                    diffs = []
                    for prompt, (sequence, ref) in zip(prompts, refs, strict=True):
                        got = _forced(model, sequence, prompt.shape[1], static)
                        diffs += [(a - b).abs().max().item() for a, b in zip(got, ref, strict=False)]
                    worst[attn] = max(diffs)
                ok = worst[ATTENTION_NAME] <= worst["sdpa"]
                name = str(dtype).removeprefix("torch.")
                cache = "static" if static else "dynamic"
                print(f"{layout:<14} {name:<9} {cache:<8} {worst['sdpa']:>9.5f} {worst[ATTENTION_NAME]:>17.5f}  {ok}")


if __name__ == "__main__":
    main()
