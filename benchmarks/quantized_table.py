"""What whichdevice answers for pre-quantized 7B checkpoints and for bf16 checkpoints on fp16-only GPUs.

Run: ``PYTHONPATH=src python benchmarks/quantized_table.py``. Builds a 7B Llama config.json (no weights)
with each method's quantization_config as transformers' own config class writes it, resolves it on a
simulated T4, a simulated A100 and this machine's CPU with the packages installed here, and prints
the size, the device, the dtype, the quantization keywords and the refusal where there is one. Then
a simulated T4's dtype for a bf16 checkpoint of several architectures (the fp16 allow-list at work).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import whichdevice as wd
from whichdevice.attention.kernels import transformers_kernels_range
from whichdevice.core.packages import simulated_packages
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.prequantized import package_usable
from whichdevice.model.facts import estimate_model_size
from whichdevice.testing import simulate

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


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("## Pre-quantized 7B checkpoints (packages as installed here)\n")
        for label, (model_type, quantization) in _configs().items():
            path = _folder(root, label, model_type, quantization, "bfloat16" if model_type == "gpt_oss" else "float16")
            size = estimate_model_size(path)
            described = size.quantized.describe() if size.quantized else "unquantized"
            print(f"### {label}: {described}; {format_bytes(size.bytes_in('float16'))} with fp16 non-quantized weights")
            for where, spec in HARDWARE.items():
                print(f"- {where}: {_answer(path, spec)}")
            needs = size.quantized.needs if size.quantized else None
            missing = [p for p in needs.packages if not package_usable(p)] if needs else []
            if missing:
                # The same question with the method's packages simulated as installed (kernels: in range).
                fake = {p: (transformers_kernels_range()[0] or "0") if p == "kernels" else "99.0" for p in missing}
                for where, spec in HARDWARE.items():
                    print(f"- {where}, with {', '.join(missing)} installed (simulated): {_answer(path, spec, fake)}")
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
            print(f"- {model_type}: {res.dtype_name}; training {train.training_kwargs()}; {line}")


if __name__ == "__main__":
    main()
