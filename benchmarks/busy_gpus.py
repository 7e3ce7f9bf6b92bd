"""What whichdevice answers on a simulated 4-GPU node that others share, and a 7B model's load peak.

No timing: it prints the resolutions (device, keywords, launch command, the trace lines that say why)
for a node whose GPU 0 is full, one whose GPU 1 is in exclusive-process mode held by another process,
and ``devices=[2, 3]``, each for inference and training; then a Llama-2-7B-shaped model's load peak
beside the allocator warm-up the installed transformers computes for it (its own
``caching_allocator_warmup``, run with the device queries answered: whichdevice.memory.load_peak).

    python benchmarks/busy_gpus.py
"""

from __future__ import annotations

import logging
import shlex
from typing import Any

import torch

import whichdevice as wd
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.load_peak import installed_warmup, load_peak
from whichdevice.model.size import size_from_config
from whichdevice.testing import simulate

GiB = 1024**3
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


def _kwargs(res: wd.Resolution) -> str:
    if res.task == "training":
        return f"TrainingArguments({', '.join(f'{k}={v!r}' for k, v in res.training_kwargs().items())})"
    shown = {k: (str(v) if k == "dtype" else v) for k, v in res.model_kwargs().items()}
    return f"from_pretrained({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def scenarios() -> None:
    for title, spec, extra in SCENARIOS:
        for task in ("inference", "training"):
            # Inference sizes a 7B model in bf16 (placement and its load); training shows the hand-over.
            sized = {"model": seven_b(), "dtype": "bfloat16"} if task == "inference" else {}
            with simulate(spec):
                res = wd.resolve_device(task=task, **sized, **extra)
            print(f"\n### {title}: {task}")
            print(f"device     {res.device}  (devices {res.devices}, device_count {res.device_count})")
            print(f"keywords   {_kwargs(res)}")
            print(f"launch     {shlex.join(res.launch_command(['train.py']))}")
            for step in res.trace:
                if step.topic in TOPICS and step.chosen is not True:
                    print(f"  {step.topic:<9} {step.message}")


def _meta(config: Any, dtype: str, bits: int | None) -> tuple[Any, Any]:
    """The model on the meta device, and bitsandbytes' quantizer with its layers swapped in where ``bits``."""
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


def load_peaks() -> None:
    from transformers.integrations.accelerate import expand_device_map

    config = seven_b()
    size = size_from_config(config)
    print("\n### Load peak of a 7B model (Llama-2-7B shape) on one GPU, beside the steady state")
    print(
        "| weights | GPU (total, free) | transformers' warm-up, its installed code | whichdevice's warm-up | "
        "load peak | moved from the CPU | steady state (weights vs 80% of free) | load fits |"
    )
    print("|---|---|---|---|---|---|---|---|")
    gpus = (("H100 80GB", 80 * GiB, 79 * GiB), ("A10 24GB", 24 * GiB, 22 * GiB), ("L4 24GB, busy", 24 * GiB, 13 * GiB))
    for dtype, bits in (("bfloat16", None), ("float32", None), ("bfloat16", 4), ("bfloat16", 8)):
        meta, quantizer = _meta(config, dtype, bits)
        device_map = expand_device_map({"": "cuda:0"}, list(meta.state_dict().keys()))
        what = dtype if bits is None else f"{bits}-bit (bitsandbytes on load, {dtype} rest)"
        for name, total, free in gpus:
            theirs = installed_warmup(meta, device_map, {"cuda:0": (free, total)}, quantizer)["cuda:0"]
            peak = load_peak(size, dtype, "cuda:0", free, total, bits, kind="cuda")
            steady = "fits" if peak.weights <= 0.8 * free else "does not fit"
            transient = f" (+{format_bytes(peak.transient)} 16-bit copy)" if peak.transient else ""
            gpu = f"{name} ({format_bytes(total)}, {format_bytes(free)})"
            print(
                f"| {what} | {gpu} | {format_bytes(theirs)} ({theirs} B) | "
                f"{format_bytes(peak.warmup)} ({peak.warmup} B) | {format_bytes(peak.peak)}{transient} | "
                f"{format_bytes(peak.moved)} | {format_bytes(peak.weights)}: {steady} | {peak.fits} |"
            )


if __name__ == "__main__":
    logging.getLogger("transformers").setLevel(logging.ERROR)
    scenarios()
    load_peaks()
