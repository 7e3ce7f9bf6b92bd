"""Training strategies sized per device (memory/strategy.py) and chosen by memory/training_placement.py."""

from __future__ import annotations

import os

import pytest

import whichdevice as wd
from whichdevice.core.job import Job
from whichdevice.core.packages import simulated_packages
from whichdevice.memory.strategy import ORDER, Priced, plan_strategies
from whichdevice.memory.training_job import setup_weights, training_memory
from whichdevice.memory.training_records import TrainingSetup
from whichdevice.model.facts import model_shape
from whichdevice.model.layers import layer_classes
from whichdevice.testing import simulate

GiB = 1024**3


def _llama_7b(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008,
                       vocab_size=32000, **extra)  # fmt: skip


@pytest.fixture
def torchrun_env(monkeypatch):
    def launch(world: int) -> None:
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                               MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():  # fmt: skip
            monkeypatch.setenv(key, value)

    return launch


def _ways(size, shape, batch=None, length=None):
    """The four ways plan_strategies sizes, priced as memory/training_placement.py prices them."""
    job = Job("training", batch, length)
    lora = TrainingSetup("lora", "bfloat16", "bfloat16")
    qlora = TrainingSetup("qlora", "bfloat16", "bfloat16", optimizer="paged_adamw_8bit")
    return dict(
        full=training_memory(size, shape, job, TrainingSetup("full", "float32", "bfloat16")),
        sharded=training_memory(size, shape, job, TrainingSetup("full", "float32", "bfloat16", sharded=True)),
        lora=Priced(setup_weights(size, lora), training_memory(size, shape, job, lora)),
        qlora=Priced(setup_weights(size, qlora), training_memory(size, shape, job, qlora)),
    )


def _plan(devices: int, budget: int, *, deepspeed: bool = False, batch=None, length=None, no_fsdp=None):
    from whichdevice.model.facts import estimate_model_size

    config = _llama_7b()
    size, shape = estimate_model_size(config), model_shape(config)
    return plan_strategies(
        params=size.parameters, shape=shape, dtype="float32", compute_dtype="bfloat16",
        **_ways(size, shape, batch, length), devices=devices, budget=budget, cpu_memory=1 << 50, deepspeed=deepspeed,
        layer_classes=layer_classes(config).names, no_fsdp=no_fsdp,
    )  # fmt: skip


def test_every_strategy_is_sized_in_order_and_the_first_that_fits_is_chosen():
    plan = _plan(4, 64 * GiB)
    assert tuple(s.key for s in plan.strategies) == ORDER
    fitting = [s for s in plan.strategies if s.fits]
    assert plan.chosen is fitting[0]
    ddp, fsdp = plan.strategies[0], plan.strategies[2]
    # DDP holds the whole job on every rank; FSDP a quarter of it plus the gathered units
    assert ddp.per_device > fsdp.per_device and not ddp.fits and fsdp.fits
    assert plan.chosen.key == "fsdp"


def test_more_devices_shrink_the_sharded_strategies_only():
    two, eight = _plan(2, 1 << 50), _plan(8, 1 << 50)
    by = lambda plan: {s.key: s.per_device for s in plan.strategies}  # noqa: E731
    assert by(two)["ddp"] == by(eight)["ddp"]
    assert by(eight)["fsdp"] < by(two)["fsdp"] and by(eight)["zero3"] < by(two)["zero3"]
    assert by(eight)["zero2"] < by(two)["zero2"]


def test_deepspeed_strategies_need_deepspeed():
    without, with_ = _plan(4, 1 << 50), _plan(4, 1 << 50, deepspeed=True)
    assert "pip install deepspeed" in without.strategies[1].line(1) and not without.strategies[1].fits
    assert with_.chosen.key == "ddp"
    assert _plan(4, 60 * GiB, deepspeed=True).chosen.key == "zero2"
    assert _plan(4, 60 * GiB, deepspeed=True).kwargs()["deepspeed"]["zero_optimization"] == {"stage": 2}


def test_fsdp_is_never_handed_over_where_accelerate_ignores_it():
    plan = _plan(4, 64 * GiB, no_fsdp="accelerate ignores fsdp on CPU processes")
    assert plan.chosen.key not in ("fsdp", "fsdp_offload")
    assert "accelerate ignores fsdp" in plan.strategies[2].line(1)


