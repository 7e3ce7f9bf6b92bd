"""Does the KV cache whichdevice hands generate pay for a whole job (static and compiled on a GPU, its own on a CPU)?

    python benchmarks/generation_cache.py handover --sizes 0.4B 0.1B --long 4700 --short 256   # GPU: whole jobs
    python benchmarks/generation_cache.py compile [--size 1.1B --batches 1 4]                   # per decode step
    python benchmarks/generation_cache.py long [--new 4700]                                     # a step's growth
    BUDGET_S=350 HANDOVER_S=200 bash benchmarks/gpu_generation.sh     # all three on a CUDA machine, ~6-7 min

``handover`` (issue 27): for a bf16 Llama of each size (random weights, ``max_position_embeddings``
raised to hold the long job), a long and a short job at batch 1 are each resolved with
``resolve_device(model=path, batch_size=1, max_length=prompt + new, max_new_tokens=new)`` and run twice,
each in a fresh process loaded with ``res.model_kwargs()``: ``resolved`` (``res.prepare(model)``, which
sets the static cache where the resolution chose it) and ``other`` (the other answer: generate's own
cache where it chose the static one, the static cache, compiled by generate, where it did not). Prints
the seconds of the whole ``generate`` call (compile included, as a job meets it) and resolved / other
as a speed ratio (above 1: whichdevice's answer was the faster). Within ``--budget-s``; a run cut off
records how long it ran. On a CPU the resolution never chooses the static cache.

``compile``: a Llama of the given size loaded as resolved (then ``res.prepare(model)``), greedy generate
with NEW and with 1 new tokens in alternated rounds after a first call, three ways: ``resolved`` (its
own cache), ``static`` (``cache_implementation="static"``) and ``static+compile`` (compiled by generate:
on a CPU with ``CompileConfig(mode="default")`` and ``_compile_all_devices``, transformers' switch for
compiling off GPUs; on a GPU what generate does there by itself, ``mode="reduce-overhead"``). Prints
each one's first-call seconds (the compile lands there), decode tokens/s (batch x (NEW - 1) over
time(NEW) - time(1), median of the rounds), and the new tokens after which the compile pays for itself
against ``resolved`` (never, where it decodes no faster). About 4 minutes for the 1.1B on 2 cores.

``long``: one greedy job with generate's own (dynamic) cache, each decode step timed by a logits
processor (on a GPU it synchronizes first); every 500 steps it prints the mean of the last 100, so a
step that grows with the cache shows where, and a run cut off keeps what it measured. A 2-layer toy
Llama on the CPU by default (about 40 s); ``PYTHONPATH=/other/transformers`` compares versions.

Each prints the machine line first; ``--json PATH`` writes the figures (each job or size as it is done).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import LLAMA_SIZES as SIZES

TRACED = ("device", "calibration", "dtype", "attention", "generation")


def _ids(batch: int, prompt: int, device: Any) -> Any:
    import torch

    vocab = harness.LLAMA_COMMON["vocab_size"]
    return torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)


def _label(res: Any) -> str:
    tuning = res.tuning
    return (
        f"{res.dtype_name}/{res.attn_implementation}"
        + ("+single_row" if tuning is not None and tuning.single_row else "")
        + ("+packed" if tuning is not None and tuning.packed_for_batch else "")
    )


# ------------------------------------------------------------------------------------- handover


def handover_child(path: str, prompt: int, new: int, which: str) -> None:
    """One job's generate in this (fresh) process, timed; prints a JSON line."""
    from transformers import AutoModelForCausalLM

    import whichdevice as wd

    harness.quiet_transformers()
    res = wd.resolve_device(model=path, batch_size=1, max_length=prompt + new, max_new_tokens=new)
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval()
    if which == "resolved":
        res.prepare(model)
    else:
        static = res.tuning is not None and res.tuning.static_cache
        model.generation_config.cache_implementation = None if static else "static"
    seconds, out = harness.generate(model, _ids(1, prompt, model.device), new)
    cache = model.generation_config.cache_implementation or "dynamic"
    print(json.dumps({"which": which, "cache": cache, "seconds": round(seconds, 2), "tokens": out.shape[1] - prompt}))


