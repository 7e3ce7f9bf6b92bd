"""Does the memory whichdevice counts for a job hold, and where does a model go on busy GPUs? Peaks and placements.

    python benchmarks/placement_memory.py            # every part (about 2-4 minutes on 2 cores)
    python benchmarks/placement_memory.py --quick    # the tiny models only
    python benchmarks/placement_memory.py --measured benchmarks/placement_memory.json
        # re-estimate against peaks measured earlier (after a change to the formulas): seconds
    python benchmarks/placement_memory.py --only busy-node --only load-peaks   # no timing, seconds

``measured``: real jobs on this CPU against the estimate. Each case runs in its own process: import
torch and transformers, warm up on a miniature of the
same architecture (so lazily imported code and kernels' one-time buffers are not counted), take the
resident set size as the baseline, reset the kernel's high-water mark (/proc/self/clear_refs), then
load the checkpoint and generate, or run 3 AdamW training steps the way Trainer does (train mode,
loss.backward, step, zero_grad). Measured = peak RSS (VmHWM) - baseline. Estimate = what
``resolve_device(model=..., batch_size=..., max_length=...)`` counts: weights + KV cache +
activations, or weights + gradients + optimizer state + activations. The estimate must never be
below the measured peak; the script exits 1 if it is. Printed as a Markdown table
(docs/placement.md's "How close the estimates are", from benchmarks/placement_memory.json: the rows of
one run, which ``--measured`` reads back).

``busy-node`` (no timing): the resolutions (device, keywords, launch command, the trace lines that say
why) on a simulated 4-GPU A100 node others share: GPU 0 full, GPU 1 in exclusive-process mode held by
another process, and ``devices=[2, 3]``, each for inference (a 7B model in bf16) and training.

``load-peaks`` (no timing): a Llama-2-7B-shaped model's load peak on one GPU beside the allocator
warm-up the installed transformers computes for it (its own ``caching_allocator_warmup``, run with the
device queries answered: whichdevice.memory.load_peak), in bf16, fp32 and bitsandbytes 4- and 8-bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

PARTS = ("measured", "busy-node", "load-peaks")
GiB = 1024**3

ROOT = Path(__file__).resolve().parent.parent

# name -> (config class, config keywords)
MODELS = {
    "llama-tiny": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=2048)),
    "gpt2-tiny": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=2048)),
    "llama-small": ("LlamaConfig", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                         num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                                         max_position_embeddings=4096)),
    "gpt2-small": ("GPT2Config", dict(n_embd=512, n_layer=6, n_head=8, vocab_size=32000, n_positions=4096)),
    "mistral-small-sw": ("MistralConfig", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                               num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                                               sliding_window=256, max_position_embeddings=4096)),
    "qwen2-small": ("Qwen2Config", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                        num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                                        max_position_embeddings=4096)),
}  # fmt: skip

# (model, task, batch_size, max_length, prompt tokens)
CASES = [
    ("llama-tiny", "inference", 1, 160, 32),
    ("gpt2-tiny", "inference", 2, 160, 32),
    ("llama-tiny", "training", 4, 64, 0),
    ("gpt2-tiny", "training", 4, 64, 0),
    ("llama-small", "inference", 1, 288, 32),
    ("llama-small", "inference", 4, 1024, 512),
    ("gpt2-small", "inference", 4, 1024, 512),
    ("mistral-small-sw", "inference", 4, 1024, 512),
    ("qwen2-small", "inference", 2, 1024, 768),
    ("llama-small", "training", 4, 128, 0),
    ("gpt2-small", "training", 4, 128, 0),
    ("qwen2-small", "training", 2, 256, 0),
]

CHILD = r"""
import gc, json, sys, torch, transformers
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
path, task, batch, max_length, prompt, cls, kw = sys.argv[1:8]
batch, max_length, prompt = int(batch), int(max_length), int(prompt)
kw = json.loads(kw)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def job(model, batch, max_length, prompt):
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    if task == "inference":
        model.eval()
        ids = torch.randint(0, vocab, (batch, prompt), generator=g)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_length=max_length,
                           min_length=max_length, do_sample=False, pad_token_id=0)
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(3):
            ids = torch.randint(0, vocab, (batch, max_length), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

# warm-up on a miniature of the same architecture: imports and one-time buffers
mini = dict(kw)
for key in ("hidden_size", "n_embd"):
    if key in mini: mini[key] = 32
for key in ("intermediate_size",):
    if key in mini: mini[key] = 64
for key in ("num_hidden_layers", "n_layer"):
    if key in mini: mini[key] = 1
for key in ("num_attention_heads", "n_head", "num_key_value_heads"):
    if key in mini: mini[key] = 2
mini["vocab_size"] = 64
config = getattr(transformers, cls)(**mini)
job(AutoModelForCausalLM.from_config(config), 1, 8 if task == "training" else 12, 4 if task == "inference" else 0)
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset VmHWM to the current RSS
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
loaded = status("VmHWM")
job(model, batch, max_length, prompt)
print(json.dumps({"baseline": base, "load_peak": loaded - base, "peak": status("VmHWM") - base}))
"""


def _build(name: str, folder: Path) -> Path:
    cls, kw = MODELS[name]
    path = folder / name
    if not path.exists():
        harness.save_model(path, config_class=cls, **kw)
    return path


def _estimate(path: Path, task: str, batch: int, max_length: int) -> tuple[int, int, str]:
    """(weights, everything else) as resolve_device counts them on the CPU, and its trace line."""
    import whichdevice as wd
    from whichdevice.core.job import Job
    from whichdevice.memory.placement import estimate_job
    from whichdevice.model.facts import read_model_facts

    res = wd.resolve_device(
        "cpu", model=str(path), task=task, batch_size=batch, max_length=max_length, dtype="float32", quantize=None
    )
    job = Job(task, batch, max_length)
    facts = read_model_facts(str(path))
    if task == "training":  # the child trains fp32 weights with AdamW, no autocast, no checkpointing
        from whichdevice.memory.training_job import training_memory
        from whichdevice.memory.training_records import TrainingSetup

        memory = training_memory(
            facts.size, facts.shape, job, TrainingSetup("full", "float32"), attention=res.attn_implementation
        )
        line = memory.describe(facts.size.bytes_in("float32"))
        return facts.size.bytes_in("float32"), memory.bytes, line
    size, memory = estimate_job(facts, job, "float32", eager=res.attn_implementation == "eager")
    line = next(s.message for s in res.trace if s.topic == "memory" and "needs" in s.message)
    return size.bytes_in("float32"), memory.bytes, line


def _measure(path: Path, task: str, batch: int, max_length: int, prompt: int, name: str) -> dict[str, int]:
    cls, kw = MODELS[name]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), task, str(batch), str(max_length), str(prompt), cls, json.dumps(kw)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    data: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return data


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f}"


def measured(args: argparse.Namespace) -> list[dict[str, Any]]:
    earlier = {}
    if args.measured:
        document = json.loads(args.measured.read_text())
        # A list of rows (benchmarks/placement_memory.json), or a --json file with the machine beside them.
        for row in document if isinstance(document, list) else document["measured"]:
            earlier[(row["model"], row["task"], row["batch"], row["max_length"], row["prompt"])] = row
    cases = [c for c in CASES if not args.quick or c[0].endswith("-tiny")]
    rows, cells = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, task, batch, max_length, prompt in cases:
            path = _build(name, Path(tmp))
            weights, extra, _ = _estimate(path, task, batch, max_length)
            key = (name, task, batch, max_length, prompt)
            if key in earlier:
                peaks = {"peak": earlier[key]["measured"], "load_peak": earlier[key]["load_peak"]}
            else:
                peaks = _measure(path, task, batch, max_length, prompt, name)
            estimate = weights + extra
            rows.append(
                dict(model=name, task=task, batch=batch, max_length=max_length, prompt=prompt, weights=weights,
                     estimate=estimate, measured=peaks["peak"], load_peak=peaks["load_peak"])
            )  # fmt: skip
            row = rows[-1]
            job = f"generate {max_length - prompt} after {prompt}" if task == "inference" else "3 AdamW steps"
            error = (estimate - row["measured"]) / row["measured"] * 100
            before = (weights - row["measured"]) / row["measured"] * 100
            cells.append(
                [name, job, batch, max_length, _mib(row["measured"]), f"{_mib(weights)} ({before:+.0f}%)",
                 f"{_mib(estimate)} ({error:+.1f}%)"]
            )  # fmt: skip
            harness.log(f"  {name} {job}: measured {_mib(row['measured'])} MiB, estimate {_mib(estimate)} MiB")
    head = ["model", "job", "batch", "max_length", "measured peak MiB", "before: weights only MiB (error)",
            "now: whole job MiB (error)"]  # fmt: skip
    print(harness.table(head, cells, markdown=True))
    return rows


# ------------------------------------------------------------------------------------- busy GPUs, load peaks

NODE = "cuda:4,name=NVIDIA A100-SXM4-80GB"
SCENARIOS = (
    ("GPU 0 full (another process holds 79.5 GiB)", f"{NODE},held=79.5GiB/0/0/0", {}),
    ("GPU 1 exclusive-process, held by another process", f"{NODE},compute=default/exclusive,held=0/2GiB", {}),
    ("devices=[2, 3]", NODE, {"devices": [2, 3]}),
)
TOPICS = ("device", "warning", "placement", "load", "tf32", "model")


def seven_b() -> Any:
    from transformers import LlamaConfig

    # Llama-2-7B's shape: 6.74B parameters, untied head, 32 layers of 4096.
    shape = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32)
    return LlamaConfig(**shape, num_key_value_heads=32, vocab_size=32000)


def _kwargs(res: Any) -> str:
    if res.task == "training":
        return f"TrainingArguments({', '.join(f'{k}={v!r}' for k, v in res.training_kwargs().items())})"
    shown = {k: (str(v) if k == "dtype" else v) for k, v in res.model_kwargs().items()}
    return f"from_pretrained({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def busy_node(args: argparse.Namespace) -> list[dict[str, Any]]:
    import whichdevice as wd
    from whichdevice.testing import simulate

    found = []
    for title, spec, extra in SCENARIOS:
        for task in ("inference", "training"):
            # Inference sizes a 7B model in bf16 (placement and its load); training shows the hand-over.
            sized = {"model": seven_b(), "dtype": "bfloat16"} if task == "inference" else {}
            with simulate(spec):
                res = wd.resolve_device(task=task, **sized, **extra)
            lines = [
                f"device     {res.device}  (devices {res.devices}, device_count {res.device_count})",
                f"keywords   {_kwargs(res)}",
                f"launch     {shlex.join(res.launch_command(['train.py']))}",
            ]
            lines += [f"  {s.topic:<9} {s.message}" for s in res.trace if s.topic in TOPICS and s.chosen is not True]
            print(f"\n### {title}: {task}\n" + "\n".join(lines))
            found.append({"scenario": title, "spec": spec, "task": task, "lines": lines})
    return found


def _meta(config: Any, dtype: str, bits: int | None) -> tuple[Any, Any]:
    """The model on the meta device, and bitsandbytes' quantizer with its layers swapped in where ``bits``."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if bits is None:
        return meta, None
    quantizer = AutoHfQuantizer.from_config(
        BitsAndBytesConfig(load_in_4bit=bits == 4, load_in_8bit=bits == 8, bnb_4bit_compute_dtype=torch.bfloat16)
    )
    quantizer.preprocess_model(meta, dtype=getattr(torch, dtype), device_map={"": "cuda:0"})
    return meta, quantizer


def load_peaks(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers.integrations.accelerate import expand_device_map

    from whichdevice.core.sizes import format_bytes
    from whichdevice.memory.load_peak import installed_warmup, load_peak
    from whichdevice.model.size import size_from_config

    config = seven_b()
    size = size_from_config(config)
    print("\n### Load peak of a 7B model (Llama-2-7B shape) on one GPU, beside the steady state")
    gpus = (("H100 80GB", 80 * GiB, 79 * GiB), ("A10 24GB", 24 * GiB, 22 * GiB), ("L4 24GB, busy", 24 * GiB, 13 * GiB))
    rows, found = [], []
    for dtype, bits in (("bfloat16", None), ("float32", None), ("bfloat16", 4), ("bfloat16", 8)):
        meta, quantizer = _meta(config, dtype, bits)
        device_map = expand_device_map({"": "cuda:0"}, list(meta.state_dict().keys()))
        what = dtype if bits is None else f"{bits}-bit (bitsandbytes on load, {dtype} rest)"
        for name, total, free in gpus:
            theirs = installed_warmup(meta, device_map, {"cuda:0": (free, total)}, quantizer)["cuda:0"]
            peak = load_peak(size, dtype, "cuda:0", free, total, bits, kind="cuda")
            steady = "fits" if peak.weights <= 0.8 * free else "does not fit"
            transient = f" (+{format_bytes(peak.transient)} 16-bit copy)" if peak.transient else ""
            rows.append(
                [what, f"{name} ({format_bytes(total)}, {format_bytes(free)})", f"{format_bytes(theirs)} ({theirs} B)",
                 f"{format_bytes(peak.warmup)} ({peak.warmup} B)", f"{format_bytes(peak.peak)}{transient}",
                 format_bytes(peak.moved), f"{format_bytes(peak.weights)}: {steady}", peak.fits]
            )  # fmt: skip
            found.append({"weights": what, "gpu": name, "transformers_warmup": theirs, "warmup": peak.warmup,
                          "peak": peak.peak, "fits": peak.fits})  # fmt: skip
    head = ["weights", "GPU (total, free)", "transformers' warm-up, its installed code", "whichdevice's warm-up",
            "load peak", "moved from the CPU", "steady state (weights vs 80% of free)", "load fits"]  # fmt: skip
    print(harness.table(head, rows, markdown=True))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    parser.add_argument("--quick", action="store_true", help="the tiny models only")
    parser.add_argument("--measured", type=Path, help="take the measured peaks from an earlier --json file")
    harness.add_json_argument(parser, default=str(harness.RESULTS / "placement_memory.json"))
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    machine = harness.machine()
    print(harness.machine_line(machine))
    parts = [p for p in PARTS if not args.only or p in args.only]
    runs = {"measured": measured, "busy-node": busy_node, "load-peaks": load_peaks}
    found = {part: runs[part](args) for part in parts}
    harness.write_json(args.json, {"machine": machine, **found})
    under = [r for r in found.get("measured", []) if r["estimate"] < r["measured"]]
    for r in under:
        print(f"UNDER-ESTIMATE: {r['model']} {r['task']} b={r['batch']} T={r['max_length']}", file=sys.stderr)
    return 1 if under else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
