"""Why whichdevice_sdpa on a CPU: attention per call, generation at short and long prompts, and its accuracy.

    python benchmarks/attention.py                     # every part, about 7 minutes on 2 cores
    python benchmarks/attention.py --quick             # fewer repeats, a smaller model: about 2 minutes
    python benchmarks/attention.py --only accuracy     # calls, generation, accuracy (repeatable)

``calls``: one attention call as a Llama layer makes it (heads of 64; multi-head: 12 heads,
grouped-query: 32 query heads over 4 key/value heads, a 1.1B Llama's), three ways: transformers'
``sdpa`` (torch's fused kernel as transformers calls it, without a mask as for a batch without
padding), its eager attention, and whichdevice's ``decode_attention_forward``; for a one-token query
(a decode step) at batch 1 and 4 over 160, 1,024 and 4,096 cached tokens, and for a 128-token prompt,
in bf16 and fp32; bf16 steps at batch 1 also with oneDNN off, as the single-row hook runs them.
Median microseconds per call and the ratio to sdpa.

``generation``: 32 new tokens for 4 prompts of 128 and of 1,024 tokens with the 106M Llama of
``cpu_dtype_and_tuning.py sweep`` (hidden 768, 8 layers, 12 heads; multi-head and over 4 key/value
heads) in bf16, loaded with sdpa, eager and whichdevice_sdpa, in alternated rounds: median tokens/s
and the median of per-round ratios to sdpa.

``accuracy``: how far whichdevice_sdpa is from eager fp32, next to plain sdpa. A tiny random Llama
decodes greedily in fp32 with eager attention; the same tokens are then fed one step at a time
(teacher forcing, so every run sees the same sequence) in bf16 and fp16 with sdpa and with
whichdevice_sdpa, with a dynamic and a static cache. The figure is the largest absolute logit
difference from eager fp32 over every decode step of 3 prompts x 12 steps; the decode attention is as
accurate as sdpa where its figure is no larger. Both head layouts: multi-head (8 over 8: plain
matmuls) and grouped-query (8 over 4: torch's fused kernel with the heads grouped). No timing: the
same figures on any run of the same torch.

The figures in docs/backends/cpu.md and the resolver's thresholds (attention/choose.py) come from it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import harness

PARTS = ("calls", "generation", "accuracy")
BATCH, HEAD_DIM = 4, 64
LAYOUTS = {"multi-head": (12, 12), "grouped-query": (32, 4)}


# ------------------------------------------------------------------------------------- calls


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
    mask = None
    if q_len > 1:  # eager takes the causal pattern as an additive mask, as transformers builds it
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril()
        mask = torch.zeros(1, 1, q_len, kv_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    calls = max(2, int(20_000 / (kv_len * q_len**0.5)))
    scale = HEAD_DIM**-0.5
    with torch.inference_mode():
        sdpa = per_call_us(lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale), calls, repeats)
        eager = per_call_us(lambda: eager_attention_forward(module, q, k, v, mask, scaling=scale), calls, repeats)
        ours = per_call_us(lambda: decode_attention_forward(module, q, k, v, None, scaling=scale), calls, repeats)
    return sdpa, eager, ours


def part_calls(quick: bool) -> list[dict[str, Any]]:
    import torch

    repeats = 3 if quick else 7
    print("calls: one attention call, heads of 64 (median us per call; ratio to transformers' sdpa)")
    shapes = [(b, 1, n) for b in (1, 4) for n in (160, 1024, 4096)] + [(BATCH, 128, 128)]
    found, rows = [], []
    for layout in LAYOUTS:
        for dtype in (torch.bfloat16, torch.float32):
            for batch, q_len, kv_len in shapes:
                # bf16 batch-1 steps also with oneDNN off, as a batch-1 step runs under the single-row hook
                for onednn in (True, False) if dtype == torch.bfloat16 and batch == 1 else (True,):
                    switch: Any = torch.backends.mkldnn
                    switch.enabled = onednn
                    try:
                        sdpa, eager, ours = time_one_shape(dtype, layout, batch, q_len, kv_len, repeats)
                    finally:
                        switch.enabled = True
                    name = str(dtype).removeprefix("torch.")
                    found.append(dict(layout=layout, dtype=name, batch=batch, onednn=onednn, query=q_len, keys=kv_len,
                                      sdpa_us=sdpa, eager_us=eager, whichdevice_us=ours))  # fmt: skip
                    rows.append(
                        [layout, name, batch, "on" if onednn else "off", q_len, kv_len, f"{sdpa:.0f}",
                         f"{eager:.0f} ({eager / sdpa:.2f}x)", f"{ours:.0f} ({ours / sdpa:.2f}x)"]
                    )  # fmt: skip
    head = ["heads", "dtype", "batch", "oneDNN", "query", "keys", "sdpa us", "eager us", "whichdevice_sdpa us"]
    print(harness.table(head, rows))
    return found


# ------------------------------------------------------------------------------------- generation


def part_generation(quick: bool) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    from whichdevice.attention.decode import ATTENTION_NAME, ensure_registered

    harness.quiet_transformers()
    ensure_registered()
    hidden, layers, heads = (256, 2, 4) if quick else (768, 8, 12)
    impls = ("sdpa", "eager", ATTENTION_NAME)
    found = []
    for kv_heads in (heads, 4 if heads > 4 else 2):
        config = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=hidden * 8 // 3, vocab_size=32000,
                      max_position_embeddings=2048, pad_token_id=0)  # fmt: skip
        print(
            f"\ngeneration: 32 new tokens, batch 4, Llama hidden {hidden} x {layers} layers, {heads} heads over"
            f" {kv_heads} key/value heads, in bf16 (median tokens/s; median of per-round ratios to sdpa)"
        )
        with tempfile.TemporaryDirectory() as tmp:
            harness.save_model(tmp, "bfloat16", **config)
            models = {
                impl: AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, attn_implementation=impl).eval()
                for impl in impls
            }
            for prompt in (128, 1024):
                ids = torch.randint(3, 32000, (BATCH, prompt), generator=torch.Generator().manual_seed(1))
                for model in models.values():
                    harness.time_generate(model, ids, 2)

                def tokens_per_s(model: Any, ids: Any = ids) -> Callable[[], float]:
                    return lambda: BATCH * 32 / harness.time_generate(model, ids, 32)

                runs = {impl: tokens_per_s(models[impl]) for impl in impls}
                samples = harness.alternate(runs, 2 if quick else 4)
                cells = []
                for impl in impls:
                    ratio = harness.pairwise(samples[impl], samples["sdpa"])["median"]
                    cells.append(f"{impl} {statistics.median(samples[impl]):.1f} ({ratio:.2f}x)")
                    found.append(
                        {"kv_heads": kv_heads, "prompt": prompt, "attention": impl, "tokens_per_s": samples[impl]}
                    )
                print(f"prompt {prompt:>5}: " + ", ".join(cells))
    return found


# ------------------------------------------------------------------------------------- accuracy

PROMPT_LENGTHS, NEW_TOKENS, SEED = (5, 17, 40), 12, 0


def _tiny(dtype: Any, attn: str, kv_heads: int) -> Any:
    shape = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=kv_heads, max_position_embeddings=256)  # fmt: skip
    model = harness.build_model(seed=SEED, **shape)
    model.config._attn_implementation = attn
    return model.to(dtype)


def _reference(prompt: Any, kv_heads: int) -> tuple[Any, list[Any]]:
    import torch

    model = _tiny(torch.float32, "eager", kv_heads)
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    return out.sequences, [step.float() for step in out.logits]


def _forced(model: Any, sequence: Any, prompt_len: int, static: bool) -> list[Any]:
    import torch
    from transformers import DynamicCache, StaticCache

    if static:
        cache = StaticCache(config=model.config, max_cache_len=sequence.shape[1] + 1)
    else:
        cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        out = model(sequence[:, :prompt_len], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
        for pos in range(prompt_len, sequence.shape[1] - 1):
            out = model(
                sequence[:, pos : pos + 1],
                cache=cache,
                use_cache=True,
                position_ids=torch.tensor([[pos]]),
                cache_position=torch.tensor([pos]),
            )
            logits.append(out.logits[:, -1].float())
    return logits


def part_accuracy() -> list[dict[str, Any]]:
    import torch

    from whichdevice.attention.decode import ATTENTION_NAME, ensure_registered

    ensure_registered()
    torch.manual_seed(SEED + 1)
    prompts = [torch.randint(0, 512, (1, n)) for n in PROMPT_LENGTHS]
    print(
        f"\naccuracy: max |logit - eager fp32| over {len(prompts)} prompts x {NEW_TOKENS} steps "
        f"(tiny Llama, seed {SEED})"
    )
    found, rows = [], []
    for layout, kv_heads in (("8 over 8", 8), ("8 over 4", 4)):
        refs = [_reference(p, kv_heads) for p in prompts]
        for dtype in (torch.bfloat16, torch.float16):
            for static in (False, True):
                worst = {}
                for attn in ("sdpa", ATTENTION_NAME):
                    model = _tiny(dtype, attn, kv_heads)
                    diffs = []
                    for prompt, (sequence, ref) in zip(prompts, refs, strict=True):
                        got = _forced(model, sequence, prompt.shape[1], static)
                        diffs += [(a - b).abs().max().item() for a, b in zip(got, ref, strict=False)]
                    worst[attn] = max(diffs)
                name, cache = str(dtype).removeprefix("torch."), "static" if static else "dynamic"
                ok = worst[ATTENTION_NAME] <= worst["sdpa"]
                found.append({"heads": layout, "dtype": name, "cache": cache, **worst, "no_further": ok})
                rows.append([layout, name, cache, f"{worst['sdpa']:.5f}", f"{worst[ATTENTION_NAME]:.5f}", ok])
    print(harness.table(["heads", "dtype", "cache", "sdpa", ATTENTION_NAME, "decode no further than sdpa"], rows))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a smaller model")
    ap.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    harness.add_json_argument(ap, default=str(harness.RESULTS / "attention.json"))
    args = ap.parse_args()
    machine = harness.machine()
    print(harness.machine_line(machine))
    parts = [p for p in PARTS if not args.only or p in args.only]
    found: dict[str, Any] = {}
    if "calls" in parts:
        found["calls"] = part_calls(args.quick)
    if "generation" in parts:
        found["generation"] = part_generation(args.quick)
    if "accuracy" in parts:
        found["accuracy"] = part_accuracy()
    harness.write_json(args.json, {"machine": machine, "load_average_after": harness.load_average(), **found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
