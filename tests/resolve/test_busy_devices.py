"""Training planned on the devices it fits: a GPU another process fills is passed over only where no
strategy fits every visible device with it (resolve/busy_devices.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

import whichdevice as wd
from tiny_models import save_tiny_llama
from whichdevice.testing import simulate

LAUNCH = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")
# Four 16 GiB GPUs, another process holding 15 GiB of the first.
FULL_FIRST = "cuda:4,mem=16GiB,cc=8.0,held=15GiB/0/0/0"


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*LAUNCH, "WHICHDEVICE_DEVICE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def one_billion(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 1B-class Llama, config only: full fine-tuning needs several GiB per device however it is split."""
    path = tmp_path_factory.mktemp("llama-1b")
    LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, dtype="bfloat16",
    ).save_pretrained(path)  # fmt: skip
    return str(path)


def test_a_gpu_another_process_fills_is_passed_over_when_nothing_fits_with_it(one_billion: str) -> None:
    with simulate(FULL_FIRST):
        res = wd.resolve_device(model=one_billion, task="training", batch_size=1, max_length=512)
    assert res.devices == (1, 2, 3) and res.device_count == 3
    assert res.training_plan is not None and res.training_plan.chosen is not None
    assert res.training_plan.devices == 3
    said = [s.message for s in res.trace if s.topic == "device"]
    assert said[0].startswith("no training strategy fits all 4 visible cuda devices, each sized by the fullest")
    assert "cuda:0 has 1.00 GiB free of 16.00 GiB: another process uses it" in said[0]
    assert "planned on cuda:1, cuda:2, cuda:3 instead" in said[0]
    assert res.launch_command(["train.py"])[:3] == ["env", "CUDA_VISIBLE_DEVICES=1,2,3", "torchrun"]


def test_without_the_pass_over_nothing_fits(one_billion: str) -> None:
    # The same job on the same node, the full GPU named: what the plan was before it was passed over.
    with simulate(FULL_FIRST):
        res = wd.resolve_device(model=one_billion, task="training", batch_size=1, max_length=512, devices=-1)
    assert res.training_plan is not None and res.training_plan.chosen is None
    assert not any(s.message.startswith("no training strategy fits all") for s in res.trace)


def test_a_job_that_fits_every_gpu_keeps_them_all(tmp_path: Path) -> None:
    tiny = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    with simulate(FULL_FIRST):
        res = wd.resolve_device(model=str(tiny), task="training", batch_size=1, max_length=64)
    assert res.devices is None and res.device_count == 4
    assert not any(s.message.startswith("no training strategy fits all") for s in res.trace)


def test_inference_is_not_replanned(one_billion: str) -> None:
    with simulate(FULL_FIRST):
        res = wd.resolve_device(model=one_billion, batch_size=1, max_length=512)
    assert res.device == "cuda:1" and res.devices is None
    assert not any(s.message.startswith("no training strategy fits all") for s in res.trace)


@pytest.mark.parametrize("device", ["cuda:0", "cuda"])
def test_a_device_the_caller_names_is_kept_and_only_a_bare_backend_is_replanned(one_billion: str, device: str) -> None:
    with simulate(FULL_FIRST):
        res = wd.resolve_device(device, model=one_billion, task="training", batch_size=1, max_length=512)
    if device == "cuda:0":  # named: resolved as asked (nothing fits there, and the trace says so)
        assert res.device == "cuda:0" and res.devices is None
        assert res.training_plan is not None and res.training_plan.chosen is None
    else:
        assert res.devices == (1, 2, 3)
