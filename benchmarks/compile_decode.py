"""Does torch.compile of the decode step pay on this CPU, and after how many tokens? (issue 27)

    python benchmarks/compile_decode.py                      # 1.1B Llama, bf16, batch 1 and 4
    python benchmarks/compile_decode.py --size 0.4B --batches 1

transformers 5.25 compiles generate's decode step only with a compileable (static) cache and, off
CUDA/XPU/MPS/TPU/Neuron, only when ``CompileConfig._compile_all_devices`` is set. On a CPU the compiled
configuration uses ``mode="default"``; on a GPU it uses what generate does there by itself with a static
cache (transformers' default ``CompileConfig``: ``mode="reduce-overhead"``, CUDA graphs). For a Llama of the
given size (random weights saved as bf16), loaded as whichdevice resolves it (``from_pretrained(path,
**res.model_kwargs())`` then ``res.prepare(model)``), each configuration runs greedy generate with
NEW new tokens and with 1, in interleaved rounds after a first call:

- ``resolved``: the resolved load with its own cache (dynamic);
- ``static``: the same with ``cache_implementation="static"``;
- ``static+compile``: the same, compiled by generate (inductor, ``mode="default"``).

It prints each one's first-call seconds (the compile lands there), its decode tokens/s (batch x
(NEW - 1) over time(NEW) - time(1), median of the rounds), and for the compiled one the new tokens
after which the compile would have paid for itself against ``resolved`` (never, where it decodes no
faster). The resolver hands over only what it measures faster for the job; this script shows why
compile is not among those settings on a CPU where it does not pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

# The same models as real_sizes.py (this folder is on sys.path when a script here runs).
from real_sizes import COMMON, SIZES, TRACED, Config, uptime


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="1.1B", choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/compile_decode.json")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    import whichdevice as wd

    transformers.utils.logging.set_verbosity_error()
    compile_config = CompileConfig(mode="default")
    compile_config._compile_all_devices = True  # transformers' own switch for compiling off GPUs
    report = []
    with tempfile.TemporaryDirectory(prefix="whichdevice-compile-") as tmp:
        torch.manual_seed(0)
        config = LlamaConfig(**COMMON, **SIZES[args.size], pad_token_id=0, bos_token_id=1, eos_token_id=2)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(Path(tmp) / "model")
        path = str(Path(tmp) / "model")
        for batch in args.batches:
            res = wd.resolve_device(model=path, batch_size=batch, max_length=args.prompt + args.new)
            model = res.prepare(AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval())
            ids = torch.randint(
                3, COMMON["vocab_size"], (batch, args.prompt), generator=torch.Generator().manual_seed(0)
            ).to(model.device)
            # On a GPU, generate compiles a static cache's decode step by itself (its default config).
            compiled = {"compile_config": compile_config} if model.device.type == "cpu" else {}
            configs = {
                "resolved": {"disable_compile": True},
                "static": {"cache_implementation": "static", "disable_compile": True},
                "static+compile": {"cache_implementation": "static", **compiled},
            }
            # real_sizes.Config runs greedy generate with each configuration's keywords, timed.
            runs = {name: Config(name, model, None, kw) for name, kw in configs.items()}
            first = {name: run.run(torch, ids, args.new) for name, run in runs.items()}
            full: dict[str, list[float]] = {name: [] for name in configs}
            one: dict[str, list[float]] = {name: [] for name in configs}
            for r in range(args.rounds):
                for name in list(configs) if r % 2 == 0 else list(configs)[::-1]:
                    one[name].append(runs[name].run(torch, ids, 1))
                    full[name].append(runs[name].run(torch, ids, args.new))
            decode = {
                name: statistics.median(
                    batch * (args.new - 1) / max(f - o, 1e-9) for f, o in zip(full[name], one[name], strict=True)
                )
                for name in configs
            }
            steady = {name: statistics.median(full[name]) for name in configs}
            compile_s = first["static+compile"] - steady["static+compile"]
            saved_per_token = batch / decode["resolved"] - batch / decode["static+compile"]
            pays_after = round(compile_s / saved_per_token * batch) if saved_per_token > 0 else None
            entry = {
                "device": res.device if model.device.type == "cpu" else torch.cuda.get_device_name(model.device),
                "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
                "weights_gb": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, 2),
                "size": args.size,
                "batch": batch,
                "resolved": f"{res.dtype_name}/{res.attn_implementation}"
                + ("+single_row" if (res.tuning is not None and res.tuning.single_row) else "")
                + ("+packed" if (res.tuning is not None and res.tuning.packed_for_batch) else ""),
                "first_call_s": {k: round(v, 2) for k, v in first.items()},
                "decode_tok_s": {k: round(v, 2) for k, v in decode.items()},
                "compile_s": round(compile_s, 1),
                "compile_pays_after_new_tokens": pays_after,
                "uptime": uptime(),
                "why": [s.message for s in res.trace if s.topic in ("device", *TRACED)],
            }
            report.append(entry)
            print(json.dumps(entry), flush=True)
            del model
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
