"""Is the resolved CPU load the fastest for real model sizes, and how near the bandwidth limit? (issue 27)

    python benchmarks/real_sizes.py                                  # 0.1B, 0.4B, 1.1B; native and capped
    python benchmarks/real_sizes.py --sizes 0.1B --kinds native --rounds 2
    python benchmarks/real_sizes.py --kinds native avx2 --batches 1 --prompt 512 --new 16 --split both   # issue 48

For each kind of CPU (``native``: as this machine is; ``capped``: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``,
oneDNN capped below bf16) a child process, with an empty calibration cache, measures the memory read
bandwidth (all torch threads summing 512 MiB, best of 5), then for each Llama size (about 0.1B, 0.4B
and 1.1B parameters, random weights saved as bf16 and as fp32 safetensors) and batch:

1. ``resolve_device(model=path, batch_size=b, max_length=PROMPT + NEW)`` for each checkpoint (with
   ``--split stated`` also ``max_new_tokens=NEW``: the job's length as generate gets it; ``--split
   both`` resolves each checkpoint both ways, each a resolved load of its own in the same rounds), loaded
   exactly as a user does, in a fresh process: ``from_pretrained(path, **res.model_kwargs())`` then
   ``res.prepare(model)``, its setup timed there (as is every candidate's packing, from each
   checkpoint, so each is priced as its own user pays it; each ``--fresh``
   times, the process of median setup kept, since a packing's time varies from one process to the
   next); where that load
   is exactly a candidate's configuration, the resolved load takes the candidate's runs (with its
   own setup), otherwise it is timed on its own load in this process;
2. every dtype (fp32, bf16, fp16) x attention (sdpa, eager, whichdevice_sdpa; ``--attention`` narrows
   it where time is short: the best of those left is then the bar) on one model per dtype
   (``set_attn_implementation`` switches it), bf16 with the single-row GEMV hook at batch 1 and fp32
   and bf16 with packed weights at batch 2 and more (the settings the resolver can hand over; the
   packed copy is switched on and off per run on the same model), and the static KV cache of the
   best of those (a setting transformers offers that the resolver does not choose on a CPU: measured here to show why);
3. interleaved rounds (order reversed every other round) of greedy ``generate`` with NEW new tokens
   and with 1: tokens/s = batch x NEW / time; decode rate = batch x (NEW - 1) / (time(NEW) - time(1)).
   A configuration HOPELESS times slower than the fastest in the warm-up is left out (it cannot be best).

Per cell it prints each configuration's tokens/s for the job (one generate of NEW tokens, with the
configuration's one-time setup, packing its weights, counted against it; also without), the
resolved load's over the best (median of the per-round ratios, setup counted), and each decode
rate as a fraction of the bandwidth limit of the smallest exact dtype (the checkpoint's: batch x
bandwidth / bytes of its weights read per step). The machine is shared: every cell carries
``uptime``. Prints the machine line and the tables, and writes ``--json`` (default
benchmarks/results/real_sizes.json; ``--out`` is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import LLAMA_COMMON as COMMON
from harness import LLAMA_SIZES as SIZES
from harness import SHORT, log, uptime

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("sdpa", "eager", "whichdevice_sdpa")
KINDS = {
    "native": {},
    "capped": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    # oneDNN and ATen's kernels both held to AVX2: an AVX2-only CPU's kernels (torch's bf16 checks still
    # read the CPU's own flags, so what packs is this CPU's).
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
HOPELESS = 3.0
TRACED = ("calibration", "dtype", "attention", "generation")


def bandwidth(torch: Any) -> float:
    """Read GB/s of all torch threads summing a 512 MiB buffer (best of 5)."""
    buffer = torch.ones(128 * 1024**2)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def _packed_states(model: Any) -> list[Any]:
    return [s for m in model.modules() if (s := getattr(m, "_whichdevice_packed", None)) is not None]


class Config:
    """One way to run generate: a loaded model, its attention, generate keywords, and whether the
    model's packed weights (if it has them) serve it."""

    def __init__(
        self,
        label: str,
        model: Any,
        attention: str | None,
        generate: dict[str, Any] | None = None,
        packed: bool | None = None,
        setup_s: float = 0.0,
    ) -> None:
        self.label, self.model, self.attention, self.generate = label, model, attention, generate or {}
        self.packed, self.setup_s = packed, setup_s
        self.saved = {id(s): s.tensor for s in _packed_states(model)}

    def run(self, ids: Any, new: int) -> float:
        if self.attention is not None and self.model.config._attn_implementation != self.attention:
            self.model.set_attn_implementation(self.attention)
        if self.packed is not None:  # a layer whose packed tensor is None runs torch's own linear
            for state in _packed_states(self.model):
                state.tensor = self.saved[id(state)] if self.packed else None
        return harness.time_generate(self.model, ids, new, **self.generate)


