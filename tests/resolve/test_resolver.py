"""resolve_device(): precedence, validation, the scenario table for every registry row, explain()."""

from __future__ import annotations

import json
import os

import pytest
import torch

import whichdevice as wd
from whichdevice.testing import simulate

# spec(s) -> (device, inference dtype, device_map, training kwargs in a single process); training
# always loads fp32 weights, under the mixed precision its flags name (model_precision).
SINGLE = [
    (("cpu,flags=avx512_bf16",), "cpu", "bfloat16", "cpu", {"use_cpu": True, "bf16": True, "fp16": False}),
    (("cpu,flags=",), "cpu", "float32", "cpu", {"use_cpu": True, "bf16": False, "fp16": False}),
    (("cuda:8,cc=9.0,mem=141GiB,name=NVIDIA H200",), "cuda:0", "bfloat16", "cuda:0", {"bf16": True, "fp16": False}),
    (("cuda:1,cc=7.0,name=Tesla V100",), "cuda:0", "float16", "cuda:0", {"bf16": False, "fp16": True}),
    (("cuda:1,cc=7.5,name=Tesla T4",), "cuda:0", "float16", "cuda:0", {"bf16": False, "fp16": True}),
    # fp16 at 1/64 of fp32 on 6.1 (NVIDIA's arithmetic throughput table): fp32
    (("cuda:1,cc=6.1,name=GTX 1080",), "cuda:0", "float32", "cuda:0", {"bf16": False, "fp16": False}),
    (("cuda:1,cc=6.0,name=Tesla P100",), "cuda:0", "float16", "cuda:0", {"bf16": False, "fp16": True}),
    (("cuda:1,cc=5.2,name=GTX 980",), "cuda:0", "float32", "cuda:0", {"bf16": False, "fp16": False}),
    (("cuda:2,variant=rocm",), "cuda:0", "bfloat16", "cuda:0", {"bf16": True, "fp16": False}),
    (("hpu:8",), "hpu", "bfloat16", "hpu", {"bf16": True, "fp16": False}),
    (("hpu:8,gen=gaudi3",), "hpu", "bfloat16", "hpu", {"bf16": True, "fp16": False}),
    (("npu:8",), "npu:0", "bfloat16", "npu:0", {"bf16": True, "fp16": False}),
    (("npu:1,bf16=no",), "npu:0", "float16", "npu:0", {"bf16": False, "fp16": True}),
    (("neuron:2",), "neuron", "bfloat16", "neuron", {"bf16": True, "fp16": False}),
    (("tpu:4",), "tpu", "bfloat16", "tpu", {"bf16": True, "fp16": False}),
    (("xpu:2",), "xpu:0", "bfloat16", "xpu:0", {"bf16": True, "fp16": False}),
    (("xpu:1,bf16=no",), "xpu:0", "float16", "xpu:0", {"bf16": False, "fp16": True}),
    (("mps",), "mps", "float16", "mps", {"bf16": False, "fp16": False}),
    (("mlu:2",), "mlu:0", "bfloat16", "mlu:0", {"bf16": True, "fp16": False}),
    (("musa:2,bf16=no",), "musa:0", "float16", "musa:0", {"bf16": False, "fp16": True}),
    (("npu:8", "cuda:8"), "npu:0", "bfloat16", "npu:0", {"bf16": True, "fp16": False}),
    (("neuron:2", "cuda:8"), "neuron", "bfloat16", "neuron", {"bf16": True, "fp16": False}),
    (("hpu:8", "cuda:8"), "hpu", "bfloat16", "hpu", {"bf16": True, "fp16": False}),
]


