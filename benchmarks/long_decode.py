"""How generate's decode step grows over a long job with its own (dynamic) cache, per token position.

    python benchmarks/long_decode.py                          # a 2-layer toy Llama, bf16, 4700 new tokens, CPU
    python benchmarks/long_decode.py --device cuda --layers 20 --hidden 1024 --intermediate 2816 --heads 16 --kv-heads 4
    PYTHONPATH=/tmp/tf517 python benchmarks/long_decode.py    # the same under another transformers

A follow-up of issue 27: on an H200 (torch 2.11, transformers 5.17) a 0.4B Llama's job of 4700 new
tokens with generate's own cache had not finished after 309 s, under 16 tokens/s against 82 for 65
tokens. This times each decode step (a logits processor stamps the clock; on a GPU it synchronizes
first) and prints, every 500 steps as it goes, the mean of the last 100, so a step that grows with
the cache shows where and how fast, and a run cut off by a time limit keeps what it measured.
Greedy, no EOS, random weights built from a config.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--new", type=int, default=4700)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--window", type=int, default=100, help="steps each printed mean covers")
    ap.add_argument("--every", type=int, default=500, help="print a mean every this many steps")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=32000,
        max_position_embeddings=args.prompt + args.new + 8,
    )
    model = LlamaForCausalLM(config).eval().to(device=args.device, dtype=getattr(torch, args.dtype))
    model.set_attn_implementation(args.attention)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    stamps: list[float] = []

    w = args.window

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            sync()
            stamps.append(time.perf_counter())
            n = len(stamps) - 1  # steps timed so far
            if n >= w and n % args.every == 0:  # printed as it goes: a run cut off keeps its curve so far
                mean = (stamps[-1] - stamps[-1 - w]) / w
                span = f"{n - w + 1:5d}-{n:5d}"
                print(f"  steps {span}: {1000 * mean:7.2f} ms a step ({1 / mean:7.1f} tokens/s)", flush=True)
            return scores

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, {args.device}, {args.dtype}, "
        f"{args.attention}, {args.layers} layers x {args.hidden}, {args.new} new tokens:",
        flush=True,
    )
    ids = torch.randint(3, 32000, (1, args.prompt), device=args.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([Stamp()]),
        )
    total = time.perf_counter() - start
    print(f"{args.new} new tokens in {total:.1f} s ({args.new / total:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