def _run_child(path: str, prompt: int, new: int, which: str, deadline: float) -> dict[str, object]:
    """One configuration in a fresh process; a run cut off by the budget records how long it ran (a
    lower bound), as the first GPU run of this script lost a finished figure to one that did not end."""
    command = [sys.executable, __file__, "handover", "--child", path, str(prompt), str(new), which]
    limit = max(deadline - time.monotonic(), 30.0)
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"which": which, "error": "cut off", "process_s_at_least": round(time.monotonic() - start, 1)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    found: dict[str, object] = json.loads(lines[-1]) if lines else {"which": which, "error": done.stderr[-2000:]}
    found["process_s"] = round(time.monotonic() - start, 1)
    return found


def handover(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.child:
        handover_child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3])
        return []
    import whichdevice as wd

    deadline = time.monotonic() + args.budget_s
    report: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="whichdevice-handover-") as tmp:
        for size in args.sizes:
            path = str(Path(tmp) / size)
            context = args.prompt + args.long + 64
            harness.save_model(path, "bfloat16", **harness.llama(size, max_position_embeddings=context))
            for new in (args.long, args.short):
                if time.monotonic() > deadline:
                    print(f"skipped {size} x {new}: past the budget", flush=True)
                    continue
                res = wd.resolve_device(model=path, batch_size=1, max_length=args.prompt + new, max_new_tokens=new)
                runs = {which: _run_child(path, args.prompt, new, which, deadline) for which in ("resolved", "other")}
                seconds = [runs[w].get("seconds") for w in ("resolved", "other")]  # None where cut off
                entry = {
                    "size": size,
                    "new_tokens": new,
                    "device": res.device,
                    "static_cache": (res.tuning is not None and res.tuning.static_cache),
                    "runs": runs,
                    "resolved_over_other_speed": round(seconds[1] / seconds[0], 2) if all(seconds) else None,
                    "why": [s.message for s in res.trace if s.topic == "generation"],
                }
                report.append(entry)
                print(json.dumps(entry), flush=True)
                # Written after each job: a later one that runs out of time loses only itself.
                harness.write_json(args.json, {"machine": args.machine, "handover": report})
    return report


# ------------------------------------------------------------------------------------- compile


def compile_(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    import whichdevice as wd

    harness.quiet_transformers()
    compile_config = CompileConfig(mode="default")
    compile_config._compile_all_devices = True  # transformers' own switch for compiling off GPUs
    report = []
    with tempfile.TemporaryDirectory(prefix="whichdevice-compile-") as tmp:
        path = str(harness.save_model(Path(tmp) / "model", "bfloat16", **harness.llama(args.size)))
        for batch in args.batches:
            res = wd.resolve_device(model=path, batch_size=batch, max_length=args.prompt + args.new)
            model = res.prepare(AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval())
            ids = _ids(batch, args.prompt, model.device)
            # On a GPU, generate compiles a static cache's decode step by itself (its default config).
            compiled = {"compile_config": compile_config} if model.device.type == "cpu" else {}
            configs = {
                "resolved": {"disable_compile": True},
                "static": {"cache_implementation": "static", "disable_compile": True},
                "static+compile": {"cache_implementation": "static", **compiled},
            }
            first = {name: harness.time_generate(model, ids, args.new, **kw) for name, kw in configs.items()}
            full: dict[str, list[float]] = {name: [] for name in configs}
            one: dict[str, list[float]] = {name: [] for name in configs}
            for r in range(args.rounds):
                for name in harness.round_order(list(configs), r):
                    one[name].append(harness.time_generate(model, ids, 1, **configs[name]))
                    full[name].append(harness.time_generate(model, ids, args.new, **configs[name]))
            decode = {
                name: statistics.median(
                    batch * (args.new - 1) / max(f - o, 1e-9) for f, o in zip(full[name], one[name], strict=True)
                )
                for name in configs
            }
            compile_s = first["static+compile"] - statistics.median(full["static+compile"])
            saved_per_token = batch / decode["resolved"] - batch / decode["static+compile"]
            pays_after = round(compile_s / saved_per_token * batch) if saved_per_token > 0 else None
            entry = {
                "device": res.device if model.device.type == "cpu" else torch.cuda.get_device_name(model.device),
                "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
                "weights_gb": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, 2),
                "size": args.size,
                "batch": batch,
                "resolved": _label(res),
                "first_call_s": {k: round(v, 2) for k, v in first.items()},
                "decode_tok_s": {k: round(v, 2) for k, v in decode.items()},
                "compile_s": round(compile_s, 1),
                "compile_pays_after_new_tokens": pays_after,
                "uptime": harness.uptime(),
                "why": [s.message for s in res.trace if s.topic in TRACED],
            }
            report.append(entry)
            print(json.dumps(entry), flush=True)
            harness.write_json(args.json, {"machine": args.machine, "compile": report})
            del model
    return report


