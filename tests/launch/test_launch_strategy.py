"""The strategy the launch carries (whichdevice.launch.launch_strategy): read as accelerate and
TrainingArguments read it, sized as launched, warned about where it does not fit, never replaced."""

from __future__ import annotations

import json

import jsonschema
import pytest

import whichdevice as wd
from whichdevice.launch.launch_strategy import read_launch_strategy
from whichdevice.report import load_schema
from whichdevice.testing import simulate

GiB = 1024**3
_TORCHRUN = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="8", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none")  # fmt: skip
# What `accelerate launch` exports besides torchrun's (accelerate utils/launch.py, prepare_multi_gpu_env).
_ACCELERATE = dict(ACCELERATE_DYNAMO_BACKEND="NO", ACCELERATE_MIXED_PRECISION="bf16", ACCELERATE_USE_CPU="False")
LAUNCHES = {
    "DDP": {},
    "FSDP": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
             "FSDP_OFFLOAD_PARAMS": "false"},
    "ZeRO-2": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
    "ZeRO-3": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
}  # fmt: skip


def _llama_8b():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture
def launch(monkeypatch):
    def set_up(name: str | None, **extra: str) -> None:
        variables = {**_TORCHRUN, **(_ACCELERATE if name is not None else {}), **LAUNCHES.get(name or "", {}), **extra}
        for key, value in variables.items():
            monkeypatch.setenv(key, value)

    return set_up


def test_deepspeed_variables_are_read_as_deepspeedplugin_reads_them(tmp_path):
    assert read_launch_strategy({}) is None
    plain = read_launch_strategy({"ACCELERATE_USE_DEEPSPEED": "true"})
    assert plain is not None and plain.stage == 2  # DeepSpeedPlugin's default stage
    # TrainingArguments reads it with strtobool: "1" counts.
    assert read_launch_strategy({"ACCELERATE_USE_DEEPSPEED": "1", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}).stage == 3
    offload = read_launch_strategy({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                                    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"})  # fmt: skip
    assert offload.offload_optimizer and not offload.offload_params
    assert offload.name == "DeepSpeed ZeRO-3 with optimizer offloaded to the CPU"
    # A config file's own stage and offload win over the variables where not "auto" (fill_match).
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    filed = read_launch_strategy({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                  "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)})  # fmt: skip
    assert filed.stage == 3 and filed.offload_params and str(config) in filed.said
    config.write_text("{not json")
    broken = read_launch_strategy({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)})
    assert broken.stage == 2 and "cannot be read as JSON" in (broken.problem or "")


def test_fsdp_variables_are_read_as_accelerate_reads_them():
    # accelerate: os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"; "1" is not true there.
    assert read_launch_strategy({"ACCELERATE_USE_FSDP": "1"}) is None
    assert read_launch_strategy({"ACCELERATE_USE_FSDP": "TRUE"}).kind == "fsdp"
    v1 = read_launch_strategy({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "2"})
    assert v1.sharding == "SHARD_GRAD_OP"
    v2 = read_launch_strategy({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                               "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_OFFLOAD_PARAMS": "true"})  # fmt: skip
    assert v2.sharding == "SHARD_GRAD_OP" and v2.offload_params
    # DeepSpeed first, as AcceleratorState checks it first.
    both = read_launch_strategy({"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_DEEPSPEED": "true"})
    assert both.kind == "deepspeed"


@pytest.mark.parametrize("name", ["FSDP", "ZeRO-2", "ZeRO-3"])
def test_the_launchs_strategy_is_sized_and_kept_with_no_keyword_over_it(launch, name):
    launch(name)
    with simulate("cuda:8,mem=80GiB,cc=9.0"):
        res = wd.resolve_device(model=_llama_8b(), task="training", quantize=None)
    kwargs = res.training_kwargs()
    assert "deepspeed" not in kwargs and "fsdp" not in kwargs and "fsdp_config" not in kwargs
    plan = res.training_plan
    assert plan.launched is not None and plan.chosen.name.endswith("(the launch's)")
    assert plan.chosen.key == {"FSDP": "fsdp", "ZeRO-2": "zero2", "ZeRO-3": "zero3"}[name]
    assert "as the launch carries it" in res.explain()
    # ZeRO-3 partitions on load: no device_map (from_pretrained refuses one under ZeRO-3).
    assert ("device_map" in res.model_kwargs()) == (name != "ZeRO-3")


@pytest.mark.usefixtures("restore_accelerate_variables")
@pytest.mark.parametrize("stage", ["2", "3"])
def test_trainingarguments_built_with_the_keywords_runs_the_launchs_zero_stage(launch, tmp_path, monkeypatch, stage):
    """transformers builds DeepSpeedPlugin from the variables only without deepspeed= (training_args.py):
    with whichdevice's keywords the stage the launch asked for is the one TrainingArguments holds."""
    from transformers import TrainingArguments

    launch("ZeRO-3", ACCELERATE_DEEPSPEED_ZERO_STAGE=stage)
    with simulate("cuda:8,mem=80GiB,cc=9.0"):
        res = wd.resolve_device(model=_llama_8b(), task="training", quantize=None)
    kwargs = {k: v for k, v in res.training_kwargs().items() if k not in ("ddp_backend", "bf16")}  # this is a CPU
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name)  # one CPU process builds it here
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], **kwargs)
    assert args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == int(stage)


