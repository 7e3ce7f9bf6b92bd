"""One rank of a 2-process CPU run: whichdevice's plan here, then Trainer with the FSDP settings it emits.

    torchrun --nproc-per-node=2 tests/scripts/fsdp_train.py OUT_DIR MODEL_DIR

On this CPU whichdevice plans DDP (accelerate ignores fsdp for CPU processes, so FSDP is not
offered). The FSDP keywords it hands an accelerator for the same model (the plan for 2 devices whose
budget fits FSDP but not DDP) are then passed to training_arguments() and Trainer trains 3 steps;
the rank writes what accelerate made of them and a checksum of its weights to OUT_DIR/rank<N>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import whichdevice as wd


def main() -> None:
    out, model_dir = Path(sys.argv[1]), sys.argv[2]
    res = wd.resolve_device(task="training", model=model_dir)
    from whichdevice.core.job import Job
    from whichdevice.core.packages import simulated_packages
    from whichdevice.memory.training_plan import plan_training
    from whichdevice.model.layers import layer_classes

    layers = layer_classes(model_dir).names

    # The FSDP row's keywords: without deepspeed, ZeRO-2 (before FSDP in the order) is no candidate.
    with simulated_packages({"deepspeed": None}):
        roomy = plan_training(
            model_dir, Job("training"), "float32", "float32", 2, 1 << 50, 1 << 50, "cuda", layers=layers
        )
        by = {s.key: s.per_device for s in roomy.strategies}
        plan = plan_training(
            model_dir, Job("training"), "float32", "float32", 2, (by["ddp"] + by["fsdp"]) // 2, 1 << 50, layers=layers
        )
    kwargs = plan.kwargs()
    import torch
    from transformers import AutoModelForCausalLM, Trainer

    from tiny_models import RandomTokens

    args = wd.training_arguments(output_dir=str(out / "trainer"), resolution=res, max_steps=3,
                                 per_device_train_batch_size=2, save_strategy="no", report_to=[], **kwargs)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **res.model_kwargs())
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    trainer.train()
    checksum = float(sum(p.detach().double().sum() for p in trainer.model.parameters()))
    report = {
        "rank": int(os.environ["RANK"]),
        "here": res.training_plan.chosen.key if res.training_plan and res.training_plan.chosen else None,
        "here_fsdp": next((s.line(1) for s in res.training_plan.strategies if s.key == "fsdp"), None)
        if res.training_plan
        else None,
        "emitted": plan.chosen.key if plan.chosen else None,
        "kwargs": kwargs,
        "plugin_args": {k: str(v) for k, v in (args.fsdp_plugin_args or {}).items()},
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapped": type(trainer.model_wrapped).__name__,
        "checksum": checksum,
    }
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
