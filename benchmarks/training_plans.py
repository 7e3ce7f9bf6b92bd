"""What whichdevice hands over for big jobs on simulated GPUs: training strategies, and the largest job that fits.

    python benchmarks/training_plans.py

Part 1: a 7B and a 13B Llama full fine-tune (``task="training", quantize=None``, no batch or length given,
so activations are not counted, as the trace says; at 2048 tokens a 7B's activations alone are 47 GiB)
on 1, 2, 4 and 8 simulated 24 GiB and 80 GiB GPUs, in one process and as rank 0 of a torchrun launch
(RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set in-process): the strategy chosen, its
per-device estimate, the TrainingArguments keywords and the launch command. Part 2: the longest
max_length at batch 1 and 8, and the largest batch at 2048 tokens, for a 1.1B and a 7B Llama on one
24 GiB GPU (inference, bf16). Configs are transformers' LlamaConfig saved to a temp dir (no weights:
sizes come from a meta build). The CPU memory FSDP offload would use is this machine's (probed for real).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Any

from transformers import LlamaConfig

import whichdevice as wd
from whichdevice.core.sizes import format_bytes
from whichdevice.testing import simulate

SHAPES = {
    "1.1B": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632),
    "7B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008),
    "13B": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, intermediate_size=13824),
}  # fmt: skip
# Long enough that the search is not capped by the model's own context.
CONTEXT = 131072


@contextmanager
def torchrun(world: int):
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # fmt: skip
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _config(name: str, folder: str) -> str:
    path = os.path.join(folder, name)
    LlamaConfig(**SHAPES[name], vocab_size=32000, max_position_embeddings=CONTEXT).save_pretrained(path)
    return path


def _row(model: str, res: wd.Resolution | None, error: str | None) -> str:
    if res is None:
        return f"refused: {(error or '')[:200]}..."
    plan = res.training_plan
    chosen = plan.chosen if plan else None
    ranks = f"{plan.devices} ranks: {chosen.name}, {format_bytes(chosen.per_device)}/device; " if chosen else ""
    lora = any(s.topic == "warning" and "LoRA adapters on the" in s.message for s in res.trace)
    quant = res.quantization is not None
    here = "QLoRA (4-bit)" if quant else ("LoRA" if lora else "full fine-tune")
    what = f"{ranks}this process: {here}"
    kwargs = {k: v for k, v in res.training_kwargs().items() if k in ("fsdp", "fsdp_config", "deepspeed")}
    launch = " ".join(res.launch_command(["train.py"])) if res.distributed is None else "(launched)"
    return f"{what}; device_map={res.device_map!r}, dtype={res.dtype_name}; kwargs {kwargs or '{}'}; {launch}"


def _resolve(path: str, **kw: Any) -> tuple[wd.Resolution | None, str | None]:
    try:
        return wd.resolve_device(model=path, **kw), None
    except wd.DeviceError as err:
        return None, f"{type(err).__name__}: {err}"


def strategies(folder: str) -> None:
    print("## Full fine-tune, quantize=None (activations not counted: no batch_size/max_length)\n")
    for name in ("7B", "13B"):
        path = _config(name, folder)
        for mem in ("24GiB", "80GiB"):
            for count in (1, 2, 4, 8):
                for how in ("one process", "torchrun"):
                    with simulate(f"cuda:{count},mem={mem},name=GPU"):
                        if how == "torchrun" and count > 1:
                            with torchrun(count):
                                res, err = _resolve(path, task="training", quantize=None)
                        elif how == "torchrun":
                            continue
                        else:
                            res, err = _resolve(path, task="training", quantize=None)
                    print(f"- {name} on {count} x {mem} ({how}): {_row(name, res, err)}")
        print()


def largest(folder: str) -> None:
    print("## The largest that fits one 24 GiB GPU (inference, bfloat16)\n")
    for name in ("1.1B", "7B"):
        path = _config(name, folder)
        for batch in (1, 8):
            for length in (2048, 4096):
                with simulate("cuda:1,mem=24GiB,name=GPU"):
                    res, err = _resolve(path, batch_size=batch, max_length=length, quantize=None)
                if res is not None:
                    said = res.largest_fit().text()
                else:
                    said = "does not fit; " + (err or "").split("On these devices, ")[-1]
                print(f"- {name}, batch {batch} x {length} tokens: {said}")
    print()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        strategies(tmp)
        largest(tmp)
