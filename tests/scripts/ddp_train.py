"""One rank of a launch: resolve, build TrainingArguments, train 3 steps, and write what it saw.

Started by torchrun, accelerate launch, Ray Train (through ``run``) or by the tests themselves with
a scheduler's variables. Writes ``rank<N>.json`` into the output folder: whichdevice's answer, what
transformers and torch did with it (args.device, world size, process-group backend, DDP wrapping,
the samples this rank trained on, a checksum of the weights), or the DeviceError it stopped with.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import whichdevice as wd

if TYPE_CHECKING:
    from transformers import Trainer

# Where a rank's number comes from, for the file name, before anything is resolved.
_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _rank_from_environment() -> str:
    return next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), "0")


def run(out_dir: Path, prepare: Callable[[Trainer], Trainer] | None = None) -> dict[str, Any]:
    """Train on this rank and return the report (also written to ``out_dir``).

    ``prepare`` gets the Trainer before training (Ray Train's ``prepare_trainer``).
    """
    name = out_dir / f"rank{_rank_from_environment()}.json"
    try:
        res = wd.resolve_device(task="training")
        args = wd.training_arguments(
            output_dir=str(out_dir / "trainer"),
            max_steps=3,
            per_device_train_batch_size=2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
        )
    except wd.DeviceError as exc:
        report: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)}
        name.write_text(json.dumps(report))
        return report
    # Imported only now, so that a refusal comes back in the time of resolve_device() alone.
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, Trainer

    from tiny_models import RandomTokens, tiny_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    if prepare is not None:
        trainer = prepare(trainer)
    trainer.train()
    # The samples this rank's dataloader gives in one epoch (the first tokens identify a sample).
    shard = [
        "-".join(map(str, ids[:4].tolist())) for batch in trainer.get_train_dataloader() for ids in batch["input_ids"]
    ]
    # Every rank must end with the same weights: DDP averaged the gradients.
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
    ctx = res.distributed
    report = {
        "launcher": ctx.launcher if ctx else None,
        "rank": ctx.rank if ctx else None,
        "local_rank": ctx.local_rank if ctx else None,
        "world_size": ctx.world_size if ctx else None,
        "device": res.device,
        "backend": res.backend.name,
        "ddp_backend": res.training_kwargs().get("ddp_backend"),
        "args_device": str(args.device),
        "args_world_size": args.world_size,
        "args_ddp_backend": args.ddp_backend,
        "process_group": dist.get_backend() if dist.is_initialized() else None,
        "pg_world_size": dist.get_world_size() if dist.is_initialized() else None,
        "ddp_wrapped": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
        "shard": shard,
        "steps": trainer.state.global_step,
        "checksum": checksum,
        "trace": [f"{s.topic}: {s.message}" for s in res.trace if s.topic in ("distributed", "device", "warning")],
    }
    name.write_text(json.dumps(report))
    return report


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    # Skip interpreter teardown. Freeing DDP's reducer there destroys torch's gloo process group,
    # whose destructor joins a worker thread that may be waiting for the GIL the main thread holds
    # (seen as a hang, and as "terminate called without an active exception", with torch 2.13 and
    # transformers 4.57). The report is written; nothing else is owed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
