"""Does the static cache whichdevice hands over on a GPU pay for a whole job, compile included? (issue 27)

    python benchmarks/gpu_handover.py --sizes 0.4B 0.1B --long 4700 --short 256

For a bf16 Llama of each size (random weights, ``max_position_embeddings`` raised to hold the long
job), a long and a short generation job at batch 1 are each resolved with
``resolve_device(model=path, batch_size=1, max_length=prompt + new, max_new_tokens=new)``. Each job
then runs twice, each time in a fresh process, the model loaded with ``res.model_kwargs()``:

- ``resolved``: ``res.prepare(model)`` (which sets the static cache where the resolution chose it);
- ``other``: the other answer (generate's own cache where the resolution chose the static one, the
  static cache, compiled by generate, where it did not).

Each prints the seconds of the whole ``generate`` call (``new`` tokens, the compile included, as a
job meets it) and ``resolved / other`` as a speed ratio: above 1 where whichdevice's answer was the
faster one. Run it on a machine with a CUDA GPU (``benchmarks/gpu_generation.sh`` calls it); on a CPU
the resolution never chooses the static cache, and the ``other`` run shows what it would cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from real_sizes import COMMON, SIZES


def child(path: str, prompt: int, new: int, which: str) -> None:
    """One job's generate in this (fresh) process, timed; prints a JSON line."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import whichdevice as wd

    transformers.utils.logging.set_verbosity_error()
    res = wd.resolve_device(model=path, batch_size=1, max_length=prompt + new, max_new_tokens=new)
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval()
    if which == "resolved":
        res.prepare(model)
    else:
        model.generation_config.cache_implementation = (
            None if (res.tuning is not None and res.tuning.static_cache) else "static"
        )
    ids = torch.randint(3, COMMON["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    cache = model.generation_config.cache_implementation or "dynamic"
    print(json.dumps({"which": which, "cache": cache, "seconds": round(seconds, 2), "tokens": out.shape[1] - prompt}))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.4B"], choices=list(SIZES))
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--long", type=int, default=4700)
    parser.add_argument("--short", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--out", default="benchmarks/results/gpu_handover.json")
    parser.add_argument("--child", nargs=4, metavar=("PATH", "PROMPT", "NEW", "WHICH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3])
        return 0

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import whichdevice as wd

    deadline = time.monotonic() + args.budget_s
    report = []
    with tempfile.TemporaryDirectory(prefix="whichdevice-handover-") as tmp:
        for size in args.sizes:
            torch.manual_seed(0)
            common = {**COMMON, "max_position_embeddings": args.prompt + args.long + 64}
            config = LlamaConfig(**common, **SIZES[size], pad_token_id=0, bos_token_id=1, eos_token_id=2)
            path = str(Path(tmp) / size)
            LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
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
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def _run_child(path: str, prompt: int, new: int, which: str, deadline: float) -> dict[str, object]:
    """One configuration in a fresh process; a run cut off by the budget records how long it ran (a
    lower bound), as the first GPU run of this script lost a finished figure to one that did not end."""
    command = [sys.executable, __file__, "--child", path, str(prompt), str(new), which]
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


if __name__ == "__main__":
    sys.exit(main())
