"""Training placement on several processes, run for real: 2 torchrun processes on this CPU (gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import save_tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fsdp_train.py"
_LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_cpu_ranks_train_with_the_emitted_fsdp_settings(tmp_path):
    model = save_tiny_llama(tmp_path / "model", tokenizer=False)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH and not k.startswith("WHICHDEVICE")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
               str(SCRIPT), str(tmp_path), str(model)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        # Here (CPU processes) whichdevice plans DDP and says why FSDP is not offered...
        assert r["here"] == "ddp" and "accelerate ignores fsdp on CPU" in r["here_fsdp"]
        # ...while the settings it emits for an accelerator parse into accelerate's FSDP plugin arguments.
        assert r["emitted"] == "fsdp" and r["kwargs"]["fsdp"] is True
        assert r["plugin_args"]["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
        assert r["distributed_type"] in ("DistributedType.MULTI_CPU", "DistributedType.FSDP")
    # The ranks end with equal weights.
    assert len({round(r["checksum"], 6) for r in reports}) == 1