def test_fsdp_kwargs_name_the_models_own_layer_class():
    from transformers import LlamaForCausalLM

    kwargs = _plan(4, 64 * GiB).kwargs()
    assert kwargs["fsdp"] is True
    assert kwargs["fsdp_config"]["transformer_layer_cls_to_wrap"] == list(LlamaForCausalLM._no_split_modules)


def test_fsdp_kwargs_pass_trainingarguments_and_accelerates_plugin(tmp_path, monkeypatch):
    """What whichdevice emits, parsed as Trainer parses it: TrainingArguments' fsdp handling, then
    accelerate's FullyShardedDataParallelPlugin and its auto-wrap policy on a real model."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy
    from transformers import LlamaForCausalLM, TrainingArguments

    from tiny_models import tiny_config

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the plugin exports FSDP_* variables

    for budget in (64 * GiB, 8 * GiB):  # FSDP, then FSDP with CPU offload
        plan = _plan(4, budget)
        assert plan.chosen.key == ("fsdp" if budget > 8 * GiB else "fsdp_offload")
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **plan.kwargs())
        plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
        assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == (plan.chosen.key == "fsdp_offload")
        plugin.set_auto_wrap_policy(LlamaForCausalLM(tiny_config()))  # raises for a class the model lacks


def test_torchrun_ranks_get_fsdp_and_load_on_the_cpu(torchrun_env):
    torchrun_env(8)
    # Without deepspeed (ZeRO-2, next in the order, needs it): FSDP.
    with simulate("cuda:8,mem=80GiB"), simulated_packages({"deepspeed": None}):
        res = wd.resolve_device(model=_llama_7b(), task="training", quantize=None)
    assert res.training_plan.chosen.key == "fsdp"
    assert res.device_map == "cpu"
    kwargs = res.training_kwargs()
    assert kwargs["fsdp"] is True and kwargs["ddp_backend"] == "nccl"
    assert "FSDP full shard on 8 devices" in res.explain()


def test_one_process_split_says_model_parallel_not_dataparallel():
    with simulate("cuda:8,mem=80GiB"), simulated_packages({"deepspeed": None}):
        res = wd.resolve_device(model=_llama_7b(), task="training", quantize=None)
    text = res.explain()
    assert res.device_map == "auto"
    assert "nn.DataParallel over" not in text
    assert "is_model_parallel" in text
    assert "torchrun --nproc-per-node=8 train.py" in text and "TrainingArguments(fsdp=True" in text
    assert "fsdp" not in res.training_kwargs()  # no process group in one process


def test_lora_base_is_held_in_the_compute_dtype():
    with simulate("cuda:1,mem=24GiB"):
        res = wd.resolve_device(model=_llama_7b(), task="training")
    assert res.dtype_name == "bfloat16" and res.mixed_precision == "bf16"
    assert "weights 12.55 GiB" in res.explain()  # not 25.10 GiB of float32
    assert res.device_map == "cuda:0" and res.quantization is None


def test_a_job_that_fits_nowhere_lists_every_strategy(torchrun_env):
    torchrun_env(2)
    with simulate("cuda:2,mem=12GiB"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_llama_7b(), task="training", quantize=None, batch_size=1, max_length=2048)
    text = str(err.value)
    # 12 GiB less the CUDA context and the allocator's share (memory/fit.py's priced margin)
    assert "On 2 devices, per device against 10.30 GiB: DDP: " in text and "FSDP full shard: " in text
    assert "DeepSpeed ZeRO-3: " in text and "QLoRA" in text and "characters left out" not in text
    assert os.environ["WORLD_SIZE"] == "2"


# ------------------------------------------------------------------ DeepSpeed, checked by DeepSpeed itself


def _llama_8b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip


def _printed_per_gpu(estimator, capsys, **kwargs) -> dict[str, float]:
    """What deepspeed's ..._all_cold prints: per-GPU GB by options ("offload_optimizer=none", ...)."""
    estimator(**kwargs)
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.count("|") == 2]
    return {options.strip(): float(gpu.strip().removesuffix("GB")) for _, gpu, options in rows[1:]}


