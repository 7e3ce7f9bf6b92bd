"""Ray Train with two CPU workers, each running scripts/ddp_train.py's ``run`` (the recipe in docs/distributed.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

SCRIPTS = Path(__file__).resolve().parent


def train_loop_per_worker(config: dict[str, str]) -> None:
    # Ray has set LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR/PORT and ACCELERATE_TORCH_DEVICE, and
    # started the gloo process group; whichdevice and the Trainer join it.
    sys.path.insert(0, str(SCRIPTS))
    from ddp_train import run
    from ray.train.huggingface.transformers import prepare_trainer

    run(Path(config["out"]), prepare=prepare_trainer)


def main(out: Path) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(out / "ray"), name="whichdevice"),
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
