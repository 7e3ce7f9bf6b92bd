"""Run under torchrun: each rank resolves, reports, and trains a few DDP steps over gloo."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM, Trainer

import whichdevice as wd
from tiny_models import RandomTokens, tiny_config


def main() -> None:
    out_dir = Path(sys.argv[1])
    res = wd.resolve_device(task="training")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    args = wd.training_arguments(
        output_dir=str(out_dir / "trainer"),
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train()
    # Every rank must end with the same weights: DDP averaged the gradients.
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
    report = {
        "rank": res.distributed.rank if res.distributed else None,
        "local_rank": res.distributed.local_rank if res.distributed else None,
        "world_size": res.distributed.world_size if res.distributed else None,
        "device": res.device,
        "backend": res.backend.name,
        "ddp_backend": res.training_kwargs().get("ddp_backend"),
        "args_device": str(args.device),
        "args_ddp_backend": args.ddp_backend,
        "process_group": dist.get_backend() if dist.is_initialized() else None,
        "pg_world_size": dist.get_world_size() if dist.is_initialized() else None,
        "steps": trainer.state.global_step,
        "checksum": checksum,
        "node_rank": os.environ.get("GROUP_RANK"),
    }
    (out_dir / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    # Skip interpreter teardown. Freeing DDP's reducer there destroys torch's gloo process group,
    # whose destructor joins a worker thread that may be waiting for the GIL the main thread holds
    # (seen as a hang, and as "terminate called without an active exception", with torch 2.13 and
    # transformers 4.57). The report is written; nothing else is owed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