def test_a_launched_strategy_that_does_not_fit_is_warned_with_the_numbers(launch):
    launch("ZeRO-2")
    with simulate("cuda:8,mem=24GiB,cc=9.0"):
        res = wd.resolve_device(model=_llama_8b(), task="training", quantize=None)
    warning = next(s.message for s in res.trace if s.topic == "warning" and "the launch's" in s.message)
    chosen = res.training_plan.chosen
    # 24 GiB less the CUDA context and the allocator's share (memory/fit.py's priced margin): 21.10 GiB
    assert not chosen.fits and "needs 31.78 GiB per device" in warning and "21.10 GiB budget" in warning
    assert "fits" in warning and "change the launch's config" in warning  # what would fit instead
    assert "deepspeed" not in res.training_kwargs()


@pytest.mark.parametrize("name", ["DDP", None], ids=["accelerate-ddp", "torchrun"])
def test_an_accelerate_ddp_launch_or_torchrun_is_planned_as_before(launch, name):
    launch(name)
    with simulate("cuda:8,mem=80GiB,cc=9.0"):
        res = wd.resolve_device(model=_llama_8b(), task="training", quantize=None)
    assert res.training_plan.launched is None and res.training_plan.chosen.key != "ddp"
    said = "the launch carries no FSDP or DeepSpeed setting"
    assert (said in res.explain()) == (name == "DDP")


def test_the_config_line_does_not_say_python_ignores_it_under_accelerate_launch(launch, tmp_path, monkeypatch):
    home = tmp_path / "hf"
    (home / "accelerate").mkdir(parents=True)
    (home / "accelerate" / "default_config.yaml").write_text(
        "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n"
    )
    monkeypatch.setenv("HF_HOME", str(home))
    launch("ZeRO-3")
    with simulate("cuda:8,mem=80GiB,cc=9.0"):
        res = wd.resolve_device(task="training")
    line = next(s.message for s in res.trace if s.topic == "accelerate" and "default_config.yaml" in s.message)
    assert "`accelerate launch` started this process" in line and "zero_stage: 3" in line
    assert "ignores it" not in line


def test_the_launchs_strategy_is_said_without_a_model_and_a_bad_stage_is_warned(launch):
    launch("ZeRO-3", ACCELERATE_DEEPSPEED_ZERO_STAGE="three")
    with simulate("cuda:8,mem=80GiB,cc=9.0"):
        res = wd.resolve_device(task="training")
    said = res.explain()
    assert "the launch's variables carry DeepSpeed ZeRO-2" in said  # DeepSpeedPlugin's default stage
    assert "ACCELERATE_DEEPSPEED_ZERO_STAGE='three' is not a ZeRO stage" in said
    assert "deepspeed" not in res.training_kwargs()