@pytest.mark.parametrize(("specs", "device", "dtype", "device_map", "train"), SINGLE, ids=lambda v: str(v))
def test_single_process_scenarios(specs, device, dtype, device_map, train):
    with simulate(*specs):
        inference = wd.resolve_device()
        training = wd.resolve_device(task="training")
    assert inference.device == str(inference) == device
    assert inference.dtype == getattr(torch, dtype)
    assert inference.device_map == device_map
    assert inference.model_kwargs()["device_map"] == device_map
    # Training and inference agree on the backend, and TrainingArguments gets what fits it.
    assert training.backend is inference.backend
    assert training.training_kwargs() == train
    assert training.dtype == torch.float32
    assert "ddp_backend" not in training.training_kwargs()


DISTRIBUTED = [
    ("cuda:8", "cuda:1", "nccl", None),
    ("cuda:2,variant=rocm", "cuda:1", "nccl", None),
    ("hpu:8", "hpu", "hccl", "hpu_backend"),  # its current device, as accelerate uses it
    ("npu:8", "npu:1", "hccl", None),
    ("xpu:2", "xpu:1", "xccl", None),
    ("mlu:2", "mlu:1", "cncl", None),
    ("musa:2", "musa:1", "mccl", None),
    ("neuron:2", "neuron", "neuron", "neuron"),
    ("tpu:4", "tpu", "xla", None),
    ("cpu", "cpu", "gloo", None),
]


@pytest.fixture
def torchrun_rank1(monkeypatch):
    for name, value in {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(("spec", "device", "ddp", "compile_backend"), DISTRIBUTED)
def test_distributed_scenarios(torchrun_rank1, spec, device, ddp, compile_backend):
    with simulate(spec):
        res = wd.resolve_device(task="training")
        kwargs = res.training_kwargs()
        compiled = res.training_kwargs(torch_compile=True)
    assert res.device == device
    assert res.distributed is not None and res.distributed.local_rank == 1
    assert kwargs["ddp_backend"] == ddp
    assert compiled["torch_compile"] is True
    assert compiled.get("torch_compile_backend") == compile_backend
    assert f"process group backend {ddp!r}" in res.explain()


def test_mps_has_no_distributed_backend(torchrun_rank1):
    with simulate("mps"), pytest.raises(wd.DeviceError, match="no distributed backend"):
        wd.resolve_device(task="training")


def test_local_rank_beyond_visible_devices(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with simulate("cuda:8"), pytest.raises(wd.DeviceError) as err:
        wd.resolve_device(task="training")
    text = str(err.value)
    assert "LOCAL_RANK=2" in text and "2 cuda device(s)" in text and "CUDA_VISIBLE_DEVICES='0,1'" in text


def test_gaudi_hook_in_trace_and_restored(monkeypatch):
    monkeypatch.delenv("PT_ENABLE_INT64_SUPPORT", raising=False)
    with simulate("hpu:8"):
        res = wd.resolve_device()
        assert "PT_ENABLE_INT64_SUPPORT=1" in res.explain()
        assert [a.name for a in res.env_set] == ["PT_ENABLE_INT64_SUPPORT"]
        assert res.to_dict()["env_set"][0]["action"] == "set"


def test_gaudi_hook_keeps_user_value(monkeypatch):
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "0")
    with simulate("hpu:8"):
        res = wd.resolve_device()
    assert res.env_set[0].action == "kept"
    # Said once: the hook's env line, not again as the probe's warning (the report keeps the warning).
    assert res.explain().count("kept your PT_ENABLE_INT64_SUPPORT=0") == 1
    assert any("kept your PT_ENABLE_INT64_SUPPORT=0" in w for w in res.probe.warnings)


def test_pipeline_kwargs_choose_gaudi_with_no_device_passed(monkeypatch):
    import inspect

    from transformers import pipeline

    monkeypatch.delenv("WHICHDEVICE_DEVICE", raising=False)
    with simulate("hpu:8", "cuda:8"):  # pipeline() itself would take cuda before hpu (BACKENDS.md)
        res = wd.resolve_device()
    kwargs = res.pipeline_kwargs()
    assert res.source == "detection" and kwargs["device_map"] == "hpu" and "device" not in kwargs
    assert kwargs["dtype"] == torch.bfloat16 and kwargs["model_kwargs"] == {}
    # Every key is one the installed pipeline() takes (read, not typed).
    assert set(kwargs) <= set(inspect.signature(pipeline).parameters)


# ------------------------------------------------------------------------------- precedence


def test_argument_beats_environment_beats_detection(monkeypatch):
    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cpu")
    with simulate("cuda:2"):
        assert wd.resolve_device().device == "cpu"
        assert wd.resolve_device().source == "WHICHDEVICE_DEVICE"
        res = wd.resolve_device("cuda:1")
        assert res.device == "cuda:1" and res.source == "device"
        assert "WHICHDEVICE_DEVICE='cpu' ignored" in res.explain()
        monkeypatch.delenv("WHICHDEVICE_DEVICE")
        assert wd.resolve_device().device == "cuda:0"


def test_invalid_environment_override_names_the_variable(monkeypatch):
    monkeypatch.setenv("WHICHDEVICE_DEVICE", "gpu")
    with pytest.raises(wd.DeviceError) as err:
        wd.resolve_device()
    assert "WHICHDEVICE_DEVICE" in str(err.value) and "'cuda'" in str(err.value)


def test_prefer_and_exclude():
    with simulate("cuda:2", "xpu:1"):
        assert wd.resolve_device().device == "cuda:0"
        assert wd.resolve_device(prefer="xpu").device == "xpu:0"
        assert wd.resolve_device(exclude=["cuda"]).device == "xpu:0"
        assert wd.resolve_device(exclude=["cuda", "xpu"]).device == "cpu"
        with pytest.raises(wd.DeviceError, match="no usable device"):
            wd.resolve_device(exclude=["cuda", "xpu", "cpu"])
        with pytest.raises(wd.DeviceError, match="Did you mean 'cuda'"):
            wd.resolve_device(prefer="gpu")


def test_torch_device_objects_are_accepted():
    with simulate("cuda:2"):
        assert wd.resolve_device(torch.device("cuda", 1)).device == "cuda:1"
        assert wd.resolve_device(torch.device("cpu")).device == "cpu"


# ------------------------------------------------------------------------------- placement


def test_neuron_and_tpu_reject_auto_device_map():
    with simulate("neuron:2"):
        res = wd.resolve_device()
        assert res.device_map == "neuron"
        with pytest.raises(wd.ConfigConflictError, match="device_map='neuron'"):
            res.model_kwargs(device_map="auto")
        with pytest.raises(wd.ConfigConflictError):
            wd.resolve_device(device_map="auto")


def _config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )


