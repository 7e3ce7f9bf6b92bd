"""One rank of a 2-process CPU launch: whichdevice's plan, then the Trainer built with its keywords, read back.

    accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 tests/scripts/strategy_train.py OUT MODEL

Resolves with the model, builds training_arguments() and loads the model with res.model_kwargs(), as a
user's script does, then builds a Trainer (no step: what it will run is decided when it is built) and
writes OUT/rank<N>.json: the strategy the resolution announces and what the Trainer's accelerator runs
(is_deepspeed_enabled, is_fsdp_enabled, distributed_type, the ZeRO stage), or the error that stopped it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import whichdevice as wd


def main(out: Path, model_dir: str) -> dict[str, Any]:
    report: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0"))}
    try:
        res = wd.resolve_device(task="training", model=model_dir)
        plan = res.training_plan
        report.update(
            chosen=plan.chosen.key if plan is not None and plan.chosen is not None else None,
            launched=plan.launched if plan is not None else None,
            warnings=[s.message for s in res.trace if s.topic == "warning"],
        )
        args = wd.training_arguments(output_dir=str(out / "trainer"), resolution=res, max_steps=1,
                                     per_device_train_batch_size=2, save_strategy="no", report_to=[])  # fmt: skip
        from transformers import AutoModelForCausalLM, Trainer

        from tiny_models import RandomTokens

        kwargs = res.model_kwargs()
        report["model_kwargs"] = sorted(kwargs)
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(n=8))
        state = trainer.accelerator.state
        plugin = getattr(state, "deepspeed_plugin", None)
        report.update(
            deepspeed=trainer.is_deepspeed_enabled,
            fsdp=trainer.is_fsdp_enabled,
            distributed_type=str(trainer.accelerator.distributed_type).rsplit(".", 1)[-1],
            zero_stage=plugin.zero_stage if plugin is not None else None,
        )
    except Exception as exc:
        report.update(error=type(exc).__name__, message=str(exc)[:500], where=traceback.format_exc()[-1500:])
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))
    return report


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    # As ddp_train.py: skip interpreter teardown (gloo's destructor can hang on the GIL); the report is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
