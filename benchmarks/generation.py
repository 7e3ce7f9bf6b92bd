"""Choice quality: tokens/s of a small Llama for every way of loading it (run by run.py as a child).

One model is built from a config (no Hub access), saved as fp16, bf16 and fp32 checkpoints, and for
each checkpoint loaded several ways: with ``whichdevice.resolve_device(model=path).model_kwargs()``,
with transformers' defaults (no arguments), and with every dtype x attention of the sweep.

How it times them, per checkpoint:

1. a warm-up round, untimed: each configuration is loaded once and generates 4 tokens;
2. ``--rounds`` rounds over every configuration: each is loaded afresh, timed once and freed, in
   alternating order, so a burst of load on the machine hits every configuration alike and none is
   favoured by where its weights sit in memory;
3. ``--contender-rounds`` more rounds over the contenders only: the resolved configuration and every
   configuration within CONTENDER of the fastest of the sweep. Single runs here vary by 10-15% when other work
   shares the machine, so the few configurations the verdict compares get more samples, while those
   twice as slow do not need them.

A round in which a configuration ran at under DISTURBED of its best is "disturbed" (with torch's
threads on every core, one core taken by another process stalls every step) and left out, as long
as at least two clean rounds remain; in step 2 such a round is also re-run, up to EXTRA_ROUNDS times.
Ratios between two configurations are medians of per-round (pairwise) ratios over the rounds both ran.

Writes a JSON document to ``--out``; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from whichdevice.core.dtypes import NAMES, short_name

FULL_SHAPE = {
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
QUICK_SHAPE = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
BATCH, PROMPT, NEW_TOKENS = 4, 128, 32
CHECKPOINTS = ("float16", "bfloat16", "float32")
SWEEP_DTYPES = ("float32", "bfloat16", "float16")
SWEEP_ATTN = ("sdpa", "eager")
SHORT = {name: short_name(name) for name in NAMES}  # whichdevice.core.dtypes owns the spellings
DISTURBED = 0.6  # a run at under 0.6x the configuration's best marks its round disturbed
EXTRA_ROUNDS = 3  # at most this many re-runs of disturbed rounds of step 2, per checkpoint
CONTENDER = 0.8  # configurations at 0.8x the fastest median or better get the contender rounds


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {"n": 0}
    q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) >= 2 else (v[0], v[0], v[0])
    return {"n": len(v), "median": statistics.median(v), "p25": q1, "p75": q3, "min": v[0], "max": v[-1]}


class Rounds:
    """tokens/s per configuration per round, which rounds are disturbed, and the statistics."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[int, float]] = {}
        self.kinds: list[str] = []

    def run(self, kind: str, labels: list[str], timed: Callable[[str], float]) -> None:
        index = len(self.kinds)
        self.kinds.append(kind)
        order = labels if index % 2 == 0 else labels[::-1]
        for label in order:
            self.samples.setdefault(label, {})[index] = timed(label)
        log(f"    round {index + 1} ({kind}): " + ", ".join(f"{lab} {self.samples[lab][index]:.1f}" for lab in labels))

    def disturbed(self) -> set[int]:
        bad = set()
        for values in self.samples.values():
            best = max(values.values())
            bad |= {i for i, v in values.items() if v < DISTURBED * best}
        return bad

    def used(self, label: str) -> list[int]:
        """The rounds whose sample of ``label`` counts: the clean ones, or all when under two are clean."""
        have = sorted(self.samples[label])
        clean = [i for i in have if i not in self.disturbed()]
        return clean if len(clean) >= 2 else have

    def values(self, label: str) -> list[float]:
        return [self.samples[label][i] for i in self.used(label)]

    def versus(self, a: str, b: str) -> dict[str, Any]:
        common = sorted(set(self.used(a)) & set(self.used(b)))
        pairs = [self.samples[a][i] / self.samples[b][i] for i in common]
        return {
            "rounds": [i + 1 for i in common],
            "pairwise": pairs,
            "median_pairwise": statistics.median(pairs),
            "ratio_of_medians": statistics.median(self.values(a)) / statistics.median(self.values(b)),
            "summary": summary(pairs),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="a smaller model")
    ap.add_argument("--rounds", type=int, default=4, help="rounds over every configuration")
    ap.add_argument("--contender-rounds", type=int, default=8, help="further rounds over the contenders")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import whichdevice

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    config = LlamaConfig(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in base.parameters())
    generator = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(3, shape["vocab_size"], (BATCH, PROMPT), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    result: dict[str, Any] = {
        "model": {"architecture": "LlamaForCausalLM", **shape, "parameters": params},
        "workload": {"batch": BATCH, "prompt_tokens": PROMPT, "new_tokens": NEW_TOKENS, "do_sample": False},
        "tokens_per_second": "batch * new_tokens / wall time of model.generate (prefill included)",
        "rounds": args.rounds,
        "contender_rounds": args.contender_rounds,
        "disturbed_below": DISTURBED,
        "contender_within": CONTENDER,
        "torch_threads": torch.get_num_threads(),
        "checkpoints": {},
    }
    log(f"  model: {params / 1e6:.1f}M parameters, torch threads {torch.get_num_threads()}")

    def generate(model: Any, new_tokens: int = NEW_TOKENS) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
            seconds = time.perf_counter() - start
        if out.shape != (BATCH, PROMPT + new_tokens):
            raise RuntimeError(f"generate returned shape {tuple(out.shape)}")
        return BATCH * new_tokens / seconds

    with tempfile.TemporaryDirectory(prefix="whichdevice-bench-") as tmp:
        for ckpt_dtype in CHECKPOINTS:
            path = Path(tmp) / f"llama-{SHORT[ckpt_dtype]}"
            model = copy.deepcopy(base).to(getattr(torch, ckpt_dtype))
            model.generation_config.pad_token_id = 0
            model.save_pretrained(path)
            del model
            saved = json.loads((path / "config.json").read_text()).get("dtype")
            log(f"  checkpoint {path.name} (config dtype {saved})")

            start = time.perf_counter()
            res = whichdevice.resolve_device(model=str(path))
            resolve_s = time.perf_counter() - start
            plans: dict[str, dict[str, Any]] = {"resolved": res.model_kwargs(), "default": {}}
            for dt in SWEEP_DTYPES:
                for attn in SWEEP_ATTN:
                    plans[f"{SHORT[dt]}/{attn}"] = {"dtype": getattr(torch, dt), "attn_implementation": attn}

            def load(label: str, path: Path = path, plans: dict[str, dict[str, Any]] = plans, res: Any = res) -> Any:
                model = AutoModelForCausalLM.from_pretrained(path, **plans[label]).eval()
                if label == "resolved" and res.tuning is not None and res.tuning.decode_attention:
                    # The keywords name sdpa; prepare() installs the decode attention chosen (only it here).
                    from whichdevice.tuning.decode_attention import install_decode_attention

                    install_decode_attention(model)
                return model

            def timed(label: str, load: Callable[[str], Any] = load) -> float:
                m = load(label)
                tps = generate(m)
                del m
                gc.collect()
                return tps

            entries: dict[str, dict[str, Any]] = {}
            for label, kwargs in plans.items():  # 1. warm-up round
                start = time.perf_counter()
                m = load(label)
                load_s = time.perf_counter() - start
                loaded_dtype = str(m.dtype).removeprefix("torch.")
                attn_impl = m.config._attn_implementation
                start = time.perf_counter()
                generate(m, new_tokens=4)
                warm_s = time.perf_counter() - start
                del m
                gc.collect()
                entries[label] = {
                    "kwargs": {k: str(v) for k, v in kwargs.items()},
                    "dtype": loaded_dtype,
                    "attn_implementation": attn_impl,
                    "config": f"{SHORT.get(loaded_dtype, loaded_dtype)}/{attn_impl}",
                    "load_s": load_s,
                    "warmup_s": warm_s,
                }
                log(f"    {label:<10} -> {loaded_dtype}/{attn_impl} ({load_s:.1f}s load, {warm_s:.1f}s warm-up)")

            labels = list(plans)
            rounds = Rounds()
            for _ in range(args.rounds):  # 2. every configuration
                rounds.run("all", labels, timed)
            reruns = 0
            while reruns < EXTRA_ROUNDS and len(rounds.kinds) - len(rounds.disturbed()) < args.rounds:
                log(f"    rounds {sorted(i + 1 for i in rounds.disturbed())} disturbed: one more round")
                rounds.run("all", labels, timed)
                reruns += 1
            medians = {lab: statistics.median(rounds.values(lab)) for lab in labels}
            top = max(medians[lab] for lab in labels if lab not in ("resolved", "default"))
            contenders = [lab for lab in labels if lab == "resolved" or medians[lab] >= CONTENDER * top]
            for _ in range(args.contender_rounds):  # 3. the contenders
                rounds.run("contenders", contenders, timed)

            disturbed = rounds.disturbed()
            for lab, e in entries.items():
                e["tokens_per_s_all"] = {str(i + 1): v for i, v in sorted(rounds.samples[lab].items())}
                e["rounds_used"] = [i + 1 for i in rounds.used(lab)]
                e["tokens_per_s"] = rounds.values(lab)
                e["summary"] = summary(e["tokens_per_s"])
            sweep = [lab for lab in labels if lab not in ("resolved", "default")]
            best = max(sweep, key=lambda lab: entries[lab]["summary"]["median"])
            same = next((lab for lab in sweep if entries[lab]["config"] == entries["resolved"]["config"]), None)
            result["checkpoints"][ckpt_dtype] = {
                "path_name": path.name,
                "config_dtype": saved,
                "resolve_device_s": resolve_s,
                "resolution": {
                    "device": res.device,
                    "dtype": res.dtype_name,
                    "attn_implementation": res.attn_implementation,
                    "device_map": res.device_map,
                },
                "round_kinds": rounds.kinds,
                "rounds_disturbed": sorted(i + 1 for i in disturbed),
                "contenders": contenders,
                "configs": entries,
                "best": best,
                "resolved_vs_best": rounds.versus("resolved", best),
                "resolved_vs_default": rounds.versus("resolved", "default"),
                # the same dtype/attention loaded by the sweep: 1.00 but for noise
                "resolved_vs_same_config": rounds.versus("resolved", same) if same else None,
                "same_config": same,
            }

    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
