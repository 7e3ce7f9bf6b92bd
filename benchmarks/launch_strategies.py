"""An 8B Llama on 8 x 80 GiB under each launch: what whichdevice passes, what runs, and the estimates.

    python benchmarks/launch_strategies.py [MODEL_FOLDER]

For plain torchrun and for `accelerate launch` with a DDP, FSDP, ZeRO-2 and ZeRO-3 config (the
variables accelerate 1.16 exports for each: utils/launch.py), rank 0 of 8 resolves with
simulate("cuda:8,mem=80GiB,cc=9.0"). Printed per launch: the strategy keywords training_kwargs()
passes, the strategy that then runs (TrainingArguments built for real on this CPU with those keywords
under those variables, and accelerate's FSDP plugin from the variables where FSDP is launched), the
per-device estimate, and DeepSpeed's own estimators (estimate_zero2/3_model_states_mem_needs_all_cold,
their per-GPU figure) for the same parameters and 8 GPUs on one node. MODEL_FOLDER: a checkpoint folder
(config.json, with or without safetensors); default: a Llama 3 8B config written to a temporary folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

_TORCHRUN = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none")  # fmt: skip
_ACCELERATE = dict(ACCELERATE_DYNAMO_BACKEND="NO", ACCELERATE_MIXED_PRECISION="bf16", ACCELERATE_USE_CPU="False")
LAUNCHES: dict[str, dict[str, str]] = {
    "torchrun": {},
    "accelerate DDP": _ACCELERATE,
    "accelerate FSDP": {**_ACCELERATE, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                        "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_OFFLOAD_PARAMS": "false"},
    "accelerate ZeRO-2": {**_ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
    "accelerate ZeRO-3": {**_ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
}  # fmt: skip


def llama_8b(folder: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"], dtype="bfloat16",
                ).save_pretrained(folder)  # fmt: skip
    return folder


@contextlib.contextmanager
def environment(variables: dict[str, str]) -> Any:
    before = dict(os.environ)
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def what_runs(kwargs: dict[str, Any], out: str) -> str:
    """The strategy TrainingArguments (and accelerate's plugin from the variables) holds with ``kwargs``."""
    from transformers import TrainingArguments

    strategy = {k: v for k, v in kwargs.items() if k in ("fsdp", "fsdp_config", "deepspeed")}
    with environment({}):
        for name in _TORCHRUN:
            os.environ.pop(name, None)  # one CPU process builds it here
        args = TrainingArguments(out, use_cpu=True, report_to=[], **strategy)
        if args.deepspeed_plugin is not None:
            return f"DeepSpeed ZeRO-{args.deepspeed_plugin.zero_stage}"
        if args.fsdp_plugin_args is not None:
            return f"FSDP{args.fsdp_plugin_args.get('fsdp_version', 1)} (from fsdp=)"
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
            return f"FSDP{plugin.fsdp_version} reshard_after_forward={plugin.reshard_after_forward} (the launch's)"
        return "DDP"


def deepspeed_figures(params: int, largest: int, gpus: int) -> tuple[float, float]:
    """Per-GPU GB that deepspeed's _all_cold estimators print (no offload) for ZeRO-2 and ZeRO-3."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    def printed(call: Any, **kw: Any) -> dict[str, float]:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            call(total_params=params, num_gpus_per_node=gpus, num_nodes=1, **kw)
        rows = [line.split("|") for line in buffer.getvalue().splitlines() if line.count("|") == 2][1:]
        return {options.strip(): float(gpu.strip().removesuffix("GB")) for _, gpu, options in rows}

    zero2 = printed(estimate_zero2_model_states_mem_needs_all_cold)["offload_optimizer=none"]
    zero3 = printed(estimate_zero3_model_states_mem_needs_all_cold, largest_layer_params=largest)
    return zero2, zero3["offload_param=none, offload_optimizer=none, zero_init=1"]


def main() -> None:
    import whichdevice as wd
    from whichdevice.model.facts import estimate_model_size
    from whichdevice.testing import simulate

    work = tempfile.mkdtemp()
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else llama_8b(Path(work) / "llama-8b")
    size = estimate_model_size(str(folder))
    zero2, zero3 = deepspeed_figures(size.parameters, size.largest_module, 8)
    print(f"model: {folder} ({size.parameters / 1e9:.2f}B parameters, largest module {size.largest_module / 1e6:.0f}M)")
    print(
        f"DeepSpeed's estimators, 8 GPUs on one node, no offload: ZeRO-2 {zero2:.2f} GB, ZeRO-3 {zero3:.2f} GB per GPU"
    )
    print(
        "| launch | keywords passed | strategy that runs | whichdevice's estimate per device | DeepSpeed's estimator |"
    )
    print("|---|---|---|---|---|")
    for name, variables in LAUNCHES.items():
        with environment({**_TORCHRUN, **variables}), simulate("cuda:8,mem=80GiB,cc=9.0"):
            res = wd.resolve_device(model=str(folder), task="training", quantize=None)
            kwargs = res.training_kwargs()
            runs = what_runs(kwargs, str(Path(work) / "out"))
        plan = res.training_plan
        chosen = plan.chosen if plan is not None else None
        passed = {k: v for k, v in kwargs.items() if k in ("fsdp", "fsdp_config", "deepspeed")}
        said = (
            ", ".join(
                f"{k}=" + (f"{{...stage {v['zero_optimization']['stage']}}}" if k == "deepspeed" else repr(v))
                for k, v in passed.items()
                if k != "fsdp_config"
            )
            or "none"
        )
        estimate = f"{chosen.name}: {chosen.per_device / 2**30:.2f} GiB" if chosen else "-"
        theirs = {"zero2": f"ZeRO-2 {zero2:.2f} GB", "zero3": f"ZeRO-3 {zero3:.2f} GB"}.get(
            chosen.key if chosen else "", "-"
        )
        print(f"| {name} | {said} | {runs} | {estimate} | {theirs} |")


if __name__ == "__main__":
    main()
