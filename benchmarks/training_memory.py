"""Training memory measured on real models against whichdevice's estimate of the same job, term by term.

    python benchmarks/training_memory.py            # every case (about 15-25 minutes on 2 cores)
    python benchmarks/training_memory.py --quick    # the two smallest models only
    python benchmarks/training_memory.py --json out.json

Each case trains a real transformers model (random weights from a config, saved and loaded with
from_pretrained) for two steps with transformers' Trainer, as whichdevice hands it over:
``training_arguments()`` for full fine-tuning, ``lora_training()`` for LoRA and QLoRA, with or without
gradient checkpointing. On the CPU every storage torch creates during ``trainer.train()`` is counted as
it is made and as it is freed (scripts/activation_probe.py's tracker, the CPU's stand-in for
``torch.cuda.max_memory_allocated``); at the highest moment the bytes are split into gradients (the
parameters' ``.grad``), optimizer state (the optimizer's ``state``) and activations (everything else),
and the weights are the parameters' own bytes. On a CUDA device the peak is
``torch.cuda.max_memory_allocated`` instead (no split).

The estimate is memory/training_job.py's for the same model, job and way of training (what
``resolve_device(model=..., task="training")`` prices): weights, gradients, optimizer state and the
activations at the step's peak. A case passes when the estimate is within 15% of the measured peak and
never more than 5% under it; the script prints the table and exits 1 when a case fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

ROOT = harness.ROOT
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# name -> (config class, model class, config keywords): shapes of real checkpoints at 0.1-1B.
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # SmolLM-135M's shape (a Llama)
    "llama-0.13B": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)),
    # Qwen2.5-0.5B's shape
    "qwen2-0.5B": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)),
    # Gemma 3 270M's shape: a 262k vocabulary, 256-wide heads
    "gemma3-0.27B": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, max_position_embeddings=4096)),
    # a small Qwen3-MoE: 16 experts, 4 per token
    "qwen3moe-0.25B": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=512, intermediate_size=1536, moe_intermediate_size=384, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        vocab_size=32000, max_position_embeddings=4096)),
    # TinyLlama-1.1B's shape
    "llama-1.1B": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
        vocab_size=32000, max_position_embeddings=2048)),
}  # fmt: skip

# (model, way: full / lora / qlora, gradient checkpointing, batch size, tokens)
CASES = [
    ("llama-0.13B", "full", False, 2, 512),
    ("llama-0.13B", "full", True, 2, 512),
    ("llama-0.13B", "lora", False, 2, 512),
    ("llama-0.13B", "lora", True, 2, 512),
    ("llama-0.13B", "qlora", True, 2, 512),
    ("gemma3-0.27B", "full", False, 1, 512),
    ("gemma3-0.27B", "lora", True, 1, 512),
    ("qwen3moe-0.25B", "full", False, 1, 512),
    ("qwen3moe-0.25B", "lora", True, 1, 512),
    ("qwen2-0.5B", "full", True, 1, 512),
    ("qwen2-0.5B", "lora", False, 1, 512),
    ("qwen2-0.5B", "qlora", True, 1, 512),
    ("llama-1.1B", "lora", True, 1, 512),
    ("llama-1.1B", "qlora", False, 1, 256),
]
QUICK = ("llama-0.13B", "gemma3-0.27B")


@dataclass
class Measured:
    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def _save(name: str, folder: Path) -> None:
    import torch
    import transformers

    config_class, model_class, values = MODELS[name]
    config = getattr(transformers, config_class)(**values, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(folder)


class _Tokens:
    """Fixed random sequences: what Trainer's dataloader hands a causal LM."""

    def __init__(self, vocab: int, batch: int, tokens: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (batch * 4, tokens), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.data[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": ids.new_ones(ids.shape)}


def _setup(way: str, ckpt: bool) -> Any:
    """The way to train as whichdevice prices it on this CPU (bf16 mixed precision where it runs natively)."""
    from whichdevice.memory.training_records import TrainingSetup

    compute = _compute()
    if way == "full":
        return TrainingSetup("full", "float32", compute, ckpt)
    if way == "lora":
        return TrainingSetup("lora", compute or "float32", compute, ckpt)
    return TrainingSetup("qlora", compute or "float32", compute, ckpt)


def _compute() -> str | None:
    """bf16 autocast where this CPU has native bf16 (whichdevice's CPU probe), else none."""
    import whichdevice as wd

    res = wd.resolve_device("cpu", task="training")
    return "bfloat16" if res.mixed_precision == "bf16" else None


def estimate(folder: Path, way: str, ckpt: bool, batch: int, tokens: int) -> dict[str, int]:
    from whichdevice.core.job import Job
    from whichdevice.memory.training_job import setup_weights, training_memory
    from whichdevice.model.facts import read_model_facts

    facts = read_model_facts(str(folder))
    setup = _setup(way, ckpt)
    job = Job("training", batch, tokens)
    memory = training_memory(facts.size, facts.shape, job, setup)
    weights = setup_weights(facts.size, setup) + memory.term("adapters")
    return {
        "weights": weights,
        "gradients": memory.term("gradients"),
        "optimizer": memory.term("optimizer state"),
        "activations": memory.term("activations"),
        "total": setup_weights(facts.size, setup) + memory.bytes,
    }


def measure(folder: Path, way: str, ckpt: bool, batch: int, tokens: int) -> Measured:
    """Two Trainer steps of the real model, counted storage by storage."""
    import torch
    from activation_probe import _LiveStorages
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer

    import whichdevice as wd

    compute = _compute()
    dtype = getattr(torch, compute) if compute and way != "full" else torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype, "device_map": "cpu", "attn_implementation": "sdpa"}
    if way == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    res = wd.resolve_device("cpu", task="training")
    common = dict(
        max_steps=2, per_device_train_batch_size=batch, save_strategy="no", report_to=[], logging_strategy="no",
        dataloader_num_workers=0, use_cpu=True, bf16=compute is not None, fp16=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        if way == "full":
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            args = wd.training_arguments(out, resolution=res, gradient_checkpointing=ckpt, **common)
        else:
            lora = wd.lora_training(model, res, gradient_checkpointing=ckpt)
            model = lora.model
            args = lora.training_arguments(out, **common)
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens(model.config.vocab_size, batch, tokens))
        weights = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in model.parameters()}.values())
        tracker = _LiveStorages()
        tracker.known(itertools.chain(model.parameters(), model.buffers()))
        with tracker:
            trainer.train()
        grads = {tracker.serial(p.grad) for p in model.parameters() if p.grad is not None}
        optimizer = trainer.optimizer
        states = {
            tracker.serial(t)
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        }
    live: dict[str, int] = {"gradients": 0, "optimizer": 0, "activations": 0}
    best: dict[str, int] = dict(live)
    for delta, serial in tracker.events:
        kind = "gradients" if serial in grads else "optimizer" if serial in states else "activations"
        live[kind] += delta
        if sum(live.values()) > sum(best.values()):
            best = dict(live)
    return Measured(weights, best["gradients"], best["optimizer"], best["activations"])