@pytest.mark.parametrize("devices", [2, 4, 8, 16])
@pytest.mark.parametrize("config", [_llama_7b, _llama_8b], ids=["llama-7b", "llama-8b"])
def test_zero_estimates_are_deepspeeds_own(capsys, devices, config):
    """ZeRO-2 and ZeRO-3's model states per GPU equal deepspeed's estimators for the same model and
    device count; the largest module is deepspeed's own reading of the model (model_to_params)."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
    from transformers import AutoModelForCausalLM

    from whichdevice.model.facts import estimate_model_size

    cfg = config()
    size = estimate_model_size(cfg)
    with torch.device("meta"):
        _, largest = model_to_params(AutoModelForCausalLM.from_config(cfg))
    assert size.largest_module == largest
    plan = _plan_of(cfg, devices, 1 << 50, size)
    by = {s.key: s.per_device for s in plan.strategies}  # no batch given: A is 0
    common = dict(total_params=size.parameters, num_gpus_per_node=devices, num_nodes=1)
    zero2 = _printed_per_gpu(estimate_zero2_model_states_mem_needs_all_cold, capsys, **common)
    zero3 = _printed_per_gpu(
        estimate_zero3_model_states_mem_needs_all_cold, capsys, largest_layer_params=largest, **common
    )
    assert round(by["zero2"] / 2**30, 2) == zero2["offload_optimizer=none"]
    assert round(by["zero3"] / 2**30, 2) == zero3["offload_param=none, offload_optimizer=none, zero_init=1"]


def _plan_of(cfg, devices, budget, size, **kw):
    shape = model_shape(cfg)
    return plan_strategies(
        params=size.parameters, shape=shape, dtype="float32", compute_dtype="bfloat16", **_ways(size, shape),
        devices=devices, budget=budget, cpu_memory=1 << 50, deepspeed=True, largest_module=size.largest_module, **kw
    )  # fmt: skip


@pytest.mark.parametrize("offload", [(False, False), (True, False), (True, True)], ids=["none", "optimizer", "both"])
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_offload_estimates_are_deepspeeds_own(stage, offload):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from whichdevice.memory.strategy import deepspeed_model_states

    params, largest, n = 8_030_261_248, 525_336_576, 8
    gpu, cpu, _ = deepspeed_model_states(stage, params, largest, n, *offload)
    if stage == 2:
        if offload[1]:
            return  # ZeRO-2 keeps the weights on the GPU: no such option
        theirs_cpu, theirs_gpu = estimate_zero2_model_states_mem_needs(params, n, 1, cpu_offload=offload[0])
    else:
        theirs_cpu, theirs_gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest, n, 1, cpu_offload=offload[0], cpu_offload_params=offload[1], zero_init=True
        )
    assert (gpu, cpu) == (theirs_gpu, theirs_cpu)


@pytest.mark.usefixtures("restore_accelerate_variables")
@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("budget_gib", [30, 21], ids=["zero2", "zero3"])
def test_every_emitted_deepspeed_config_is_accepted_by_transformers_and_deepspeed(tmp_path, bf16, budget_gib):
    """What whichdevice emits, parsed as Trainer and DeepSpeed parse it: TrainingArguments builds
    HfTrainerDeepSpeedConfig and fills its "auto" values, then DeepSpeed's own (pydantic) config parser."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from whichdevice.model.facts import estimate_model_size

    cfg = _llama_7b()
    # ZeRO-3 comes after FSDP in the order: FSDP is ruled out for it, as it is where accelerate ignores it.
    no_fsdp = None if budget_gib == 30 else "ruled out for this test"
    with simulated_packages({"deepspeed": "0.19"}):
        plan = _plan_of(cfg, 8, budget_gib * GiB, estimate_model_size(cfg), no_fsdp=no_fsdp)
    kwargs = plan.kwargs()
    assert plan.chosen.key == ("zero2" if budget_gib == 30 else "zero3"), [s.line(plan.budget) for s in plan.strategies]
    args = TrainingArguments(str(tmp_path), use_cpu=True, bf16=bf16, report_to=[], **kwargs)
    assert isinstance(args.hf_deepspeed_config, HfTrainerDeepSpeedConfig)
    parsed = DeepSpeedConfig(args.hf_deepspeed_config.config)
    assert parsed.zero_optimization_stage == kwargs["deepspeed"]["zero_optimization"]["stage"]
    assert parsed.bfloat16_config.enabled is bf16
    assert args.deepspeed_plugin.zero_stage == parsed.zero_optimization_stage