# ------------------------------------------------------------------------------------- long


def long(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import LogitsProcessor, LogitsProcessorList

    harness.quiet_transformers()
    shape = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=32000,
                 max_position_embeddings=args.prompt + args.new + 8)  # fmt: skip
    model = harness.build_model(**shape).to(device=args.device, dtype=getattr(torch, args.dtype))
    model.set_attn_implementation(args.attention)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    stamps: list[float] = []
    means: list[dict[str, float]] = []
    w = args.window

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            sync()
            stamps.append(time.perf_counter())
            n = len(stamps) - 1  # steps timed so far
            if n >= w and n % args.every == 0:  # printed as it goes: a run cut off keeps its curve so far
                mean = (stamps[-1] - stamps[-1 - w]) / w
                means.append({"first_step": n - w + 1, "last_step": n, "seconds": mean})
                print(
                    f"  steps {n - w + 1:5d}-{n:5d}: {1000 * mean:7.2f} ms a step ({1 / mean:7.1f} tokens/s)",
                    flush=True,
                )
            return scores

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, {args.device}, {args.dtype}, "
        f"{args.attention}, {args.layers} layers x {args.hidden}, {args.new} new tokens:",
        flush=True,
    )
    ids = torch.randint(3, 32000, (1, args.prompt), device=args.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, eos_token_id=None,
                       pad_token_id=0, logits_processor=LogitsProcessorList([Stamp()]))  # fmt: skip
    total = time.perf_counter() - start
    print(f"{args.new} new tokens in {total:.1f} s ({args.new / total:.1f} tokens/s)")
    return {"shape": shape, "device": args.device, "dtype": args.dtype, "means": means, "seconds": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ap.add_subparsers(dest="part", required=True)
    p = parts.add_parser("handover", help="whole jobs, compile included, resolved and the other answer")
    p.add_argument("--sizes", nargs="+", default=["0.4B"], choices=list(SIZES))
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--long", type=int, default=4700)
    p.add_argument("--short", type=int, default=256)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--child", nargs=4, metavar=("PATH", "PROMPT", "NEW", "WHICH"), help=argparse.SUPPRESS)
    p.set_defaults(run=handover)
    harness.add_json_argument(p, default=str(harness.RESULTS / "gpu_handover.json"))
    p = parts.add_parser("compile", help="decode tokens/s: generate's own cache, static, static compiled")
    p.add_argument("--size", default="1.1B", choices=list(SIZES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=33)
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(run=compile_)
    harness.add_json_argument(p, default=str(harness.RESULTS / "compile_decode.json"))
    p = parts.add_parser("long", help="generate's own cache over a long job, step by step")
    p.add_argument("--new", type=int, default=4700)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--device", default="cpu")
    p.add_argument("--window", type=int, default=100, help="steps each printed mean covers")
    p.add_argument("--every", type=int, default=500, help="print a mean every this many steps")
    p.set_defaults(run=long)
    harness.add_json_argument(p, default=str(harness.RESULTS / "long_decode.json"))
    args = ap.parse_args()
    if args.part == "handover" and args.child:
        handover(args)
        return 0
    args.machine = harness.machine()
    print(harness.machine_line(args.machine), flush=True)
    result = args.run(args)
    harness.write_json(args.json, {"machine": args.machine, args.part: result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
