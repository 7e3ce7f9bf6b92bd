"""One rank of benchmarks/strategy_memory.py: train a small Llama 3 AdamW steps with DDP or FSDP2 on the CPU.

    torchrun --nproc-per-node=2 benchmarks/strategy_rank.py ddp|fsdp OUT_DIR BATCH MAX_LENGTH

DDP is torch's DistributedDataParallel as Trainer wraps it (accelerate's defaults); FSDP is torch's
FSDP2 ``fully_shard`` on every ``_no_split_modules`` layer and then the root, which is what
accelerate does for ``fsdp=True`` with ``transformer_layer_cls_to_wrap`` on an accelerator (on CPU
processes accelerate trains DDP whatever ``fsdp`` says, so FSDP is applied here directly). After a
warm-up on a miniature the model is built and wrapped (FSDP keeps this rank's shard); the rank then
resets its high-water mark (/proc/self/clear_refs), trains, and writes the peak RSS above the
baseline before the model was built (the weights it holds count), and a checksum of its full
weights, to OUT_DIR/rank<N>.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

SMALL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)  # fmt: skip


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module)
    fully_shard(model)
    return model


def _train(model: torch.nn.Module, batch: int, length: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(3):
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _checksum(model: torch.nn.Module) -> float:
    total = 0.0
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards are DTensors
        total += float(full.detach().double().sum())
    return total


def main() -> None:
    how, out, batch, length = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mini = LlamaConfig(**{**SMALL, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64})  # fmt: skip
    _train(_wrap(LlamaForCausalLM(mini), how), 1, 8, 64)
    gc.collect()
    start = _status("VmRSS")
    torch.manual_seed(0)
    # Built whole on every rank, then wrapped: FSDP frees all but this rank's shard. The training peak is
    # measured from here, as on an accelerator, where the whole model is loaded in CPU memory, not the device's.
    model = _wrap(LlamaForCausalLM(LlamaConfig(**SMALL)), how)
    gc.collect()
    held = _status("VmRSS") - start
    base = _status("VmRSS") - held
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    _train(model, batch, length, SMALL["vocab_size"])
    peak = _status("VmHWM") - base
    checksum = _checksum(model)
    rank = dist.get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"strategy": how, "rank": rank, "held": held, "peak": peak, "checksum": checksum}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