def test_model_that_fits_one_gpu_is_not_split():
    with simulate("cuda:4,cc=9.0,mem=80GiB"):
        res = wd.resolve_device(model=_config(2048, 16))  # about 1.2B parameters, 2.4 GB in bf16
    assert res.device_map == "cuda:0" and res.max_memory is None
    assert "fit on cuda:0" in res.explain()


def test_model_too_big_for_one_gpu_is_split_with_max_memory():
    # about 7B parameters: 13 GiB in bf16 does not fit 80% of a 16 GiB GPU but fits four of them.
    with simulate("cuda:4,cc=8.0,mem=16GiB"):
        res = wd.resolve_device(model=_config(4096, 32), quantize=None)
    assert res.device_map == "auto"
    assert set(res.max_memory) == {0, 1, 2, 3}
    assert res.model_kwargs()["max_memory"] == res.max_memory
    assert "split over 4 devices" in res.explain()


def test_model_that_fits_nowhere_says_the_numbers():
    with simulate("cuda:1,cc=8.0,mem=8GiB"), pytest.raises(wd.DoesNotFitError) as err:
        wd.resolve_device(model=_config(4096, 32), quantize=None)
    assert "GiB" in str(err.value) and "quantize='auto'" in str(err.value)


def test_an_uncached_model_offline_names_the_ways_on(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(wd.DeviceError, match=r"HF_HUB_OFFLINE is set.*unset HF_HUB_OFFLINE.*hf download"):
        wd.resolve_device(model="someone/not-cached-model")


# ----------------------------------------------------------------------------- explanation


def test_explain_says_why_for_every_row_on_this_machine():
    res = wd.resolve_device()
    text, short = res.explain(verbose=True), res.explain()
    for backend in wd.backends():
        line = next(line for line in text.splitlines() if line.split()[1:2] == [backend.name])
        assert ("chosen" in line) or ("not probed" in line), line
        # By default the backends simply not installed share one line, which names each (hardware/absent.py).
        assert any(backend.name in line.replace(",", " ").split() for line in short.splitlines()), backend.name
    for step in res.trace:
        if step.topic in {b.name for b in wd.backends()} and step.chosen is False:
            assert "pip install" in step.message or "MPS needs macOS" in step.message


def test_to_dict_is_json_safe_for_every_task():
    for task in ("inference", "training"):
        data = json.loads(json.dumps(wd.resolve_device(task=task).to_dict()))
        assert data["device"] == "cpu" and data["task"] == task and data["trace"]
    assert json.loads(json.dumps(wd.resolve_device(task="training").to_dict()))["training_kwargs"]["use_cpu"]


def test_user_dtype_wins_and_slowness_is_noted():
    res = wd.resolve_device(dtype=torch.float16)
    assert res.dtype == torch.float16
    assert "fp16 slowly" in res.explain()
    assert wd.resolve_device(dtype=None).model_kwargs().get("dtype") is None


def test_flash_attention_requests_off_cuda_raise():
    with simulate("xpu:1"), pytest.raises(wd.DeviceError, match="CUDA"):
        wd.resolve_device(attn_implementation="flash_attention_3")
    with simulate("cuda:1,cc=8.0"), pytest.raises(wd.DeviceError, match=r"9\.0"):
        wd.resolve_device(attn_implementation="flash_attention_3")


def test_repeated_calls_reuse_the_answer_until_something_it_reads_changes(monkeypatch):
    first = wd.resolve_device()
    assert wd.resolve_device() is first
    assert wd.resolve_device(task="training") is not first
    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cpu")
    changed = wd.resolve_device()
    assert changed is not first and changed.source == "WHICHDEVICE_DEVICE"
    monkeypatch.delenv("WHICHDEVICE_DEVICE")
    assert wd.resolve_device() is first
    assert wd.resolve_device(refresh=True) is not first
    with simulate("cuda:2"):
        assert wd.resolve_device().device == "cuda:0"  # a simulation has its own answers
    assert wd.resolve_device().device == "cpu"


def test_max_memory_without_model_is_passed_on():
    with simulate("cuda:2,mem=16GiB"):
        res = wd.resolve_device(max_memory={0: "10GiB"})
    assert res.device_map == "cuda:0"
    assert res.model_kwargs()["max_memory"] == {0: "10240MiB"}


def test_cpu_under_mpirun_uses_mpi_only_when_torch_has_it(monkeypatch):
    import torch.distributed

    for name, value in {
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    # pip wheels lack MPI: gloo, whose env:// rendezvous needs MASTER_ADDR
    with pytest.raises(wd.DeviceError, match="export MASTER_ADDR="):
        wd.resolve_device(task="training")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert wd.resolve_device(task="training").training_kwargs()["ddp_backend"] == "gloo"
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.setattr(torch.distributed, "is_mpi_available", lambda: True)
    assert wd.resolve_device(task="training", refresh=True).training_kwargs()["ddp_backend"] == "mpi"


def test_xpu_before_torch_27_uses_oneccl(monkeypatch, torchrun_rank1):
    from whichdevice.core.packages import simulated_packages

    with simulated_packages({"torch": "2.6.0"}), simulate("xpu:2"):
        assert wd.resolve_device(task="training").training_kwargs()["ddp_backend"] == "ccl"


def test_simulated_hardware_details_follow_the_real_rules():
    with simulate("mps,macos=13.6"):
        assert "macOS 13.6" in wd.resolve_device(dtype="bfloat16").explain()
    with simulate("mps"):
        assert "slow or unsupported" not in wd.resolve_device(dtype="bfloat16").explain()
    with simulate("hpu:8,gen=gaudi3"):
        assert wd.probe("hpu").devices[0].name == "GAUDI3"


@pytest.mark.parametrize("name", ["batch_size", "max_length", "max_new_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.0, "4", True])
def test_workload_sizes_must_be_whole_numbers(name: str, value: object) -> None:
    with pytest.raises(wd.DeviceError, match=rf"{name}=.*whole number of 1 or more"):
        wd.resolve_device("cpu", **{name: value})


@pytest.mark.parametrize("new", [64, 65])
def test_new_tokens_must_leave_room_for_a_prompt_in_max_length(new: int) -> None:
    with pytest.raises(wd.DeviceError, match=r"max_length counts the prompt too.*max_length=prompt tokens \+ max_new"):
        wd.resolve_device("cpu", max_length=64, max_new_tokens=new)
    assert wd.resolve_device("cpu", max_length=65, max_new_tokens=64).device == "cpu"


def test_workload_sizes_are_part_of_the_memo_key() -> None:
    one = wd.resolve_device("cpu", batch_size=1, max_length=64)
    assert wd.resolve_device("cpu", batch_size=1, max_length=64) is one
    assert wd.resolve_device("cpu", batch_size=4, max_length=64) is not one
    assert wd.resolve_device("cpu", batch_size=1, max_length=64, max_new_tokens=32) is not one


def test_the_arguments_record_restates_the_signature():
    # resolve_device() builds Arguments by keyword; the memo key is the record, so a parameter
    # missing from it would let two different calls share one answer.
    import inspect

    from whichdevice.resolve.arguments import Arguments

    params = [p for p in inspect.signature(wd.resolve_device).parameters if p != "refresh"]
    assert list(Arguments._fields) == params


_RESOLVE_AND_COMPARE = """
import json, os, sys
import whichdevice as wd
before = dict(os.environ)
wd.resolve_device(model=sys.argv[1])
wd.resolve_device(model=sys.argv[1], task="training")
after = dict(os.environ)
print(json.dumps({k: [before.get(k), after.get(k)] for k in {*before, *after} if before.get(k) != after.get(k)}))
"""


@pytest.mark.parametrize("preset", [None, "/tmp/my-inductor-cache"], ids=["unset", "set-by-the-user"])
def test_resolving_a_model_folder_leaves_the_environment_as_it_was(tmp_path, preset):
    # A fresh process: importing the architecture's module (transformers.generation -> torch._dynamo) is
    # what sets TORCHINDUCTOR_CACHE_DIR, and this process imported it long ago.
    import json
    import subprocess
    import sys

    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "model", tokenizer=False)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    if preset is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = preset
    done = subprocess.run([sys.executable, "-c", _RESOLVE_AND_COMPARE, str(folder)], env=env, capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    assert json.loads(done.stdout.splitlines()[-1]) == {}


# Modules only some answers need: each is imported by the stage that needs it, when it does.
_ONLY_FOR_SOME_ANSWERS = {
    "whichdevice.model.support": "the attention support of model='s classes",
    "whichdevice.model.context": "the context of model='s shape",
    "whichdevice.memory.quantization_plan": "a bitsandbytes quantization plan",
}


def test_a_plain_resolve_imports_no_module_only_other_answers_need():
    import importlib.util
    import subprocess
    import sys

    assert all(importlib.util.find_spec(m) is not None for m in _ONLY_FOR_SOME_ANSWERS)  # no name to miss
    code = "import json, sys, whichdevice; whichdevice.resolve_device(); print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    imported = set(json.loads(done.stdout.splitlines()[-1]))
    assert {m: why for m, why in _ONLY_FOR_SOME_ANSWERS.items() if m in imported} == {}
