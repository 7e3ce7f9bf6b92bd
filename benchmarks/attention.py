"""Why whichdevice_sdpa: attention per call, and generation at short and long prompts, on this CPU.

    python benchmarks/attention.py            # about 3 minutes on 2 cores
    python benchmarks/attention.py --quick    # fewer repeats, a smaller model

Part 1 times one attention call, as a Llama layer makes it (batch 4, 12 heads of 64), three ways:
torch's fused ``scaled_dot_product_attention``, the matmul-softmax-matmul that transformers' eager
attention computes, and whichdevice's ``decode_attention_forward``; for a one-token query (a decode
step) over 160, 1,024 and 4,096 cached tokens, and for a 128-token prompt, in bf16 and fp32.

Part 2 generates 32 tokens for 4 prompts of 128 and of 1,024 tokens with the benchmark's Llama
(hidden 768, 8 layers) in bf16, loaded with attn_implementation sdpa, eager and whichdevice_sdpa,
in alternating order, and prints median tokens/s and the ratios to sdpa.

Prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

BATCH, HEADS, HEAD_DIM = 4, 12, 64


def per_call_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def time_one_shape(dtype: Any, q_len: int, kv_len: int, repeats: int) -> tuple[float, float, float]:
    """us per call: fused sdpa, transformers' eager attention, whichdevice's decode attention."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from whichdevice.attention.decode import decode_attention_forward

    module = type("Layer", (), {"num_key_value_groups": 1, "training": False, "is_causal": True})()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, q_len, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(BATCH, HEADS, kv_len, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(BATCH, HEADS, kv_len, HEAD_DIM, generator=g).to(dtype)
    causal = q_len > 1
    mask = None
    if causal:  # eager takes the causal pattern as an additive mask, as transformers builds it
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        mask = torch.zeros(1, 1, q_len, kv_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    calls = max(2, int(20_000 / (kv_len * q_len**0.5)))
    with torch.inference_mode():
        fused = per_call_us(lambda: scaled_dot_product_attention(q, k, v, is_causal=causal), calls, repeats)
        eager = per_call_us(
            lambda: eager_attention_forward(module, q, k, v, mask, scaling=HEAD_DIM**-0.5), calls, repeats
        )
        ours = per_call_us(lambda: decode_attention_forward(module, q, k, v, None, is_causal=causal), calls, repeats)
    return fused, eager, ours


def part_calls(quick: bool) -> None:
    import torch

    repeats = 3 if quick else 7
    print("Part 1: one attention call, batch 4 x 12 heads x 64 (median us per call; ratio to fused sdpa)")
    print(f"{'dtype':<9} {'query':>6} {'keys':>6} | {'fused sdpa':>11} | {'eager':>16} | {'whichdevice':>16}")
    for dtype in (torch.bfloat16, torch.float32):
        for q_len, kv_len in ((1, 160), (1, 1024), (1, 4096), (128, 128)):
            fused, eager, ours = time_one_shape(dtype, q_len, kv_len, repeats)
            name = str(dtype).removeprefix("torch.")
            print(
                f"{name:<9} {q_len:>6} {kv_len:>6} | {fused:>11.0f} | {eager:>9.0f} {eager / fused:>5.2f}x"
                f" | {ours:>9.0f} {ours / fused:>5.2f}x"
            )


def part_generation(quick: bool) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from whichdevice.attention.decode import ATTENTION_NAME, ensure_registered

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    ensure_registered()
    hidden, layers, heads = (256, 2, 4) if quick else (768, 8, 12)
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=hidden * 8 // 3,
        vocab_size=32000,
        max_position_embeddings=2048,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    impls = ("sdpa", "eager", ATTENTION_NAME)
    rounds = 2 if quick else 4
    print(f"\nPart 2: generate 32 tokens, batch 4, Llama hidden {hidden} x {layers} layers in bf16 (median tokens/s)")
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
        models = {
            impl: AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, attn_implementation=impl).eval()
            for impl in impls
        }
        for prompt in (128, 1024):
            ids = torch.randint(3, 32000, (BATCH, prompt), generator=torch.Generator().manual_seed(1))

            def tokens_per_s(model: Any, new: int = 32, ids: Any = ids) -> float:
                with torch.inference_mode():
                    start = time.perf_counter()
                    model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=new,
                        min_new_tokens=new,
                        do_sample=False,
                    )
                return BATCH * new / (time.perf_counter() - start)

            for model in models.values():
                tokens_per_s(model, new=2)
            samples: dict[str, list[float]] = {impl: [] for impl in impls}
            for r in range(rounds):
                for impl in impls if r % 2 == 0 else impls[::-1]:
                    samples[impl].append(tokens_per_s(models[impl]))
            base = samples["sdpa"]
            cells = []
            for impl in impls:
                ratio = statistics.median(a / b for a, b in zip(samples[impl], base, strict=True))
                cells.append(f"{impl} {statistics.median(samples[impl]):.1f} ({ratio:.2f}x)")
            print(f"prompt {prompt:>5}: " + ", ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a smaller model")
    args = ap.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    part_calls(args.quick)
    part_generation(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
