"""What does whichdevice plan for a big model it has not downloaded, and for pre-quantized checkpoints?

    python benchmarks/hub_plans.py                     # both parts: about 1-2 minutes, no timing
    python benchmarks/hub_plans.py --only hub          # hub, quantized (repeatable)

``hub`` (issue 45): a local Hub (tests/hub_server.py) serves header-only checkpoints of Llama 3.1 8B and
70B and Mixtral 8x7B (tests/hub_fixtures.py: their published configs, the tensors their checkpoints
hold, ~5 GB shards). For each model it prints the bytes whichdevice fetched (as the server counted
them, and the tensor bytes sent: 0), the weights term beside ``accelerate estimate-memory``'s (run for
real against the local Hub through HF_ENDPOINT) and hf-mem's (hf-mem hard-codes huggingface.co, so its
formula, the sum of every header tensor's elements x dtype bytes, is computed; with hf-mem importable
its own ``parse_safetensors_metadata`` runs on the same headers), then ``whichdevice plan``'s table
for the default machines at batch 1 x 4096 inference and for a full fine-tune at the same size
(docs/placement.md, "The figures: three large models from a local Hub").

``quantized``: a 7B Llama config.json (no weights) with each method's quantization_config as
transformers' own config class writes it (GPTQ, AWQ, FP8, bitsandbytes 4-bit, MXFP4, torchao or quanto
on the CPU), resolved on a simulated T4, a simulated A100 and this machine's CPU with the packages
installed here (and simulated as installed where they are not): the size, the device, the dtype, the
quantization keywords and the refusal where there is one. Then a simulated T4's dtype for a bf16
checkpoint of several architectures: the fp16 allow-list at work (docs/quantization-and-kernels.md).

Prints the machine line, then Markdown; ``--json PATH`` writes the answers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

import whichdevice as wd
from whichdevice.attention.kernels import transformers_kernels_range
from whichdevice.core.packages import simulated_packages
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.prequantized import package_usable
from whichdevice.model.facts import estimate_model_size
from whichdevice.testing import simulate

sys.path.insert(0, str(harness.ROOT / "tests"))  # the local Hub and its fixtures are the test suite's

PARTS = ("hub", "quantized")
MODELS = ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "mistralai/Mixtral-8x7B-v0.1")
GB = 1e9


def _accelerate(model: str, endpoint: str) -> str:
    """accelerate estimate-memory's float16 row for ``model`` against the local Hub (its own command)."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    # Its own Hugging Face cache: the config.json it downloads would otherwise make the model a cached
    # id, which whichdevice then reads without its safetensors headers (issue 58: the Mixtral table's
    # decode limits were priced over every weight, not the routed experts, because of this).
    env.pop("HF_HUB_CACHE", None)
    env["HF_HOME"] = tempfile.mkdtemp(prefix="accelerate-hf-")
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


HARDWARE = {
    "T4": "cuda:1,cc=7.5,name=Tesla T4,mem=15GiB",
    "A100": "cuda:1,cc=8.0,name=NVIDIA A100-SXM4-80GB,mem=80GiB",
    "this CPU": None,
}
SEVEN_B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    dtype="float16",
)


def _configs() -> dict[str, tuple[str, dict[str, Any]]]:
    """label -> (model_type, quantization_config dict) as transformers' config classes write them."""
    from transformers import AwqConfig, BitsAndBytesConfig, FineGrainedFP8Config, GPTQConfig, Mxfp4Config, QuantoConfig

    methods = {
        "GPTQ 4-bit g128": ("llama", GPTQConfig(bits=4, group_size=128).to_dict()),
        "AWQ 4-bit g128": ("llama", AwqConfig(bits=4, group_size=128).to_dict()),
        "FP8 (block 128)": ("llama", FineGrainedFP8Config().to_dict()),
        "bitsandbytes 4-bit": ("llama", BitsAndBytesConfig(load_in_4bit=True).to_dict()),
        "MXFP4 (gpt_oss)": ("gpt_oss", Mxfp4Config().to_dict()),
    }
    try:
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        methods["torchao int8 weight-only (CPU)"] = ("llama", TorchAoConfig(Int8WeightOnlyConfig()).to_dict())
    except ImportError:  # torchao is not installed: quanto's config needs no package to be written
        methods["quanto int8 (CPU)"] = ("llama", QuantoConfig(weights="int8").to_dict())
    return methods


def _folder(root: Path, name: str, model_type: str, quantization: dict[str, Any] | None, dtype: str) -> str:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **SEVEN_B).to_dict() if model_type != "gpt_oss" else _gpt_oss()
    config["dtype"] = dtype
    if quantization is not None:
        config["quantization_config"] = quantization
    folder = root / name.replace(" ", "_").replace("(", "").replace(")", "")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _gpt_oss() -> dict[str, Any]:
    from transformers import GptOssConfig

    # gpt-oss-20b's shape (openai/gpt-oss-20b config.json): 24 layers, 32 experts, 4 active.
    return GptOssConfig(num_hidden_layers=24, num_local_experts=32, hidden_size=2880, intermediate_size=2880).to_dict()


def _answer(path: str, spec: str | None, packages: dict[str, str] | None = None) -> str:
    try:
        with simulated_packages(packages or {}):
            if spec is None:
                res = wd.resolve_device(model=path)
            else:
                with simulate(spec):
                    res = wd.resolve_device(model=path)
    except wd.DeviceError as err:
        return f"refused ({type(err).__name__}): {err}"
    kwargs = {k: v for k, v in res.model_kwargs().items() if k not in ("device_map", "dtype")}
    quant = "none (the checkpoint's own quantization_config)" if "quantization_config" not in kwargs else kwargs
    model = next((s.message for s in res.trace if s.topic == "model" and "parameters" in s.message), "")
    return f"{res.device}, {res.dtype_name}; kwargs: {quant}; {model}"


