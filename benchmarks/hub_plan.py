"""Issue 45's figures: a Hub model planned from its metadata, against a local Hub serving header-only
checkpoints of Llama 3.1 8B and 70B and Mixtral 8x7B (tests/hub_server.py, tests/hub_fixtures.py).

    python benchmarks/hub_plan.py            # prints Markdown: bytes, weights terms, plan tables

For each model it prints the bytes whichdevice fetched (as the server counted them, and the tensor
bytes sent: 0), the weights term beside ``accelerate estimate-memory``'s (run for real against the
local Hub through HF_ENDPOINT) and hf-mem's (hf-mem hard-codes huggingface.co, so its formula, the
sum of every header tensor's elements x dtype bytes, is computed; with hf-mem importable its own
``parse_safetensors_metadata`` runs on the same headers), then ``whichdevice plan``'s table for the
default machines at batch 1 x 4096 inference and for a full fine-tune at the same size.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hub_fixtures import large_repos
from hub_server import HeaderOnly, HubServer

MODELS = ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "mistralai/Mixtral-8x7B-v0.1")
GB = 1e9


def _accelerate(model: str, endpoint: str) -> str:
    """accelerate estimate-memory's float16 row for ``model`` against the local Hub (its own command)."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    command = ["accelerate", "estimate-memory", model, "--library_name", "transformers", "--dtypes", "float16"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        return f"failed: {(done.stderr or done.stdout).strip().splitlines()[-1][:200]}"
    row = next((line for line in done.stdout.splitlines() if "float16" in line), "")
    cells = [c.strip() for c in row.strip("│|").split("│")] if "│" in row else row.split("|")
    return " / ".join(c for c in cells[1:] if c) or done.stdout[-300:]


def _hf_mem(headers: list[dict]) -> int:
    try:
        from hf_mem.safetensors import parse_safetensors_metadata

        return int(parse_safetensors_metadata({str(i): h for i, h in enumerate(headers)}).bytes_count)
    except ImportError:
        from whichdevice.core.dtypes import SAFETENSORS_BITS

        return sum(
            _numel(info["shape"]) * SAFETENSORS_BITS[info["dtype"]] // 8
            for header in headers
            for name, info in header.items()
            if name != "__metadata__"
        )


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    os.environ.setdefault("WHICHDEVICE_CALIBRATION", "off")
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()
    repos = large_repos()
    with HubServer() as hub:
        for name in MODELS:
            hub.add(name, repos[name])
        os.environ["HF_ENDPOINT"] = hub.url
        from whichdevice.model.facts import read_model_facts
        from whichdevice.report.plan import plan_hardware

        print("| model | files | bytes fetched (server count) | of which tensor bytes | hf-mem's first reads |")
        print("|---|---|---|---|---|")
        facts = {}
        for name in MODELS:
            hub.sent.clear()
            facts[name] = read_model_facts(name)
            heads = {f: c for f, c in repos[name].items() if isinstance(c, HeaderOnly)}
            tensor_bytes = sum(max(0, hub.furthest(f) + 1 - len(c.head)) for f, c in heads.items())
            hf_mem_reads = sum(min(100_001, c.size) for c in heads.values())
            print(
                f"| {name} | {len(heads)} shards | {hub.total_bytes():,} ({hub.file_bytes():,} of files) | "
                f"{tensor_bytes} | {hf_mem_reads:,} (100,001 per shard) |"
            )
        print()
        accelerate = "accelerate estimate-memory float16 (bf16 has the same bytes; it offers no bfloat16)"
        print(f"| model | whichdevice weights (bf16) | hf-mem (headers, as stored) | {accelerate} |")
        print("|---|---|---|---|")
        for name in MODELS:
            size = facts[name].size
            headers = [dict(t) for _, t in facts[name].headers]
            acc = _accelerate(name, hub.url)
            print(f"| {name} | {size.bytes_in('bfloat16') / GB:.2f} GB ({size.parameters / 1e9:.2f}B params) | "
                  f"{_hf_mem(headers) / GB:.2f} GB | {acc} |")  # fmt: skip
        for task in ("inference", "training"):
            for name in MODELS:
                plan = plan_hardware(name, task=task, batch_size=1, max_length=4096)
                print(f"\n{name}, {task}, batch 1 x 4096\n")
                print(re.sub(r"\n+$", "", plan.table()))


if __name__ == "__main__":
    main()
