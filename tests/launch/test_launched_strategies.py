"""What the resolution announces is what the Trainer runs: read back from a real Trainer in launched processes.

Each case starts ``accelerate launch`` with two CPU processes running scripts/strategy_train.py, which
resolves with a tiny model, loads it with ``res.model_kwargs()`` and builds a Trainer with
``training_arguments()``; the Trainer's accelerator then says what it runs (accelerate 1.16 state.py:
DeepSpeed on CPU processes too, FSDP only on accelerators, so a CPU FSDP launch trains with DDP).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launches import Command, launch_together
from tiny_models import save_tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "strategy_train.py"

pytestmark = pytest.mark.slow

# The plan the resolution announces -> what the Trainer's accelerator must run.
RUNS = {
    "ddp": {"distributed_type": "MULTI_CPU", "deepspeed": False, "fsdp": False, "zero_stage": None},
    "zero2": {"distributed_type": "DEEPSPEED", "deepspeed": True, "fsdp": False, "zero_stage": 2},
    "zero3": {"distributed_type": "DEEPSPEED", "deepspeed": True, "fsdp": False, "zero_stage": 3},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("strategies") / "tiny", tokenizer=False))


def _launched(tmp_path: Path, tiny: str, options: list[str]) -> list[dict]:
    def commands(port: int) -> list[Command]:
        launch = [sys.executable, "-m", "accelerate.commands.launch", *options, "--num_processes=2",
                  "--num_machines=1", f"--main_process_port={port}", "--mixed_precision=no", "--dynamo_backend=no",
                  str(SCRIPT), str(tmp_path), tiny]  # fmt: skip
        # No accelerate config file of the user's: HF_HOME points at an empty folder.
        return [(launch, {"HF_HOME": str(tmp_path / "hf")})]

    launch_together(tmp_path, commands, timeout=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize(
    ("options", "announced"),
    [
        (["--multi_gpu"], "ddp"),
        (["--use_fsdp", "--fsdp_version=2"], "ddp"),
        (["--use_deepspeed", "--zero_stage=2"], "zero2"),
        (["--use_deepspeed", "--zero_stage=3"], "zero3"),
    ],
    ids=["ddp", "fsdp", "zero2", "zero3"],
)
def test_the_announced_strategy_is_the_one_trainer_runs(tmp_path: Path, tiny: str, options, announced):
    for rank in _launched(tmp_path, tiny, options):
        assert "error" not in rank, f"{rank.get('message')}\n{rank.get('where')}"
        assert rank["chosen"] == announced, rank
        ran = {k: rank[k] for k in RUNS[announced]}
        assert ran == RUNS[announced], rank
        # ZeRO-3 loads inside deepspeed.zero.Init, which refuses a device_map; the others load on the CPU.
        assert ("device_map" in rank["model_kwargs"]) == (announced != "zero3")
        assert (rank["launched"] is not None) == announced.startswith("zero")


def test_an_fsdp_launch_that_trainer_refuses_on_a_cpu_is_warned(tmp_path: Path, tiny: str):
    """accelerate launch --use_fsdp's defaults (sync_module_states, cpu_ram_efficient_loading) make
    accelerate's FSDP plugin raise on a CPU: the resolution says so, and the Trainer does raise."""
    for rank in _launched(tmp_path, tiny, ["--use_fsdp"]):
        assert rank["chosen"] == "ddp"
        assert any("FullyShardedDataParallelPlugin" in w for w in rank["warnings"]), rank["warnings"]
        assert rank.get("error") == "RuntimeError" and "sync_module_states=True" in rank["message"], rank