def hub_part(args: argparse.Namespace) -> dict[str, Any]:
    from hub_fixtures import large_repos
    from hub_server import HeaderOnly, HubServer

    os.environ.setdefault("WHICHDEVICE_CALIBRATION", "off")
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()
    repos = large_repos()
    found: dict[str, Any] = {"fetched": [], "weights": [], "plans": []}
    with HubServer() as hub:
        for name in MODELS:
            hub.add(name, repos[name])
        os.environ["HF_ENDPOINT"] = hub.url
        from whichdevice.model.facts import read_model_facts
        from whichdevice.report.plan import plan_hardware

        rows, facts = [], {}
        for name in MODELS:
            hub.sent.clear()
            facts[name] = read_model_facts(name)
            heads = {f: c for f, c in repos[name].items() if isinstance(c, HeaderOnly)}
            tensor_bytes = sum(max(0, hub.furthest(f) + 1 - len(c.head)) for f, c in heads.items())
            hf_mem_reads = sum(min(100_001, c.size) for c in heads.values())
            rows.append([name, f"{len(heads)} shards", f"{hub.total_bytes():,} ({hub.file_bytes():,} of files)",
                         tensor_bytes, f"{hf_mem_reads:,} (100,001 per shard)"])  # fmt: skip
            found["fetched"].append({"model": name, "bytes": hub.total_bytes(), "tensor_bytes": tensor_bytes})
        head = ["model", "files", "bytes fetched (server count)", "of which tensor bytes", "hf-mem's first reads"]
        print(harness.table(head, rows, markdown=True) + "\n")
        rows = []
        for name in MODELS:
            size = facts[name].size
            headers = [dict(t) for _, t in facts[name].headers]
            acc = _accelerate(name, hub.url)
            rows.append([name, f"{size.bytes_in('bfloat16') / GB:.2f} GB ({size.parameters / 1e9:.2f}B params)",
                         f"{_hf_mem(headers) / GB:.2f} GB", acc])  # fmt: skip
            found["weights"].append(dict(zip(("model", "whichdevice", "hf_mem", "accelerate"), rows[-1], strict=True)))
        accelerate = "accelerate estimate-memory float16 (bf16 has the same bytes; it offers no bfloat16)"
        print(
            harness.table(
                ["model", "whichdevice weights (bf16)", "hf-mem (headers, as stored)", accelerate], rows, True
            )
        )
        for task in ("inference", "training"):
            for name in MODELS:
                try:
                    plan = plan_hardware(name, task=task, batch_size=1, max_length=4096)
                except Exception as err:  # one plan's failure is a finding: the other plans still print
                    text = f"plan_hardware raised {type(err).__name__}: {err}"
                else:
                    text = re.sub(r"\n+$", "", plan.table())
                print(f"\n{name}, {task}, batch 1 x 4096\n\n{text}")
                found["plans"].append({"model": name, "task": task, "table": text})
    return found


def quantized_part(args: argparse.Namespace) -> dict[str, Any]:
    found: dict[str, Any] = {"prequantized": {}, "fp16_allow_list": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("\n## Pre-quantized 7B checkpoints (packages as installed here)\n")
        for label, (model_type, quantization) in _configs().items():
            path = _folder(root, label, model_type, quantization, "bfloat16" if model_type == "gpt_oss" else "float16")
            size = estimate_model_size(path)
            described = size.quantized.describe() if size.quantized else "unquantized"
            print(f"### {label}: {described}; {format_bytes(size.bytes_in('float16'))} with fp16 non-quantized weights")
            answers = found["prequantized"][label] = {where: _answer(path, spec) for where, spec in HARDWARE.items()}
            for where, answer in answers.items():
                print(f"- {where}: {answer}")
            needs = size.quantized.needs if size.quantized else None
            missing = [p for p in needs.packages if not package_usable(p)] if needs else []
            if missing:
                # The same question with the method's packages simulated as installed (kernels: in range).
                fake = {p: (transformers_kernels_range()[0] or "0") if p == "kernels" else "99.0" for p in missing}
                for where, spec in HARDWARE.items():
                    answer = answers[f"{where}, with {', '.join(missing)} installed (simulated)"] = _answer(
                        path, spec, fake
                    )
                    print(f"- {where}, with {', '.join(missing)} installed (simulated): {answer}")
            print()
        print("## bf16 checkpoints on a simulated T4 (fp16 allow-list)\n")
        for model_type in ("gemma3_text", "qwen3_moe", "glm4_moe", "gpt_oss", "llama"):
            folder = root / f"bf16-{model_type}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({"model_type": model_type, "dtype": "bfloat16"}))
            with simulate(HARDWARE["T4"]):
                res = wd.resolve_device(model=str(folder), device_map="cuda:0")
                train = wd.resolve_device(model=str(folder), device_map="cuda:0", task="training")
            line = next(s.message for s in res.trace if s.topic == "dtype" and not s.message.startswith("checkpoint"))
            said = found["fp16_allow_list"][model_type] = (
                f"{res.dtype_name}; training {train.training_kwargs()}; {line}"
            )
            print(f"- {model_type}: {said}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=PARTS, help="run only this part (repeatable)")
    harness.add_json_argument(ap, default=str(harness.RESULTS / "hub_plans.json"))
    args = ap.parse_args()
    machine = harness.machine()
    print(harness.machine_line(machine) + "\n")
    runs = {"hub": hub_part, "quantized": quantized_part}
    found = {part: runs[part](args) for part in PARTS if not args.only or part in args.only}
    harness.write_json(args.json, {"machine": machine, **found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
