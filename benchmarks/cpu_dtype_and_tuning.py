"""On a CPU, does the resolved load (dtype, attention, tuning) run fastest, every time, and what does tuning cost?

    python benchmarks/cpu_dtype_and_tuning.py sweep [--quick]           # a 106M Llama, every load; ~7 min (--quick ~3)
    python benchmarks/cpu_dtype_and_tuning.py calibrated [--kinds native --budget 60 --quick --rounds 1]  # ~10 min
    python benchmarks/cpu_dtype_and_tuning.py overhead [--rounds 15 --hidden 2048 --layers 16]          # ~2 min
    python benchmarks/cpu_dtype_and_tuning.py seq2seq [--rounds 6]                                      # ~3 min
    python benchmarks/cpu_dtype_and_tuning.py repeat MODEL_DIR ... [--runs 10 --load 2]                 # ~1 min a run
    python benchmarks/cpu_dtype_and_tuning.py packing-clock CKPT ... --runs 4 --log clock.jsonl         # record, replay
    python benchmarks/cpu_dtype_and_tuning.py packing-clock --replay results-27/packing_clock_20_runs.jsonl

One subcommand per part of the question; each prints the machine line first and takes ``--json PATH``.
Real model sizes (0.1-1.1B, and the bandwidth limit) are ``real_sizes.py``'s.

- ``sweep`` (run.py's row 6; ``cost_of_asking.py`` runs it as its ``quality`` section): a Llama of hidden
  768, 8 layers, 12 heads (106M; ``--quick``: hidden 256, 2 layers) saved as fp16, bf16 and fp32
  checkpoints, each loaded as resolved (``resolve_device(model=path).model_kwargs()``, the decode
  attention installed as ``prepare`` does), as transformers' default, and as every dtype x {sdpa,
  eager}; tokens/s of greedy ``generate`` (batch 4 x 128 prompt tokens, 32 new). A warm-up round,
  ``--rounds`` over every load (each loaded afresh, timed once and freed, alternated), then
  ``--contender-rounds`` over the resolved load and those at 0.8x the fastest or better. A round where
  a load ran under 0.6x its best is disturbed (other work stole a core) and left out where 2 clean
  rounds remain; disturbed all-load rounds are re-run, at most 3 times. Ratios are medians of
  per-round ratios.
- ``calibrated`` (issue 17): per kind of CPU (``native``; ``emulated``: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``),
  a child with an empty calibration cache times the calibration (first and cached call), then for a
  Llama of hidden 512, 4 layers, vocabulary 8,000 saved as fp32, bf16 and fp16, at batch 1, 2 and 4,
  the resolved load (``max_length=160``) against every dtype x {sdpa, eager, whichdevice_sdpa}: 128
  prompt + 32 new tokens, loads over 8x slower than the fastest in a 2-token warm-up shown and not
  timed further, ``--rounds`` rounds over all, then contenders until ``--budget`` s per kind.
- ``overhead``: a decode step with the packed layers' checks (batch 4) and through the one-row wrapper
  (batch 1), each against the same step of the same model without them, in alternated rounds; and
  the sampled fingerprints' share of the checks (every packed layer's read, per step).
- ``seq2seq``: greedy ``generate`` of a 0.5B T5 (bf16, batch 1, 32 + 24 tokens) with and without the
  single-row hook, alternated, asserting the same tokens.
- ``repeat`` (issue 27): ``--runs`` fresh processes, each with an empty calibration cache, resolve the
  given models at batch 1 and 4 (max_length 64, and 1024 at batch 4); ``--load N`` keeps N spinning
  processes beside them. Prints how many runs agree on each decision.
- ``packing-clock``: per-weight packing times of fresh fp32 loads, replayed through the packing
  clock's stop rule as built and the two before it against a budget (default the 1.1B batch-4 job's
  3.07 s, scaled by the copy's size); per run, the job's time as a fraction of the best of unpacked
  and packed whole.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
from harness import log, short, summary

# ------------------------------------------------------------------------------------- sweep (row 6)

SWEEP_SHAPE = {
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
SWEEP_QUICK = {**SWEEP_SHAPE, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
SWEEP_QUICK |= {"num_key_value_heads": 4, "intermediate_size": 688}
BATCH, PROMPT, NEW_TOKENS = 4, 128, 32
DISTURBED = 0.6  # a run at under 0.6x the configuration's best marks its round disturbed
EXTRA_ROUNDS = 3  # at most this many re-runs of disturbed all-configuration rounds, per checkpoint
CONTENDER = 0.8  # configurations at 0.8x the fastest median or better get the contender rounds


class Rounds:
    """tokens/s per configuration per round, which rounds are disturbed, and ratios over the clean ones."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[int, float]] = {}
        self.kinds: list[str] = []

    def run(self, kind: str, labels: list[str], timed: Callable[[str], float]) -> None:
        index = len(self.kinds)
        self.kinds.append(kind)
        for label in harness.round_order(labels, index):
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


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import whichdevice

    harness.quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SWEEP_QUICK if args.quick else SWEEP_SHAPE
    base = harness.build_model(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    params = sum(p.numel() for p in base.parameters())
    input_ids = torch.randint(3, shape["vocab_size"], (BATCH, PROMPT), generator=torch.Generator().manual_seed(1234))
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

    def tokens_per_s(model: Any, new: int = NEW_TOKENS) -> float:
        seconds, out = harness.generate(model, input_ids, new)
        if out.shape != (BATCH, PROMPT + new):
            raise RuntimeError(f"generate returned shape {tuple(out.shape)}")
        return BATCH * new / seconds

    with tempfile.TemporaryDirectory(prefix="whichdevice-bench-") as tmp:
        for ckpt in ("float16", "bfloat16", "float32"):
            path = Path(tmp) / f"llama-{short(ckpt)}"
            model = copy.deepcopy(base).to(getattr(torch, ckpt))
            model.generation_config.pad_token_id = 0
            model.save_pretrained(path)
            del model
            saved = json.loads((path / "config.json").read_text()).get("dtype")
            log(f"  checkpoint {path.name} (config dtype {saved})")
            start = time.perf_counter()
            res = whichdevice.resolve_device(model=str(path))
            resolve_s = time.perf_counter() - start
            plans: dict[str, dict[str, Any]] = {"resolved": res.model_kwargs(), "default": {}}
            for dt in ("float32", "bfloat16", "float16"):
                for attn in ("sdpa", "eager"):
                    plans[f"{short(dt)}/{attn}"] = {"dtype": getattr(torch, dt), "attn_implementation": attn}

            def load(label: str, path: Path = path, plans: dict[str, Any] = plans, res: Any = res) -> Any:
                model = AutoModelForCausalLM.from_pretrained(path, **plans[label]).eval()
                if label == "resolved" and res.tuning is not None and res.tuning.decode_attention:
                    # The keywords name sdpa; prepare() installs the decode attention chosen (only it here).
                    from whichdevice.tuning.decode_attention import install_decode_attention

                    install_decode_attention(model)
                return model

            def timed(label: str, load: Callable[[str], Any] = load) -> float:
                m = load(label)
                tps = tokens_per_s(m)
                del m
                gc.collect()
                return tps

            entries: dict[str, dict[str, Any]] = {}
            for label, kwargs in plans.items():  # 1. the warm-up round
                start = time.perf_counter()
                m = load(label)
                load_s = time.perf_counter() - start
                loaded, attn_impl = str(m.dtype).removeprefix("torch."), m.config._attn_implementation
                start = time.perf_counter()
                tokens_per_s(m, new=4)
                warm_s = time.perf_counter() - start
                del m
                gc.collect()
                entries[label] = {
                    "kwargs": {k: str(v) for k, v in kwargs.items()},
                    "dtype": loaded,
                    "attn_implementation": attn_impl,
                    "config": f"{short(loaded)}/{attn_impl}",
                    "load_s": load_s,
                    "warmup_s": warm_s,
                }
                log(f"    {label:<10} -> {loaded}/{attn_impl} ({load_s:.1f}s load, {warm_s:.1f}s warm-up)")
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
            for lab, e in entries.items():
                e["tokens_per_s_all"] = {str(i + 1): v for i, v in sorted(rounds.samples[lab].items())}
                e["rounds_used"] = [i + 1 for i in rounds.used(lab)]
                e["tokens_per_s"] = rounds.values(lab)
                e["summary"] = summary(e["tokens_per_s"])
            sweep = [lab for lab in labels if lab not in ("resolved", "default")]
            best = max(sweep, key=lambda lab: entries[lab]["summary"]["median"])
            same = next((lab for lab in sweep if entries[lab]["config"] == entries["resolved"]["config"]), None)
            result["checkpoints"][ckpt] = {
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
                "rounds_disturbed": sorted(i + 1 for i in rounds.disturbed()),
                "contenders": contenders,
                "configs": entries,
                "best": best,
                "resolved_vs_best": rounds.versus("resolved", best),
                "resolved_vs_default": rounds.versus("resolved", "default"),
                # the same dtype/attention loaded by the sweep: 1.00 but for noise
                "resolved_vs_same_config": rounds.versus("resolved", same) if same else None,
                "same_config": same,
            }
    print(sweep_table(result))
    return result


def sweep_table(q: dict[str, Any]) -> str:
    """tokens/s per load and checkpoint, and how the rounds went (printed by ``cost_of_asking.py`` too)."""
    ckpts = list(q["checkpoints"])
    labels = list(q["checkpoints"][ckpts[0]]["configs"])
    body = []
    for lab in labels:
        cells = [lab]
        for c in ckpts:
            e = q["checkpoints"][c]["configs"][lab]
            s = e["summary"]
            name = f" = {e['config']}" if lab in ("resolved", "default") else ""
            star = " *" if q["checkpoints"][c]["best"] == lab else ""
            cells.append(f"{s['median']:.1f} ({s['p25']:.1f}..{s['p75']:.1f}){name}{star}")
        body.append(cells)
    lines = [harness.table(["tokens/s (median, p25..p75)"] + [f"{short(c)} checkpoint" for c in ckpts], body)]
    for c in ckpts:
        k = q["checkpoints"][c]
        n_all = k["round_kinds"].count("all")
        lines.append(
            f"{short(c)} checkpoint: {n_all} rounds over all 8, then {len(k['round_kinds']) - n_all} over "
            f"{', '.join(k['contenders'])}; disturbed rounds (left out where 2 clean remain): "
            f"{k['rounds_disturbed'] or 'none'}"
        )
        v = k.get("resolved_vs_same_config")
        if v:
            lines.append(
                f"{short(c)} checkpoint: resolved / {k['same_config']} of the sweep (same settings, so 1.00 but for "
                f"noise): {v['median_pairwise']:.3f}x ({v['summary']['p25']:.3f}..{v['summary']['p75']:.3f})"
            )
    m, w = q["model"], q["workload"]
    lines.append(
        f"model: Llama {m['parameters'] / 1e6:.0f}M (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads, intermediate {m['intermediate_size']}, vocab {m['vocab_size']}); "
        f"batch {w['batch']} x {w['prompt_tokens']} prompt tokens, {w['new_tokens']} new tokens greedy; "
        f"a warm-up round, then timed rounds, each model loaded afresh per round; "
        f"torch threads {q['torch_threads']}; * = best of the sweep"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- calibrated (issue 17)

CALIBRATED_SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1376,
    "vocab_size": 8000,
    "max_position_embeddings": 1024,
}
CALIBRATED_QUICK = {**CALIBRATED_SHAPE, "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 344}
CALIBRATED_QUICK["vocab_size"] = 1000
CAL_PROMPT, CAL_NEW, CAL_BATCHES = 128, 32, (1, 2, 4)
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("sdpa", "eager", "whichdevice_sdpa")
KINDS = {"native": {}, "emulated": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
HOPELESS = 8.0


def calibration_cost(cache: Path) -> dict[str, Any]:
    from whichdevice.measure import calibration

    os.environ[calibration.ENV_CALIBRATION] = str(cache)
    start = time.perf_counter()
    calib, why = calibration.calibration()
    first = time.perf_counter() - start
    calibration._answers.clear()
    start = time.perf_counter()
    again, why_cached = calibration.calibration()
    cached = time.perf_counter() - start
    return {
        "first_call_s": round(first, 3),
        "cached_call_s": round(cached, 5),
        "used": calib is not None,
        "why": why,
        "why_cached": why_cached,
        "figures": (calib or again).to_dict() if (calib or again) else None,
    }


def calibrated_child(args: argparse.Namespace) -> None:
    """One kind of CPU: prints a JSON line for the calibration, then one per cell as it is done."""
    import torch
    from transformers import AutoModelForCausalLM

    import whichdevice
    from whichdevice.attention.decode import ensure_registered

    harness.quiet_transformers()
    cost = calibration_cost(Path(args.cache))
    log(
        f"[{args.child}] calibration: first call {cost['first_call_s']} s, "
        f"cached {cost['cached_call_s']} s; {cost['why']}"
    )
    ensure_registered()
    print(json.dumps({"calibration": cost}), flush=True)
    shape = CALIBRATED_QUICK if args.quick else CALIBRATED_SHAPE
    checkpoints = args.checkpoints.split(",")
    deadline = time.perf_counter() + args.budget
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="whichdevice-cpu-dtype-") as tmp:
        paths = {}
        for dt in DTYPES:
            paths[dt] = harness.save_model(
                Path(tmp) / short(dt), dt, **shape, pad_token_id=0, bos_token_id=1, eos_token_id=2
            )
        for ckpt in checkpoints:
            for batch in CAL_BATCHES:
                left = len(checkpoints) * len(CAL_BATCHES) - len(cells)
                cell_budget = max(deadline - time.perf_counter(), 0) / left
                c = time_cell(
                    torch, AutoModelForCausalLM, whichdevice, paths[ckpt], ckpt, batch, cell_budget, args.rounds
                )
                cells.append(c)
                print(json.dumps({"cell": c}), flush=True)
                log(
                    f"[{args.child}] {short(ckpt)} checkpoint, batch {batch}: resolved {c['resolved']} "
                    f"{c['resolved_over_best']:.2f}x best ({c['best']}), {c['rounds']} rounds"
                )
    print(json.dumps({"torch_threads": torch.get_num_threads()}), flush=True)


def time_cell(
    torch: Any, auto: Any, wd: Any, path: Path, ckpt: str, batch: int, budget: float, min_rounds: int
) -> dict[str, Any]:
    stop = time.perf_counter() + budget
    res = wd.resolve_device(model=str(path), batch_size=batch, max_length=CAL_PROMPT + CAL_NEW)
    plans: dict[str, dict[str, Any]] = {"resolved": res.model_kwargs()}
    for dt in DTYPES:
        for attn in ATTENTION:
            plans[f"{short(dt)}/{attn}"] = {"dtype": getattr(torch, dt), "attn_implementation": attn}
    models = {label: auto.from_pretrained(path, **kwargs).eval() for label, kwargs in plans.items()}
    if res.tuning is not None and res.tuning.decode_attention:
        # The keywords name sdpa; prepare() installs the decode attention the resolver chose (only it here).
        from whichdevice.tuning.decode_attention import install_decode_attention

        install_decode_attention(models["resolved"])
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, models["resolved"].config.vocab_size, (batch, CAL_PROMPT), generator=generator)

    def run(label: str, new: int = CAL_NEW) -> float:
        return batch * new / harness.time_generate(models[label], ids, new)

    warm = {label: run(label, 2) for label in models}
    # Not timed at full length: an emulated fp16 generate can take a minute. Its warm-up speed is shown.
    fastest = max(v for lb, v in warm.items() if lb != "resolved")
    out = [lb for lb in models if lb != "resolved" and warm[lb] * HOPELESS < fastest]
    live = [lb for lb in models if lb not in out]
    samples: dict[str, list[float]] = {label: [] for label in live}
    rounds = 0
    while rounds < min_rounds or time.perf_counter() < stop:
        for label in harness.round_order(live, rounds):
            samples[label].append(run(label))
        rounds += 1
        if rounds >= min_rounds:
            medians = {lb: statistics.median(samples[lb]) for lb in live}
            top = max(v for lb, v in medians.items() if lb != "resolved")
            live = [lb for lb in live if lb == "resolved" or medians[lb] >= CONTENDER * top]
        if rounds >= 3 * min_rounds:
            break
    models.clear()
    medians = {lb: statistics.median(s) for lb, s in samples.items()}
    best = max((lb for lb in medians if lb != "resolved"), key=lambda lb: medians[lb])
    # Pairwise ratios over the rounds both ran (the resolved configuration runs in every round).
    n = min(len(samples["resolved"]), len(samples[best]))
    ratio = harness.pairwise(samples["resolved"][-n:], samples[best][-n:])["median"]
    kwargs = plans["resolved"]
    dtype = short(str(kwargs.get("dtype")).removeprefix("torch.")) if "dtype" in kwargs else "default"
    return {
        "checkpoint": ckpt,
        "batch": batch,
        "resolved": f"{dtype}/{kwargs.get('attn_implementation', 'sdpa*')}",
        "resolved_trace": [s.message for s in res.trace if s.topic in ("calibration", "dtype", "attention")],
        "best": best,
        "resolved_over_best": round(ratio, 3),
        "medians_tok_s": {lb: round(v, 1) for lb, v in medians.items()},
        "samples": {lb: [round(v, 2) for v in s] for lb, s in samples.items()},
        "rounds": rounds,
        "left_out_after_warm_up": {lb: round(warm[lb], 2) for lb in out},
    }


def calibrated_table(result: dict[str, Any]) -> str:
    cal = result["calibration"]
    rows = []
    for c in result["cells"]:
        m = c["medians_tok_s"]
        verdict = "PASS" if c["resolved_over_best"] >= 0.95 else "FAIL"
        rows.append(
            [short(c["checkpoint"]), c["batch"], c["resolved"], m["resolved"], c["best"], m[c["best"]],
             f"{c['resolved_over_best']:.2f} {verdict}", c["rounds"]]
        )  # fmt: skip
    head = ["checkpoint", "batch", "resolved", "tok/s", "best", "tok/s", "resolved / best", "rounds"]
    used = "used" if cal["used"] else "not used: " + cal["why"]
    return (
        f"## {result['kind']} ({result['torch_threads']} threads); calibration first call {cal['first_call_s']} s, "
        f"cached {cal['cached_call_s'] * 1000:.1f} ms; {used}\n\n" + harness.table(head, rows, markdown=True)
    )


def calibrated(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    shape = CALIBRATED_QUICK if args.quick else CALIBRATED_SHAPE
    document: dict[str, Any] = {"shape": shape, "prompt": CAL_PROMPT, "new": CAL_NEW, "kinds": results}
    for kind in args.kinds.split(","):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WHICHDEVICE_", "ONEDNN_"))}
        env.update(KINDS[kind], HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        load = harness.load_average()
        result: dict[str, Any] = {"kind": kind, "cells": [], "torch_threads": None}
        results.append(result)
        with tempfile.TemporaryDirectory(prefix="whichdevice-calibration-") as cache:
            cmd = [
                sys.executable,
                __file__,
                "calibrated",
                "--child",
                kind,
                "--cache",
                cache,
                "--budget",
                str(args.budget),
            ]
            cmd += ["--rounds", str(args.rounds), "--checkpoints", args.checkpoints] + ["--quick"] * args.quick
            # Cells stream in as they are done, and the JSON is rewritten after each: an interrupted run
            # keeps what it measured.
            with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
                assert proc.stdout is not None
                try:
                    for line in proc.stdout:
                        if not line.startswith("{"):  # deepspeed, where installed, logs to stdout on import
                            continue
                        item = json.loads(line)
                        if "cell" in item:
                            result["cells"].append(item["cell"])
                        else:
                            result.update(item)
                        harness.write_json(args.json, {"machine": args.machine, "calibrated": document})
                except KeyboardInterrupt:
                    proc.terminate()
                    result["interrupted"] = True
            if "calibration" not in result:
                raise SystemExit(f"{kind}: the child failed before calibrating")
        result["load_average_before_after"] = [load, harness.load_average()]
        print(
            calibrated_table(result)
            + f"\n\nload average (1 min) before/after: {load:.2f} / {harness.load_average():.2f}\n"
        )
    worst = min((c["resolved_over_best"] for r in results for c in r["cells"]), default=float("nan"))
    print(f"worst resolved / best: {worst:.2f} (target >= 0.95)")
    return document


# ------------------------------------------------------------------------------------- overhead


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """What the tuning's guarantees cost per decode step: the packed layers' checks and the one-row wrapper.

    Each against the same step without the guarantee: the same packed layers of the same model calling
    oneDNN's op directly, with no check that the copy still holds the weight (the same packed copies in
    the same memory: two models' copies differed by up to 7% here from where their memory landed), and
    the forward with oneDNN switched off by hand, no wrapper or process-wide count.
    """
    import torch

    from whichdevice.tuning import packed_weights
    from whichdevice.tuning.packed_weights import _ATTRIBUTE, install_packed_weights
    from whichdevice.tuning.single_row import install_single_row

    shape = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
                 num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                 vocab_size=32000)  # fmt: skip
    model = harness.build_model(**shape)
    packed_weights.PROBE_MIN_S = float("inf")  # pack whole, whatever the machine's speed
    layers = install_packed_weights(model, "float32", 4)[0]
    checked, unchecked = {}, {}
    for module in model.modules():
        packed = vars(module).get(_ATTRIBUTE)
        if packed is not None:
            checked[module] = vars(module)["forward"]
            unchecked[module] = lambda x, p=packed, b=module.bias: p.linear(x, p.tensor, b)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"Llama hidden {args.hidden}, {args.layers} layers ({params:.0f}M parameters), fp32, {layers} packed layers")

    def step(model: Any, batch: int) -> float:
        ids = torch.randint(3, 1000, (batch, 1), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        return time.perf_counter() - start

    def best_of_5(run: Callable[[], float]) -> Callable[[], float]:
        def best() -> float:
            run()  # warm
            return min(run() for _ in range(5))

        return best

    def with_forwards(forwards: dict[Any, Any]) -> float:
        for module, forward in forwards.items():
            module.forward = forward
        return step(model, 4)

    runs = {"checked": best_of_5(lambda: with_forwards(checked)), "bare": best_of_5(lambda: with_forwards(unchecked))}
    batch4 = {name: statistics.median(t) for name, t in harness.alternate(runs, args.rounds).items()}
    with_forwards(checked)
    print(
        f"batch 4, packed: {batch4['checked'] * 1e3:.2f} ms a step with the checks, {batch4['bare'] * 1e3:.2f} ms "
        f"without: {batch4['checked'] / batch4['bare']:.3f}x"
    )
    fingerprints = [vars(m)[_ATTRIBUTE].fingerprint for m in checked]

    def read_fingerprints() -> float:
        start = time.perf_counter()
        for _ in range(100):
            for fingerprint in fingerprints:
                fingerprint.unchanged()
        return (time.perf_counter() - start) / 100

    fingerprint_s = statistics.median(min(read_fingerprints() for _ in range(3)) for _ in range(args.rounds))
    print(
        f"of which the sampled fingerprints ({len(fingerprints)} layers): {fingerprint_s * 1e6:.0f} us a step, "
        f"{fingerprint_s / batch4['bare']:.1%} of the bare step"
    )
    wrapped = harness.build_model(seed=1, **shape)
    plain = harness.build_model(seed=1, **shape)
    plain.load_state_dict(wrapped.state_dict())
    install_single_row(wrapped)
    switch: Any = torch.backends.mkldnn

    def by_hand() -> float:
        switch.enabled = False
        try:
            return step(plain, 1)
        finally:
            switch.enabled = True

    runs = {"wrapped": best_of_5(lambda: step(wrapped, 1)), "by hand": best_of_5(by_hand)}
    batch1 = {name: statistics.median(t) for name, t in harness.alternate(runs, args.rounds).items()}
    print(
        f"batch 1, oneDNN off: {batch1['wrapped'] * 1e3:.2f} ms a step through the wrapper, "
        f"{batch1['by hand'] * 1e3:.2f} ms switched by hand: {batch1['wrapped'] / batch1['by hand']:.3f}x"
    )
    return {
        "shape": shape,
        "packed_layers": layers,
        "batch4_s": batch4,
        "batch1_s": batch1,
        "fingerprint_s": fingerprint_s,
    }


# ------------------------------------------------------------------------------------- seq2seq


T5 = dict(d_model=1024, d_ff=4096, d_kv=64, num_layers=12, num_heads=16, vocab_size=32128,
          decoder_start_token_id=0, feed_forward_proj="gated-gelu")  # fmt: skip


def seq2seq(args: argparse.Namespace) -> dict[str, Any]:
    """The single-row hook on an encoder-decoder: generate runs a T5's encoder once; each decode step's
    forward gets the encoder's outputs and one decoder row, which the hook counts."""
    import torch

    from whichdevice.tuning.single_row import install_single_row

    harness.quiet_transformers()
    # About 0.5B parameters in bf16: larger than the CPU's caches, so the weights stream from memory.
    plain = harness.build_model("T5Config", auto="AutoModelForSeq2SeqLM", **T5).to(torch.bfloat16)
    hooked = harness.build_model("T5Config", auto="AutoModelForSeq2SeqLM", **T5).to(torch.bfloat16)
    hooked.load_state_dict(plain.state_dict())
    install_single_row(hooked)
    count = sum(p.numel() for p in plain.parameters())
    print(f"T5: {count / 1e6:.0f}M parameters, {count * 2 / 1e9:.2f} GB in bf16, torch {torch.__version__}")
    ids = torch.randint(3, 32000, (1, 32), generator=torch.Generator().manual_seed(0))
    for model in (plain, hooked):
        harness.generate(model, ids, 2, mask=False)  # oneDNN builds its kernels on the first call
    outputs: dict[str, Any] = {}

    def run(name: str, model: Any) -> Callable[[], float]:
        def timed() -> float:
            seconds, outputs[name] = harness.generate(model, ids, args.new, mask=False)
            return seconds

        return timed

    def check(msg: str) -> None:
        assert torch.equal(outputs["plain"], outputs["hooked"]), "the hooked model generated other tokens"
        print(msg)

    times = harness.alternate({"plain": run("plain", plain), "hooked": run("hooked", hooked)}, args.rounds, check)
    over = harness.pairwise(times["plain"], times["hooked"])
    print(
        f"hooked over plain: {over['median']:.2f}x (median of {len(over['ratios'])} rounds; "
        f"{over['min']:.2f}-{over['max']:.2f})"
    )
    return {"seconds": times, "hooked_over_plain": over}


# ------------------------------------------------------------------------------------- repeat


def repeat_child(models: list[str]) -> None:
    import whichdevice as wd

    start = time.perf_counter()
    cells: dict[str, Any] = {}
    calibration = ""
    for model in models:
        # A long batch-4 job too: packed weights pay only over enough new tokens.
        for batch, length in ((1, 64), (4, 64), (4, 1024)):
            res = wd.resolve_device(model=model, batch_size=batch, max_length=length)
            tuning = res.tuning
            label = f"{res.dtype_name}/{res.attn_implementation}" + (
                "+single_row" if tuning and tuning.single_row else ""
            )
            cells[f"{os.path.basename(model)} b{batch} x{length}"] = label + (
                "+packed" if tuning and tuning.packed_for_batch else ""
            )
            calibration = next(s.message for s in res.trace if s.topic == "calibration")
    out = {"cells": cells, "calibration": calibration[:300], "seconds": round(time.perf_counter() - start, 2)}
    print(json.dumps({**out, "load": harness.load_average()}))


def repeat(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    with harness.spinning(args.load):
        if args.load:
            time.sleep(30)  # let the 1-minute load average climb towards the load asked for
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="whichdevice-repeat-") as cache:
                env = {**os.environ, "WHICHDEVICE_CALIBRATION": cache}
                cmd = [sys.executable, __file__, "repeat", *args.models, "--child"]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(row)
            print(f"run {i + 1}: load {row['load']:.2f}, {row['seconds']} s: {row['cells']}", flush=True)
            print(f"    calibration: {row['calibration']}", flush=True)
    print(f"\nagreement over {len(runs)} fresh calibrations at --load {args.load}:")
    for cell in runs[0]["cells"]:
        counts = collections.Counter(r["cells"][cell] for r in runs)
        decision, n = counts.most_common(1)[0]
        others = ", ".join(f"{d} x{c}" for d, c in counts.items() if d != decision)
        print(f"  {cell:24} {n}/{len(runs)} {decision}" + (f" (others: {others})" if others else ""))
    unsteady = sum("could not be timed steadily" in r["calibration"] for r in runs)
    print(f"  calibrations not steady (the CPU's flags decided): {unsteady}/{len(runs)}")
    return {"runs": runs, "load": args.load}


# ------------------------------------------------------------------------------------- packing clock

RECORD = """
import json, sys, torch, transformers
transformers.utils.logging.set_verbosity_error()
from whichdevice.tuning import packed_weights as pw
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.randint(3, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    model(ids)
log, add = [], pw._Clock.add
def logged(self, size):
    price = add(self, size)
    log.append([size, pw.time.perf_counter() - self.start])
    return price
pw._Clock.add = logged
pw.install_packed_weights(model, "float32", 4)
shapes = [list(m.weight.shape) for m in pw.packable_layers(model, "float32")]
print(json.dumps({"log": [[s, *row] for s, row in zip(shapes, log)]}))
"""


def record(path: str) -> list[list[Any]]:
    """One fresh process's packing of ``path`` (as fp32, after a batch-4 prompt): [shape, bytes, seconds] per weight."""
    out = subprocess.run([sys.executable, "-c", RECORD, path], capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"recording {path} failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return list(json.loads(lines[-1])["log"])


def built(log: list[list[Any]]) -> list[float | None]:
    """The clock as built: ``packed_weights._Clock`` itself, its clock read from the recorded times."""
    from whichdevice.tuning import packed_weights

    times = iter([0.0] + [row[2] for row in log])
    real = packed_weights.time
    packed_weights.time = types.SimpleNamespace(perf_counter=lambda: next(times))  # type: ignore[assignment]
    try:
        clock = packed_weights._Clock(sum(row[1] for row in log))
        return [clock.add(row[1]) for row in log]
    finally:
        packed_weights.time = real


def per_shape(log: list[list[Any]], share: float = 0.03, spent: bool = False) -> list[float | None]:
    """The rate of weights whose shape was packed before; ``spent``: the time so far plus the rest."""
    size = sum(row[1] for row in log)
    seen: set[tuple[int, ...]] = set()
    steady_b, steady_s, last, done, prices = 0, 0.0, 0.0, 0, []
    for shape, nbytes, t in log:
        if tuple(shape) in seen:
            steady_b, steady_s = steady_b + nbytes, steady_s + t - last
        seen.add(tuple(shape))
        last, done = t, done + nbytes
        if steady_b < share * size or steady_s < 0.05:
            prices.append(None)
        else:
            rate = steady_s / steady_b
            prices.append(t + (size - done) * rate if spent else size * rate)
    return prices


RULES: dict[str, Callable[[list[list[Any]]], list[float | None]]] = {
    "whole copy, 1% after the first weight (built)": built,
    "whole copy, 3% after each shape's first": lambda log: per_shape(log),
    "time so far plus the rest, 3% after each shape's first": lambda log: per_shape(log, spent=True),
}


def packing_clock(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    if args.replay:
        runs = [json.loads(line) for line in args.replay.read_text().splitlines() if line.strip()]
    for path in args.checkpoints:
        for i in range(args.runs):
            run = {"name": f"{Path(path).name} #{i + 1}", "log": record(path)}
            print(f"recorded {run['name']}: {run['log'][-1][2]:.2f} s", flush=True)
            runs.append(run)
            if args.log:
                with args.log.open("a") as f:
                    f.write(json.dumps(run) + "\n")
    replayed: dict[str, list[float]] = {}
    for name, rule in RULES.items():
        print(f"== {name}")
        ratios = replayed[name] = []
        for run in runs:
            log_ = run["log"]
            size = sum(row[1] for row in log_)
            scale = size / args.budget_size
            job, gain, budget, total = args.job_s * scale, args.gain_s * scale, args.budget * scale, log_[-1][2]
            prices = rule(log_)
            stop = next((i for i, p in enumerate(prices) if p is not None and p > budget), None)
            spent, packed = (total, size) if stop is None else (log_[stop][2], sum(row[1] for row in log_[: stop + 1]))
            ratio = min(job, job - gain + total) / (job - gain * packed / size + spent)
            ratios.append(ratio)
            where = "whole" if stop is None else f"stopped at {packed / size:.0%} ({spent:.2f} s)"
            print(f"  {run['name']:<28} packing {total:5.2f} s, budget {budget:5.2f} s: {where:<26} {ratio:.2f}")
        print(f"  lowest {min(ratios):.2f}, mean {sum(ratios) / len(ratios):.3f} of the best")
    return {"runs": [r["name"] for r in runs], "of_the_best": replayed}


# ------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ap.add_subparsers(dest="part", required=True)

    def part(name: str, run: Callable[[argparse.Namespace], dict[str, Any]], text: str) -> argparse.ArgumentParser:
        p = parts.add_parser(name, help=text, description=text)
        p.set_defaults(run=run)
        harness.add_json_argument(p, default=str(harness.RESULTS / f"cpu_{name.replace('-', '_')}.json"))
        return p

    p = part("sweep", sweep, "a 106M Llama's tokens/s: resolved, transformers' default, every dtype x attention")
    p.add_argument("--quick", action="store_true", help="a smaller model")
    p.add_argument("--rounds", type=int, default=4, help="rounds over every configuration")
    p.add_argument("--contender-rounds", type=int, default=8, help="further rounds over the contenders")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p = part("calibrated", calibrated, "the calibrated dtype against every dtype x attention, native and emulated bf16")
    p.add_argument("--kinds", default="native,emulated", help="comma-separated: native, emulated")
    p.add_argument("--budget", type=float, default=240.0, help="seconds of timing per kind (after calibration)")
    p.add_argument("--rounds", type=int, default=5, help="rounds over every configuration (at least)")
    p.add_argument("--checkpoints", default="float32,bfloat16,float16", help="comma-separated checkpoint dtypes")
    p.add_argument("--quick", action="store_true", help="a tiny model, to check the script runs")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    p = part("overhead", overhead, "the packed layers' checks and the one-row wrapper, per decode step")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p = part("seq2seq", seq2seq, "the single-row hook on a 0.5B T5's generate")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--new", type=int, default=24)
    p = part("repeat", repeat, "the same decision from fresh calibrations, quiet and under load")
    p.add_argument("models", nargs="+")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--load", type=int, default=0, help="processes spinning a core each meanwhile")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p = part("packing-clock", packing_clock, "per-weight packing times replayed through the packing clock's stop rules")
    p.add_argument("checkpoints", nargs="*")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--log", type=Path, help="append the recorded runs here (JSON lines)")
    p.add_argument("--replay", type=Path, help="replay the runs recorded in this file instead")
    p.add_argument("--budget", type=float, default=3.07, help="seconds, for a copy of --budget-size bytes")
    p.add_argument("--budget-size", type=float, default=4.13e9)
    p.add_argument("--job-s", type=float, default=6.13, help="the job unpacked, at --budget-size")
    p.add_argument("--gain-s", type=float, default=4.0, help="what the whole copy saves, at --budget-size")
    args = ap.parse_args()
    if args.part == "calibrated" and args.child:
        calibrated_child(args)
        return 0
    if args.part == "repeat" and args.child:
        repeat_child(args.models)
        return 0
    machine = args.machine = harness.machine()
    print(harness.machine_line(machine), flush=True)
    result = args.run(args)
    harness.write_json(args.json, {"machine": machine, "load_average_after": harness.load_average(), args.part: result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
