"""Why whichdevice_sdpa: attention per call, and generation at short and long prompts, on this CPU.

    python benchmarks/attention.py            # about 6 minutes on 2 cores
    python benchmarks/attention.py --quick    # fewer repeats, a smaller model

Part 1 times one attention call, as a Llama layer makes it (heads of 64; multi-head: 12 heads,
grouped-query: 32 query heads over 4 key/value heads, a 1.1B Llama's), three ways: transformers'
``sdpa`` (torch's fused kernel as transformers calls it, without a mask as for a batch without
padding), its eager attention, and whichdevice's ``decode_attention_forward``; for a one-token query
(a decode step) at batch 1 and 4 over 160, 1,024 and 4,096 cached tokens, and for a 128-token prompt,
in bf16 and fp32; bf16 steps at batch 1 also with oneDNN off, as the single-row hook runs them.

Part 2 generates 32 tokens for 4 prompts of 128 and of 1,024 tokens with the benchmark's Llama
(hidden 768, 8 layers, 12 heads; multi-head and over 4 key/value heads) in bf16, loaded with
attn_implementation sdpa, eager and whichdevice_sdpa, in alternating order, and prints median
tokens/s and the ratios to sdpa.

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

BATCH, HEAD_DIM = 4, 64
LAYOUTS = {"multi-head": (12, 12), "grouped-query": (32, 4)}


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


def time_one_shape(
    dtype: Any, layout: str, batch: int, q_len: int, kv_len: int, repeats: int
) -> tuple[float, float, float]:
    """us per call: transformers' sdpa, its eager attention, whichdevice's decode attention."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from whichdevice.attention.decode import decode_attention_forward

    heads, kv_heads = LAYOUTS[layout]
    attrs = {"num_key_value_groups": heads // kv_heads, "training": False, "is_causal": True}
    module = type("Layer", (), attrs)()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, HEAD_DIM, generator=g).to(dtype)
    causal = q_len > 1
    mask = None
    if causal:  # eager takes the causal pattern as an additive mask, as transformers builds it
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        mask = torch.zeros(1, 1, q_len, kv_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    calls = max(2, int(20_000 / (kv_len * q_len**0.5)))
    scale = HEAD_DIM**-0.5
    with torch.inference_mode():
        sdpa = per_call_us(lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale), calls, repeats)
        eager = per_call_us(lambda: eager_attention_forward(module, q, k, v, mask, scaling=scale), calls, repeats)
        ours = per_call_us(lambda: decode_attention_forward(module, q, k, v, None, scaling=scale), calls, repeats)
    return sdpa, eager, ours


def part_calls(quick: bool) -> None:
    import torch

    repeats = 3 if quick else 7
    print("Part 1: one attention call, heads of 64 (median us per call; ratio to transformers' sdpa)")
    print(f"{'':38} {'query':>6} {'keys':>6} | {'sdpa':>6} | {'eager':>14} | {'whichdevice':>14}")
    shapes = [(b, 1, n) for b in (1, 4) for n in (160, 1024, 4096)] + [(BATCH, 128, 128)]
    for layout in LAYOUTS:
        for dtype in (torch.bfloat16, torch.float32):
            for batch, q_len, kv_len in shapes:
                runs = [""]
                if dtype == torch.bfloat16 and batch == 1:
                    runs.append("oneDNN off")  # as a batch-1 step runs under the single-row hook
                for run in runs:
                    switch: Any = torch.backends.mkldnn
                    if run:
                        switch.enabled = False
                    try:
                        sdpa, eager, ours = time_one_shape(dtype, layout, batch, q_len, kv_len, repeats)
                    finally:
                        switch.enabled = True
                    name = f"{layout} {str(dtype).removeprefix('torch.')} b{batch} {run}"
                    print(
                        f"{name:<38} {q_len:>6} {kv_len:>6} | {sdpa:>6.0f} | {eager:>7.0f} {eager / sdpa:>5.2f}x"
                        f" | {ours:>7.0f} {ours / sdpa:>5.2f}x"
                    )


def part_generation(quick: bool) -> None:
    import torch
    import transformers
    from transformers import LlamaConfig

    from whichdevice.attention.decode import ensure_registered

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    ensure_registered()
    hidden, layers, heads = (256, 2, 4) if quick else (768, 8, 12)
    for kv_heads in (heads, 4 if heads > 4 else 2):
        config = LlamaConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=hidden * 8 // 3,
            vocab_size=32000,
            max_position_embeddings=2048,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        print(
            f"\nPart 2: generate 32 tokens, batch 4, Llama hidden {hidden} x {layers} layers, {heads} heads over"
            f" {kv_heads} key/value heads, in bf16 (median tokens/s)"
        )
        _generate(config, quick)


def _generate(config: Any, quick: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from whichdevice.attention.decode import ATTENTION_NAME

    impls = ("sdpa", "eager", ATTENTION_NAME)
    rounds = 2 if quick else 4
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
