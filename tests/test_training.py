"""training_arguments(): a real TrainingArguments that matches the resolution, and refuses conflicts."""

from __future__ import annotations

import os

import pytest

import whichdevice as wd
from whichdevice.testing import simulate


@pytest.fixture(autouse=True)
def _restore_accelerate_variables():
    """TrainingArguments exports ACCELERATE_* variables for the Accelerator it creates later
    (transformers 4.57: ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_IPEX). That is transformers'
    doing, by design, so put them back rather than let the leak check blame whichdevice."""
    before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    for name in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        if name not in before:
            del os.environ[name]
    os.environ.update(before)


def test_training_arguments_on_this_machine(tmp_path, cpu_kind):
    res = wd.resolve_device(task="training")
    args = wd.training_arguments(output_dir=str(tmp_path), report_to=[])
    assert str(args.device) == res.device == "cpu"
    assert args.use_cpu is True
    # fp32 weights under bf16 mixed precision exactly where the probe says bf16 is native; never fp16 on a CPU
    assert res.dtype_name == "float32"
    assert res.training_kwargs()["bf16"] is (cpu_kind.dtype == "bfloat16")
    assert args.bf16 is (cpu_kind.dtype == "bfloat16")
    assert args.fp16 is False
    assert args.ddp_backend is None


def test_user_kwargs_are_never_overridden(tmp_path):
    args = wd.training_arguments(output_dir=str(tmp_path), bf16=False, learning_rate=1e-3, report_to=[])
    assert args.bf16 is False and args.fp16 is False
    assert args.learning_rate == 1e-3


def test_cpu_without_native_bf16_refuses_bf16(tmp_path):
    with simulate("cpu,flags="), pytest.raises(wd.ConfigConflictError, match="lacks native bf16"):
        wd.training_arguments(output_dir=str(tmp_path), bf16=True)


def test_accelerate_state_is_kept_when_configured(tmp_path):
    from accelerate.state import PartialState

    PartialState(cpu=True)
    try:
        before = dict(PartialState._shared_state)
        args = wd.training_arguments(output_dir=str(tmp_path), report_to=[])
        assert args.accelerator_config.use_configured_state is False  # consumed by TrainingArguments
        assert str(args.device) == "cpu"
        assert PartialState._shared_state.keys() == before.keys()
        assert PartialState._shared_state["device"] == before["device"]
    finally:
        PartialState._reset_state()


@pytest.mark.slow
def test_trainer_runs_real_steps(tmp_path):
    from transformers import AutoModelForCausalLM, Trainer

    from tiny_models import RandomTokens, save_tiny_llama

    path = save_tiny_llama(tmp_path / "model", tokenizer=False)
    res = wd.resolve_device(task="training", model=path)
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs(dtype=None))
    args = wd.training_arguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    assert str(args.device) == res.device
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    result = trainer.train()
    assert result.global_step == 3
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