def label_of(res: Any) -> str:
    dtype = SHORT.get(res.dtype_name or "", "stored")
    label = f"{dtype}/{res.attn_implementation or 'sdpa'}" + (
        "+single_row" if (res.tuning is not None and res.tuning.single_row) else ""
    )
    label += "+packed" if (res.tuning is not None and res.tuning.packed_for_batch) else ""
    return label + ("+upcast" if (res.tuning is not None and res.tuning.upcast_above) else "")


def setup_in_fresh_process(
    path: Path, load: str, batch: int, max_length: int, max_new_tokens: int | None = None, prompt: int = 1
) -> dict[str, Any]:
    """Load ``path`` in a new process, as a user's job does, and time its one-time setup there.

    ``load`` is a dtype (that dtype, its weights packed for ``batch``) or "resolved" (``resolve_device``
    for the job, ``from_pretrained(**res.model_kwargs())``, ``res.prepare(model)``, and where prepare
    left the packing to generate, the job's generate of ``prompt`` + the rest tokens: the packing it
    makes is setup). Timed here, not
    in the benchmark's own process: there every cell holds a dozen models, and on this VM a page
    fault's system time grew about fivefold once a process held a few GB (packing a 0.4B model's
    fp32 weights: 0.45-0.5 s as the process's first model, 1.7-2.2 s as its third and later), so
    whichever load came later paid more. Also says what the load got: the weights' dtype, the
    attention, packed layers and the single-row hook."""
    code = (
        "import json, sys, time, torch, transformers\n"
        "transformers.utils.logging.set_verbosity_error()\n"
        "from transformers import AutoModelForCausalLM\n"
        "from whichdevice.tuning.packed_weights import install_packed_weights\n"
        "path, load, batch, length = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])\n"
        "prompt = int(sys.argv[6])\n"
        "new = int(sys.argv[5]) if sys.argv[5] != 'None' else None\n"
        "if load == 'resolved':\n"
        "    import whichdevice as wd\n"
        "    res = wd.resolve_device(model=path, batch_size=batch, max_length=length, max_new_tokens=new)\n"
        "    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs()).eval()\n"
        "    start = time.perf_counter(); res.prepare(model)\n"
        "    setup = time.perf_counter() - start\n"
        "    if 'generate' in vars(model):  # packing left to the job's generate call: the packing it makes is setup\n"
        "        from whichdevice.tuning import packed_weights\n"
        "        spent, real = [], packed_weights.install_packed_weights\n"
        "        def timed(*a, **k):\n"
        "            t = time.perf_counter(); out = real(*a, **k); spent.append(time.perf_counter() - t); return out\n"
        "        packed_weights.install_packed_weights = timed\n"
        "        ids = torch.randint(3, 1000, (batch, prompt), generator=torch.Generator().manual_seed(0))\n"
        "        with torch.inference_mode():\n"
        "            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),\n"
        "                max_new_tokens=length - prompt, min_new_tokens=length - prompt, do_sample=False)\n"
        "        setup += sum(spent)\n"
        "else:\n"
        "    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, load)).eval()\n"
        "    start = time.perf_counter(); install_packed_weights(model, load, batch)\n"
        "    setup = time.perf_counter() - start\n"
        "upcast = [vars(m)['_whichdevice_upcast'] for m in model.modules() if '_whichdevice_upcast' in vars(m)]\n"
        "buffers = 0\n"
        "if upcast:  # the fp32 buffers a prompt's forward makes, and keeps for the next\n"
        "    ids = torch.randint(3, 1000, (batch, prompt), generator=torch.Generator().manual_seed(0))\n"
        "    with torch.inference_mode():\n"
        "        model(input_ids=ids)\n"
        "    buffers = sum(t.numel() * 4 for t in upcast[0].pool.free.values())\n"
        "weights = sum(p.numel() * p.element_size() for p in model.parameters())\n"
        "packed = sum(getattr(m, '_whichdevice_packed', None) is not None for m in model.modules())\n"
        "from whichdevice.tuning.packed_weights import packable_layers\n"
        "packable = len(packable_layers(model, str(next(model.parameters()).dtype).split('.')[-1]))\n"
        "print(json.dumps({'setup_s': setup, 'dtype': str(next(model.parameters()).dtype).split('.')[-1],\n"
        "    'attention': model.config._attn_implementation, 'packed_layers': packed, 'packable': packable,\n"
        "    'single_row': 'forward' in vars(model), 'upcast_above': upcast[0].rows if upcast else None,\n"
        "    'buffer_bytes': buffers, 'weight_bytes': weights}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), load, str(batch), str(max_length), str(max_new_tokens), str(prompt)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"setup of {load} {path} failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def pack_first(model: Any, dtype: str, batch: int, count: int) -> None:
    """Pack the first ``count`` packable layers only: the load a packing stopped there left. Only
    those are packed, not the whole copy then undone past them: this process holds every candidate,
    and a whole copy would be refused for want of memory (``HEADROOM``), leaving the load unpacked
    and timed as such (1.1B: a load with 47 of 155 layers packed read 7.77 tokens/s here, as
    unpacked, where it runs 1.26x unpacked's decode)."""
    from whichdevice.tuning import packed_weights

    first = packed_weights.packable_layers(model, dtype)[:count]
    real = packed_weights.packable_layers
    packed_weights.packable_layers = lambda model, dtype: first  # type: ignore[assignment]
    try:
        done, why = packed_weights.install_packed_weights(model, dtype, batch)
    finally:
        packed_weights.packable_layers = real
    if done != count:
        raise SystemExit(f"packing the first {count} layers packed {done}: {why}")


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fresh process of median setup time among ``runs``."""
    return sorted(runs, key=lambda run: float(run["setup_s"]))[len(runs) // 2]


def fresh_label(got: dict[str, Any]) -> str:
    """The configuration a fresh load reported by ``setup_in_fresh_process`` got, as ``label_of`` names
    it: a packing that prepare() stopped (priced past the job's budget) is not in it."""
    label = f"{SHORT.get(got['dtype'], got['dtype'])}/{got['attention']}"
    packed = got["packed_layers"]
    # A packing stopped past its budget keeps the layers packed by then: a load of its own, not the packed twin.
    part = f"+packed({packed}/{got['packable']})" if 0 < packed < got.get("packable", packed) else "+packed"
    upcast = "+upcast" if got.get("upcast_above") else ""
    return label + ("+single_row" if got["single_row"] else "") + (part if packed else "") + upcast


def candidates(torch: Any, auto: Any, path: Path, batch: int, dtypes: list[str], attention: list[str]) -> list[Config]:
    from whichdevice.tuning.packed_weights import install_packed_weights
    from whichdevice.tuning.single_row import install_single_row

    configs = []
    for dtype in dtypes:
        model = auto.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        start = time.perf_counter()
        if batch >= 2 and install_packed_weights(model, dtype, batch)[0]:
            setup = time.perf_counter() - start  # paid once per load: counted against the job below
            configs += [Config(f"{SHORT[dtype]}/{a}+packed", model, a, packed=True, setup_s=setup) for a in attention]
        configs += [Config(f"{SHORT[dtype]}/{a}", model, a, packed=False) for a in attention]
        if dtype == "bfloat16" and batch == 1:
            hooked = auto.from_pretrained(path, dtype=torch.bfloat16).eval()
            install_single_row(hooked)
            configs += [Config(f"bf16/{a}+single_row", hooked, a) for a in attention]
    return configs


def time_configs(
    torch: Any, configs: list[Config], ids: Any, args: argparse.Namespace, keep: set[str] | None = None
) -> dict[str, Any]:
    for config in configs:
        config.run(ids, 2)  # oneDNN builds its kernels on the first call
    warm = {c.label: c.run(ids, args.new) for c in configs}
    fastest = min(warm.values())
    keep = keep or set()
    live = [
        c for c in configs if c.label.startswith("resolved") or c.label in keep or warm[c.label] < HOPELESS * fastest
    ]
    full: dict[str, list[float]] = {c.label: [] for c in live}
    one: dict[str, list[float]] = {c.label: [] for c in live}
    start, r = time.perf_counter(), 0
    # At least --rounds, and more until --min-seconds have passed: a 0.1B model's runs are short and noisy.
    while r < args.rounds or time.perf_counter() - start < args.min_seconds:
        for config in live if r % 2 == 0 else live[::-1]:
            one[config.label].append(config.run(ids, 1))
            full[config.label].append(config.run(ids, args.new))
        r += 1
    return {"full": full, "one": one, "left_out": sorted(set(warm) - set(full))}


def cell(torch: Any, auto: Any, wd: Any, paths: dict[str, Path], batch: int, args: argparse.Namespace) -> list[dict]:
    """Every candidate once, and each checkpoint's resolved load, timed in the same interleaved rounds.

    One-time setups (packing) are timed in fresh processes (``setup_in_fresh_process``). A resolved
    load whose fresh copy is exactly a candidate's configuration (dtype, attention, packing, single-row)
    takes that candidate's runs, with its own setup: the weights are the same values (the fp32
    checkpoint holds the bf16 one's values), a second copy of a 1.1B model in fp32 with its packed
    twin did not fit beside the candidates (the packing then refused, rightly, for want of memory),
    and two copies of one configuration differed by up to 7% here from where their memory landed.
    Its runs are then the candidate's own, not a second slot in the rounds: two slots on one model
    read 10.06 and 8.49 tokens/s in the same rounds here (1.1B, batch 1), which is noise."""
    ids = torch.randint(3, COMMON["vocab_size"], (batch, args.prompt), generator=torch.Generator().manual_seed(0))
    length = args.prompt + args.new
    # max_new_tokens= as resolve_device gets it: NEW where the split is stated, None where it is not
    splits = {"stated": [args.new], "unstated": [None], "both": [None, args.new]}[args.split]
    from whichdevice.measure.cpu_memory import PACKED_DTYPES
    from whichdevice.tuning.single_row import install_single_row

    resolved = {}
    alias: dict[str, tuple[str, float]] = {}  # resolved label: (the candidate it is, its own setup)
    # The fresh processes run before this one loads its candidates: the machine's memory is then as
    # free as a user's (the packing refuses where its copy would take over half the memory available).
    # Each --fresh times, the run of median setup kept: one packing's time is its memory's luck
    # (1.1B fp32, capped: 2.2-6.6 s in fresh processes here), and best and resolved must not draw apart.
    # Timed from each checkpoint: packing an fp32 checkpoint's weights took 1.7 s where the bf16
    # checkpoint's, upcast to fp32 in fresh memory, took 3.6 s (1.1B, capped), so one checkpoint's
    # price would misstate the other's best.
    packing = {  # (checkpoint, dtype): the packing's seconds in a fresh process that loaded it
        (ckpt, d): median_run([setup_in_fresh_process(path, d, batch, length) for _ in range(args.fresh)])["setup_s"]
        for ckpt, path in paths.items()
        for d in args.dtypes
        if batch >= 2 and d in PACKED_DTYPES
    }
    fresh_loads = {}
    for ckpt, path in paths.items():
        for told in splits:
            runs = [
                setup_in_fresh_process(path, "resolved", batch, length, told, args.prompt) for _ in range(args.fresh)
            ]
            fresh_loads[(ckpt, told)] = median_run(runs)
            if len({fresh_label(run) for run in runs}) > 1:
                got = ", ".join(f"{fresh_label(r)} ({r['setup_s']:.2f} s)" for r in runs)
                log(f"{ckpt} {split_name(told)}: fresh loads got {got}")
    configs = candidates(torch, auto, paths["bfloat16"], batch, args.dtypes, args.attention)
    packed_dtype = {  # a packed candidate's label: its dtype
        c.label: next(d for d in DTYPES if c.label.startswith(SHORT[d] + "/")) for c in configs if c.packed
    }
    for config in configs:
        if config.packed:
            config.setup_s = packing[("bfloat16", packed_dtype[config.label])]
    by_label = {c.label: c for c in configs}
    for (ckpt, told), fresh in fresh_loads.items():
        path = paths[ckpt]
        res = wd.resolve_device(model=str(path), batch_size=batch, max_length=length, max_new_tokens=told)
        label = label_of(res)
        if fresh_label(fresh) != label:  # what the user's job got, e.g. a packing prepare() or generate declined
            log(f"{ckpt}: resolved {label}, a fresh load got {fresh_label(fresh)} (setup {fresh['setup_s']:.2f} s)")
            label = fresh_label(fresh)
        resolved[(ckpt, told)] = (res, label)
        twin = by_label.get(label)
        mine = f"resolved {ckpt} {split_name(told)}={label}"
        if twin is not None:
            # The twin's own runs are the resolved load's: timed once, they cannot differ by noise.
            alias[mine] = (twin.label, fresh["setup_s"])
            continue
        model = auto.from_pretrained(path, **res.model_kwargs()).eval()
        # Set up as the fresh load got it: prepare()'s clock would read this process's (slower) faults.
        if fresh["single_row"]:
            install_single_row(model)
        if fresh["packed_layers"] and res.dtype_name:
            pack_first(model, res.dtype_name, batch, fresh["packed_layers"])
        if fresh.get("upcast_above"):
            from whichdevice.tuning.upcast import install_upcast

            install_upcast(model, fresh["upcast_above"])
        # The attention too: prepare() runs the decode attention in place of the sdpa the keywords name.
        configs.append(Config(mine, model, fresh["attention"], setup_s=fresh["setup_s"]))
        # Another resolved load that got the same configuration runs on this one's runs, as on a twin's.
        by_label[label] = configs[-1]
    timed = time_configs(torch, configs, ids, args, keep={twin for twin, _ in alias.values()})
    # A configuration's one-time setup (packing the weights) is paid once per load: the job it runs
    # is one generate of --new tokens, so it counts against that job's time.
    setup = {c.label: c.setup_s for c in configs}
    for mine, (twin_label, seconds) in alias.items():
        for key in ("full", "one"):
            timed[key][mine] = timed[key][twin_label]
        setup[mine] = seconds
    # The static KV cache of the fastest configuration: a setting transformers offers (not chosen on a CPU).
    tok_s = {lb: statistics.median(batch * args.new / (t + setup[lb]) for t in ts) for lb, ts in timed["full"].items()}
    best_plain = max((lb for lb in tok_s if not lb.startswith("resolved")), key=lambda lb: tok_s[lb])
    base = next(c for c in configs if c.label == best_plain)
    static = Config(
        f"{best_plain}+static_cache", base.model, base.attention, {"cache_implementation": "static"}, base.packed
    )
    more = time_configs(torch, [base, static], ids, args)
    configs.clear()
    static_cache: dict[str, Any] = {"of": best_plain, "tok_s_over_dynamic": None}
    if static.label in more["full"]:
        setup[static.label] = setup[best_plain]
        for key in ("full", "one"):
            timed[key][static.label] = more[key][static.label]
        static_over_plain = statistics.median(
            p / s for p, s in zip(more["full"][best_plain], more["full"][static.label], strict=True)
        )
        static_cache["tok_s_over_dynamic"] = round(static_over_plain, 3)
    else:  # over HOPELESS times slower in the warm-up: left out, as any configuration would be
        static_cache["left_out"] = f"over {HOPELESS:g}x slower than the dynamic cache in the warm-up"
    tok_s = {lb: statistics.median(batch * args.new / (t + setup[lb]) for t in ts) for lb, ts in timed["full"].items()}
    steady = {lb: statistics.median(batch * args.new / t for t in ts) for lb, ts in timed["full"].items()}
    decode = {
        lb: statistics.median(
            batch * (args.new - 1) / max(f - o, 1e-9) for f, o in zip(timed["full"][lb], timed["one"][lb], strict=True)
        )
        for lb in timed["full"]
    }
    out = []
    for (ckpt, told), (res, label) in resolved.items():
        mine = f"resolved {ckpt} {split_name(told)}={label}"
        others = [lb for lb in tok_s if not lb.startswith("resolved") and not lb.endswith("static_cache")] + [mine]
        # This checkpoint's own packing prices, as its user pays them (runs are shared: same values).
        own_setup = setup | {lb: packing[(ckpt, d)] for lb, d in packed_dtype.items() if lb in timed["full"]}
        own_tok_s = {
            lb: statistics.median(batch * args.new / (t + own_setup[lb]) for t in timed["full"][lb]) for lb in others
        }
        best = max(others, key=lambda lb: own_tok_s[lb])
        ratios = [
            (b + own_setup[best]) / (m + own_setup[mine])
            for b, m in zip(timed["full"][best], timed["full"][mine], strict=True)
        ]
        mine_s = statistics.median(t + own_setup[mine] for t in timed["full"][mine])
        out.append(
            {
                "checkpoint": ckpt,
                "batch": batch,
                "split": split_name(told),
                "prompt": args.prompt,
                "new": args.new,
                "resolved": label,
                # The estimate's whole job (prompt, steps, packing) beside the measured one (issue 48).
                "predicted_s": predicted_seconds(res, paths[ckpt], batch, length, args.new),
                "measured_s": round(mine_s, 3),
                "best": best,
                "resolved_over_best": round(min(1.0, statistics.median(ratios)) if best != mine else 1.0, 3),
                "runs_on": alias[mine][0] if mine in alias else "its own load",
                "tok_s": {lb: round(own_tok_s[lb], 2) for lb in others},
                "tok_s_without_setup": {lb: round(steady[lb], 2) for lb in others},
                "setup_s": {lb: round(own_setup[lb], 2) for lb in others if own_setup[lb]},
                "decode_tok_s": {lb: round(decode[lb], 2) for lb in others},
                "static_cache": static_cache,
                "left_out_after_warm_up": timed["left_out"],
                "rounds": len(timed["full"][mine]),
                # The resolved load's memory in a fresh process: its weights, and the fp32 buffers a prompt's
                # forward made where prepare() computes prompts in fp32 from bf16 weights (kept for the next).
                "weight_bytes": fresh_loads[(ckpt, told)].get("weight_bytes"),
                "buffer_bytes": fresh_loads[(ckpt, told)].get("buffer_bytes"),
                "trace": [s.message for s in res.trace if s.topic in TRACED],
                "uptime": uptime(),
            }
        )
    return out


def split_name(told: int | None) -> str:
    """Whether resolve_device was told how many of the job's tokens are new (``max_new_tokens=``)."""
    return "unstated" if told is None else "stated"


def predicted_seconds(res: Any, path: Path, batch: int, length: int, new: int) -> float | None:
    """What the resolver's estimate says the job (``batch`` x ``length`` tokens, ``new`` of them new)
    takes in the resolved dtype, packing included where it pays; None without a calibration."""
    from whichdevice.core.job import Job
    from whichdevice.measure.calibration import calibration
    from whichdevice.measure.estimate import estimate_seconds
    from whichdevice.model.facts import read_model_facts

    calib, _ = calibration(measure=False)
    stored = read_model_facts(str(path)).stored
    if calib is None or res.dtype_name is None:
        return None
    job = Job(batch_size=batch, max_length=length, max_new_tokens=new)
    estimate = estimate_seconds(calib, res.dtype_name, job, stored.step_weights() if stored else None)
    return None if estimate is None else round(estimate[0], 3)


def child(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import whichdevice as wd
    from whichdevice.attention.decode import ensure_registered

    ensure_registered()  # whichdevice_sdpa is one of the attentions every dtype is timed with
    transformers.utils.logging.set_verbosity_error()
    # Calibrated first, on a machine not yet busy writing checkpoints (page-cache writeback disturbs
    # the timing), and again while other work kept a figure from being steady: the cells then time
    # the decisions of a steady calibration, as a user's quiet machine makes them.
    from whichdevice.measure.calibration import run_calibration

    for attempt in range(3):
        calib = run_calibration()
        log(f"calibration {attempt + 1}: {calib.source}")
        if not calib.unsteady:
            break
    gbps = bandwidth(torch)
    print(
        json.dumps({"bandwidth_gbps": round(gbps, 2), "threads": torch.get_num_threads(), "uptime": uptime()}),
        flush=True,
    )
    for size in args.sizes:
        model = harness.build_model(**harness.llama(size))
        embed = model.model.embed_tokens.weight.numel()
        read = sum(p.numel() for p in model.parameters()) - embed  # the weights a decode step reads
        with tempfile.TemporaryDirectory(prefix="whichdevice-real-sizes-") as tmp:
            paths = {}
            for ckpt in ("bfloat16", "float32"):
                paths[ckpt] = Path(tmp) / ckpt
                model.to(getattr(torch, ckpt)).save_pretrained(paths[ckpt])
            del model
            for batch in args.batches:
                gbps = bandwidth(torch)  # it moves with what else the host runs: read again for each cell
                for entry in cell(torch, AutoModelForCausalLM, wd, paths, batch, args):
                    itemsize = 2 if entry["checkpoint"] == "bfloat16" else 4
                    limit = batch * gbps * 1e9 / (read * itemsize)
                    entry.update(
                        size=size, read_parameters=read, limit_tok_s=round(limit, 2), bandwidth_gbps=round(gbps, 1)
                    )
                    entry["fraction_of_limit"] = {lb: round(v / limit, 3) for lb, v in entry["decode_tok_s"].items()}
                    print(json.dumps({"cell": entry}), flush=True)
                    resolved, ratio = entry["resolved"], entry["resolved_over_best"]
                    log(f"{size} {entry['checkpoint']} b{batch}: {resolved} {ratio}x best")


def table(kind: str, head: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    lines = [f"## {kind}: read bandwidth {head['bandwidth_gbps']} GB/s ({head['threads']} threads); {head['uptime']}"]
    for c in cells:
        exact = "bf16" if c["checkpoint"] == "bfloat16" else "fp32"
        lines.append(
            f"{c['size']} {exact} checkpoint, batch {c['batch']}, {c.get('prompt', '?')} + {c.get('new', '?')} "
            f"tokens, split {c.get('split', 'unstated')}: resolved {c['resolved']} = "
            f"{c['resolved_over_best']:.2f}x best ({c['best']}; resolved runs on {c.get('runs_on', 'its own load')}); "
            f"{exact} limit {c['limit_tok_s']} tok/s "
            f"at {c['bandwidth_gbps']} GB/s; {c['rounds']} rounds; "
            f"static cache {_static_text(c['static_cache'])}; "
            f"{c['uptime']}"
        )
        if c.get("predicted_s") is not None:
            lines.append(
                f"    the job: {c['predicted_s']:.2f} s estimated, {c['measured_s']:.2f} s measured (resolved load)"
            )
        for label, v in sorted(c["tok_s"].items(), key=lambda kv: -kv[1]):
            frac = c["fraction_of_limit"][label]
            lines.append(
                f"    {label:40} {v:8.2f} tok/s   decode {c['decode_tok_s'][label]:8.2f} tok/s = {frac:.0%} of limit"
                + (f"   (setup {c['setup_s'][label]:.2f} s counted)" if label in c.get("setup_s", {}) else "")
            )
        if c["left_out_after_warm_up"]:
            lines.append(
                f"    left out after the warm-up (>{HOPELESS:g}x the fastest): {', '.join(c['left_out_after_warm_up'])}"
            )
        lines += [f"    trace: {line[:400]}" for line in c["trace"]]
    return "\n".join(lines)


# Issue 56's bars (48's were 0.95 and 0.80): the resolved load over the best dtype x attention, where
# the split is stated and not.
BAR = {"stated": 0.95, "unstated": 0.90}


def _static_text(static: dict[str, Any]) -> str:
    ratio = static.get("tok_s_over_dynamic")
    said = f"{ratio:.2f}x dynamic" if ratio is not None else static.get("left_out", "not timed")
    return f"{said} for {static['of']}"


def weighed(checkpoint: str) -> tuple[str, ...]:
    """The dtypes the resolver weighs for a checkpoint on a CPU (precision/decide.py ``_candidates``):
    fp32 and bf16, and fp16 only to keep an fp16 checkpoint as it is."""
    return ("fp32", "bf16", "fp16") if checkpoint == "float16" else ("fp32", "bf16")


def best_weighed(c: dict[str, Any]) -> tuple[str, float]:
    """The fastest configuration in a dtype the resolver weighs for the cell's checkpoint, and the
    resolved load over it (tokens/s with setup, medians): the bar a choice among those can reach."""
    mine = next(lb for lb in c["tok_s"] if lb.startswith("resolved"))
    allowed = [lb for lb in c["tok_s"] if lb.split("/")[0] in weighed(c["checkpoint"])]
    best = max(allowed, key=lambda lb: c["tok_s"][lb])
    return best, min(1.0, c["tok_s"][mine] / c["tok_s"][best])


def matrix(report: list[dict[str, Any]]) -> str:
    """One line per cell and kind: the resolved load over the best of every configuration timed, and
    over the best in a dtype the resolver weighs for the checkpoint, against its bar."""
    lines = [
        "| kind | size | checkpoint | batch | prompt + new | split | resolved | best of all | resolved / best | "
        "best weighed | resolved / it | bar | estimated s | measured s | weights + fp32 buffers MiB |",
        "|" + "---|" * 15,
    ]
    for entry in report:
        for c in entry["cells"]:
            split = c.get("split", "unstated")
            ratio = c["resolved_over_best"]
            weighed_best, weighed_ratio = best_weighed(c)
            verdict = "ok" if weighed_ratio >= BAR[split] else "**below**"
            est = "-" if c.get("predicted_s") is None else f"{c['predicted_s']:.2f}"
            memory = "-" if c.get("weight_bytes") is None else f"{c['weight_bytes'] / 2**20:.0f}"
            memory += f" + {c['buffer_bytes'] / 2**20:.0f}" if c.get("buffer_bytes") else ""
            lines.append(
                f"| {entry['kind']} | {c['size']} | {SHORT[c['checkpoint']]} | {c['batch']} | "
                f"{c.get('prompt', '?')} + {c.get('new', '?')} | {split} | {c['resolved']} | {c['best']} | "
                f"{ratio:.2f}x | {weighed_best} | {weighed_ratio:.2f}x | {BAR[split]:.2f} {verdict} | {est} | "
                f"{c['measured_s']:.2f} | {memory} |"
            )
    return "\n".join(lines)


def kinds_of(document: Any) -> list[dict[str, Any]]:
    """The per-kind entries of a ``--json`` file: a list before the machine was stored beside them."""
    return list(document if isinstance(document, list) else document["kinds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=30.0)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=9)
    parser.add_argument(
        "--split",
        choices=("unstated", "stated", "both"),
        default="unstated",
        help="pass max_new_tokens=NEW to resolve_device (stated), not (unstated), or resolve both ways",
    )
    parser.add_argument("--attention", nargs="+", default=list(ATTENTION), choices=list(ATTENTION))
    parser.add_argument(
        "--fresh", type=int, default=3, help="fresh processes per setup timed, the median kept (packing is noisy)"
    )
    parser.add_argument("--json", "--out", dest="json", default=str(harness.RESULTS / "real_sizes.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--matrix", nargs="+", metavar="JSON", help="print the matrix of earlier runs' --out files")
    args = parser.parse_args()
    if args.matrix:
        print(matrix([entry for path in args.matrix for entry in kinds_of(json.loads(Path(path).read_text()))]))
        return 0
    if args.child:
        child(args)
        return 0
    machine = harness.machine()
    print(harness.machine_line(machine), flush=True)
    report = []
    for kind in args.kinds:
        with tempfile.TemporaryDirectory(prefix="whichdevice-calibration-") as cache:
            env = {**os.environ, **KINDS[kind], "WHICHDEVICE_CALIBRATION": cache}
            argv = [a for a in sys.argv[1:] if a != "--child"]
            out = subprocess.run(
                [sys.executable, __file__, *argv, "--child"], env=env, stdout=subprocess.PIPE, text=True, check=False
            )
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if not rows:
            raise SystemExit(f"{kind}: the child printed nothing (exit {out.returncode})")
        cells = [r["cell"] for r in rows if "cell" in r]
        report.append({"kind": kind, **rows[0], "cells": cells})
        print(table(kind, rows[0], cells), flush=True)
    print(matrix(report), flush=True)
    harness.write_json(args.json, {"machine": machine, "kinds": report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