def _gib(n: int) -> str:
    return f"{n / 2**30:6.2f}"


def run_case(case: tuple[str, str, bool, int, int], folders: dict[str, Path]) -> dict[str, Any]:
    name, way, ckpt, batch, tokens = case
    started = time.monotonic()
    measured = measure(folders[name], way, ckpt, batch, tokens)
    est = estimate(folders[name], way, ckpt, batch, tokens)
    gc.collect()
    ratio = est["total"] / measured.total
    return {
        "model": name,
        "way": way,
        "checkpointing": ckpt,
        "batch_size": batch,
        "tokens": tokens,
        "measured": {**vars(measured), "total": measured.total},
        "estimate": est,
        "ratio": round(ratio, 3),
        "pass": 0.95 <= ratio <= 1.15,
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the two smallest models only")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--only", action="append", choices=sorted(MODELS), help="only these models")
    args = parser.parse_args()
    cases = [c for c in CASES if (not args.quick or c[0] in QUICK) and (not args.only or c[0] in args.only)]
    machine = harness.machine()
    print(harness.machine_line(machine))
    terms = "W      G      O      A  total"
    header = f"model            way    ckpt  BxT       |  measured GiB: {terms} |  estimate GiB: {terms} | est/meas"
    print(header)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name in dict.fromkeys(c[0] for c in cases):
            folders[name] = Path(tmp) / name
            _save(name, folders[name])
        for case in cases:
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                row = run_case(case, folders)
            rows.append(row)
            m, e = row["measured"], row["estimate"]
            print(
                f"{row['model']:16s} {row['way']:6s} {'on' if row['checkpointing'] else 'off':5s} "
                f"{row['batch_size']}x{row['tokens']:<6d} |  {_gib(m['weights'])} {_gib(m['gradients'])} "
                f"{_gib(m['optimizer'])} {_gib(m['activations'])} {_gib(m['total'])} |  {_gib(e['weights'])} "
                f"{_gib(e['gradients'])} {_gib(e['optimizer'])} {_gib(e['activations'])} {_gib(e['total'])} | "
                f"{row['ratio']:.3f} {'ok' if row['pass'] else 'FAIL'}",
                flush=True,
            )
    failed = [r for r in rows if not r["pass"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} within 0.95x-1.15x of the measured peak")
    harness.write_json(args.json, {"machine": machine, "rows": rows})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