# ------------------------------------------------------------ CPU processes (issue 54)
# accelerate 1.16 state.py: AcceleratorState takes DistributedType.DEEPSPEED whenever ACCELERATE_USE_DEEPSPEED
# is true "and not cpu", where cpu is the Accelerator's own argument (Trainer passes none) or
# ACCELERATE_USE_CPU: DeepSpeed runs on CPU processes. FSDP is taken only for the MULTI_GPU, MULTI_XPU, ...
# types, so a MULTI_CPU run keeps DDP. tests/launch/test_launched_strategies.py reads both back from a
# real Trainer in launched processes.


@pytest.fixture
def tiny(tmp_path):
    from tiny_models import save_tiny_llama

    return str(save_tiny_llama(tmp_path / "tiny", tokenizer=False))


@pytest.mark.parametrize(("name", "key"), [("ZeRO-2", "zero2"), ("ZeRO-3", "zero3")])
def test_a_deepspeed_launch_on_cpu_processes_is_planned_as_trainer_runs_it(launch, tiny, name, key):
    launch(name, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", ACCELERATE_MIXED_PRECISION="no")
    res = wd.resolve_device(model=tiny, task="training")
    assert res.device == "cpu"
    plan = res.training_plan
    assert plan is not None and plan.launched is not None and plan.chosen.key == key, res.explain()
    kwargs = res.model_kwargs()
    # from_pretrained raises "DeepSpeed Zero-3 is not compatible with passing a `device_map`"; transformers 5
    # drops low_cpu_mem_usage (modeling_utils.py), and whichdevice never passes it.
    assert ("device_map" in kwargs) == (key == "zero2") and "low_cpu_mem_usage" not in kwargs
    assert "deepspeed" not in res.training_kwargs()
    # Without model= there is no plan: the launch itself still decides what the keywords carry.
    bare = wd.resolve_device(task="training")
    assert ("device_map" in bare.model_kwargs()) == (key == "zero2")
    assert ("device_map" in bare.pipeline_kwargs()) == (key == "zero2")
    assert bare.to_dict()["device_map_passed"] == res.to_dict()["device_map_passed"] == (key == "zero2")
    if key == "zero3":  # and the trace and the report say what is handed over
        assert any(s.message.startswith("device_map: none passed: under ZeRO-3") for s in bare.trace)
        from whichdevice.report import gather, render_text

        data = gather(tasks=("training",), job={"model": tiny})
        jsonschema.Draft202012Validator(load_schema()).validate(data)
        assert "no device_map (ZeRO-3 places the weights as they load)" in render_text(data, width=1000)


def test_accelerate_use_cpu_makes_a_deepspeed_launch_a_cpu_run_without_it(launch, tiny):
    launch("ZeRO-3", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", ACCELERATE_USE_CPU="1", ACCELERATE_MIXED_PRECISION="no")
    res = wd.resolve_device(model=tiny, task="training")
    assert res.training_plan.launched is None and res.training_plan.chosen.key == "ddp"
    assert "device_map" in res.model_kwargs()
    assert "ACCELERATE_USE_CPU='1'" in res.explain()


@pytest.mark.parametrize("version", ["2", "1"])
def test_an_fsdp_launch_on_cpu_processes_is_ddp_as_accelerate_runs_it(launch, tiny, version):
    sync = {} if version == "2" else {"FSDP_SYNC_MODULE_STATES": "true"}  # accelerate launch's v1 default
    launch("FSDP", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", FSDP_VERSION=version, ACCELERATE_MIXED_PRECISION="no", **sync)
    res = wd.resolve_device(model=tiny, task="training")
    assert res.training_plan.launched is None and res.training_plan.chosen.key == "ddp"
    said = res.explain()
    assert "accelerate runs CPU processes with DDP" in said
    refused = [s.message for s in res.trace if s.topic == "warning" and "FullyShardedDataParallelPlugin" in s.message]
    # accelerate's plugin itself refuses sync_module_states=True on a CPU: Trainer would raise building it.
    assert bool(refused) == (version == "1"), said
    if refused:
        assert "sync_module_states=True" in refused[0] and "--fsdp_sync_module_states false" in refused[0]


@pytest.mark.usefixtures("restore_accelerate_variables")
def test_a_zero3_trainingarguments_built_here_keeps_device_map_out(tmp_path):
    """A deepspeed= config with stage 3 (no launch variable at all): once TrainingArguments is built,
    transformers' is_deepspeed_zero3_enabled() is what from_pretrained asks, and model_kwargs() asks it too."""
    import gc

    from transformers import TrainingArguments

    res = wd.resolve_device(task="training")
    assert "device_map" in res.model_kwargs()
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], deepspeed=config)
    try:
        assert "device_map" not in res.model_kwargs() and "device_map" not in res.pipeline_kwargs()
        assert res.model_kwargs(device_map="cpu")["device_map"] == "cpu"  # yours is kept, as asked
    finally:
        del args
        gc.collect()
    assert "device_map" in res.model_kwargs()


# ------------------------------------------------------------ hostile files and numbers (issue 57)
# Each child runs with a 10 s timeout: on a reader that opens a FIFO as a file it would block forever.
_CHILD = """
import os, resource, sys
if len(sys.argv) > 2:  # an address-space cap: a reader that reads /dev/zero to its end fails against it
    cap = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from whichdevice.launch.launch_strategy import read_launch_strategy
s = read_launch_strategy({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                          "ACCELERATE_DEEPSPEED_CONFIG_FILE": sys.argv[1]})
print(s.stage, s.problem)
"""


def _read_in_child(path: str, *limit: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CHILD, path, *limit], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_deepspeed_config_naming_a_fifo_nobody_writes_is_said_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    out = _read_in_child(str(fifo))
    assert out.startswith("3 ") and "is a named pipe (FIFO), not a file" in out
    assert "whichdevice sizes the variables' stage" in out


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_deepspeed_config_naming_an_endless_device_is_said_without_reading_it(device):
    out = _read_in_child(device, str(1 << 30))  # 1 GiB of address space: more than enough for a config
    assert out.startswith("3 ") and "is a character device, not a file" in out


def test_the_whole_resolution_says_a_fifo_named_as_the_deepspeed_config(tmp_path):
    import os
    import subprocess
    import sys

    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    code = "import whichdevice as wd; print(wd.resolve_device(task='training').explain())"
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(fifo),
           "XDG_CACHE_HOME": str(tmp_path / "xdg"), "WHICHDEVICE_CALIBRATION": "off"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "is a named pipe (FIFO), not a file" in done.stdout


@pytest.mark.parametrize("value", ["²", "9" * 5000, "١", "1_0"])
def test_an_fsdp_sharding_strategy_that_is_no_ascii_number_is_said_escaped(value):
    strategy = read_launch_strategy({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": value})
    assert strategy is not None and strategy.sharding == "FULL_SHARD"
    assert strategy.problem is not None and "FSDP_SHARDING_STRATEGY=" in strategy.problem
    assert len(strategy.problem) < 400 and len(strategy.said) < 400  # the value cut, never quoted whole


@pytest.mark.parametrize("value", ["²", "9" * 5000])
def test_the_command_says_a_bad_sharding_strategy_and_exits_0(value, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": value,
           "XDG_CACHE_HOME": str(tmp_path / "xdg"), "WHICHDEVICE_CALIBRATION": "off"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "whichdevice"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "internal error" not in done.stdout + done.stderr
    assert "FSDP_SHARDING_STRATEGY=" in done.stdout and "not a sharding strategy" in done.stdout
