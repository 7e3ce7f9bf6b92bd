"""Measured per-rank peaks of DDP and FSDP training on 2 CPU processes against whichdevice's strategy estimates.

    python benchmarks/strategy_memory.py          # batch 4 x 128 tokens, then 2 x 256 (about 1-2 minutes)

Each strategy runs as ``torchrun --nproc-per-node=2 benchmarks/strategy_rank.py`` over gloo (see that
file for what is measured). The estimate is memory/strategy.py's per-device figure for 2 devices in
float32 (the CPU has no mixed precision here): DDP's W + the job at its step's peak
(memory/training_job.py) + buckets, FSDP's (W + G + O)/2 + gathered units + A. The script prints both
per rank, checks that the ranks end with equal weights, and exits 1 if an estimate is below a measured
peak.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

CASES = [(4, 128), (2, 256)]


def _estimates(batch: int, length: int) -> dict[str, int]:
    from strategy_rank import SMALL
    from transformers import LlamaConfig

    from whichdevice.core.job import Job
    from whichdevice.memory.strategy import Priced, plan_strategies
    from whichdevice.memory.training_job import setup_weights, training_memory
    from whichdevice.memory.training_records import TrainingSetup
    from whichdevice.model.facts import estimate_model_size, model_shape
    from whichdevice.model.layers import layer_classes

    config = LlamaConfig(**SMALL)
    size, shape = estimate_model_size(config), model_shape(config)
    job = Job("training", batch, length)
    lora, qlora = TrainingSetup("lora"), TrainingSetup("qlora")
    plan = plan_strategies(
        params=size.parameters, shape=shape, dtype="float32", compute_dtype="float32",
        full=training_memory(size, shape, job, TrainingSetup("full")),
        sharded=training_memory(size, shape, job, TrainingSetup("full", sharded=True)),
        lora=Priced(setup_weights(size, lora), training_memory(size, shape, job, lora)),
        qlora=Priced(setup_weights(size, qlora), training_memory(size, shape, job, qlora)),
        devices=2, budget=1 << 50, cpu_memory=1 << 50, deepspeed=False, layer_classes=layer_classes(config).names,
    )  # fmt: skip
    return {s.key: s.per_device for s in plan.strategies if s.key in ("ddp", "fsdp")} | {
        f"{s.key}_formula": s.formula for s in plan.strategies if s.key in ("ddp", "fsdp")
    }  # type: ignore[return-value]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(how: str, batch: int, length: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as out:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_port()}"]
        command = [*torchrun, str(ROOT / "benchmarks" / "strategy_rank.py"), how, out, str(batch), str(length)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ})
        if done.returncode != 0:
            raise SystemExit(f"{how} failed:\n{done.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in (0, 1)]


def main() -> int:
    bad = 0
    mib = 1024**2
    for batch, length in CASES:
        estimate = _estimates(batch, length)
        for how in ("ddp", "fsdp"):
            ranks = _run(how, batch, length)
            equal = len({round(r["checksum"], 6) for r in ranks}) == 1
            for r in ranks:
                ok = estimate[how] >= r["peak"]
                bad += not ok
                print(
                    f"{how:4} batch {batch} x {length} rank {int(r['rank'])}: measured {r['peak'] / mib:7.1f} MiB "
                    f"(holds {r['held'] / mib:5.1f} MiB of weights), estimate {estimate[how] / mib:7.1f} MiB "
                    f"({estimate[how] / r['peak']:.2f}x){'' if ok else '  ESTIMATE BELOW MEASURED'}"
                )
            print(f"     ranks end with equal weights: {equal}; formula: {estimate[how + '_formula']}")
            bad += not equal
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
