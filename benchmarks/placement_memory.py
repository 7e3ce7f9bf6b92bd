"""Measured peak memory of real jobs on the CPU against whichdevice's estimate of the same job.

    python benchmarks/placement_memory.py            # every case (about 2-4 minutes on 2 cores)
    python benchmarks/placement_memory.py --quick    # the tiny models only
    python benchmarks/placement_memory.py --measured benchmarks/placement_memory.json
        # re-estimate against peaks measured earlier (after a change to the formulas)

Each case runs in its own process: import torch and transformers, warm up on a miniature of the
same architecture (so lazily imported code and kernels' one-time buffers are not counted), take the
resident set size as the baseline, reset the kernel's high-water mark (/proc/self/clear_refs), then
load the checkpoint and generate, or run 3 AdamW training steps the way Trainer does (train mode,
loss.backward, step, zero_grad). Measured = peak RSS (VmHWM) - baseline. Estimate = what
``resolve_device(model=..., batch_size=..., max_length=...)`` counts: weights + KV cache +
activations, or weights + gradients + optimizer state + activations. The estimate must never be
below the measured peak; the script exits 1 if it is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, kw = MODELS[name]
    path = folder / name
    if not path.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw)).save_pretrained(path)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny models only")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--measured", type=Path, help="take the measured peaks from an earlier --json file")
    args = parser.parse_args()
    earlier = {}
    if args.measured:
        for row in json.loads(args.measured.read_text()):
            earlier[(row["model"], row["task"], row["batch"], row["max_length"], row["prompt"])] = row
    cases = [c for c in CASES if not args.quick or c[0].endswith("-tiny")]
    rows = []
    print(
        "| model | job | batch | max_length | measured peak MiB | before: weights only MiB (error) "
        "| now: whole job MiB (error) |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, task, batch, max_length, prompt in cases:
            path = _build(name, Path(tmp))
            weights, extra, _ = _estimate(path, task, batch, max_length)
            key = (name, task, batch, max_length, prompt)
            if key in earlier:
                measured = {"peak": earlier[key]["measured"], "load_peak": earlier[key]["load_peak"]}
            else:
                measured = _measure(path, task, batch, max_length, prompt, name)
            estimate = weights + extra
            rows.append(
                dict(model=name, task=task, batch=batch, max_length=max_length, prompt=prompt, weights=weights,
                     estimate=estimate, measured=measured["peak"], load_peak=measured["load_peak"])
            )  # fmt: skip
            row = rows[-1]
            job = f"generate {max_length - prompt} after {prompt}" if task == "inference" else "3 AdamW steps"
            error = (estimate - row["measured"]) / row["measured"] * 100
            before = (weights - row["measured"]) / row["measured"] * 100
            print(
                f"| {name} | {job} | {batch} | {max_length} | {_mib(row['measured'])} | {_mib(weights)} "
                f"({before:+.0f}%) | {_mib(estimate)} ({error:+.1f}%) |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    under = [r for r in rows if r["estimate"] < r["measured"]]
    for r in under:
        print(f"UNDER-ESTIMATE: {r['model']} {r['task']} b={r['batch']} T={r['max_length']}", file=sys.stderr)
    return 1 if under else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
