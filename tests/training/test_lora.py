"""lora_training(): QLoRA end to end on this CPU, target modules per architecture, k-bit TrainingArguments."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import whichdevice as wd
from whichdevice.testing import simulate
from whichdevice.training.lora import kbit_training_kwargs, lora_target_modules

LLAMA_LINEAR = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")


class SameBatch(torch.utils.data.Dataset):
    """One fixed batch of random sequences, so every step sees the same data and the loss must fall."""

    def __init__(self, n: int = 4, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 250, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _tiny_model(cls_name: str = "LlamaForCausalLM", **overrides):
    import transformers

    from tiny_models import tiny_config

    torch.manual_seed(0)
    return getattr(transformers, cls_name)(tiny_config(**overrides))


# ------------------------------------------------------------------------- end to end, real


@pytest.mark.slow
def test_qlora_end_to_end_on_this_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget too small for training the bf16 weights, full or with LoRA -> 4-bit; the model really loads in
    4-bit; LoRA trains; the adapter round-trips."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # bitsandbytes looks for a CPU kernel on the Hub
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Trainer

    from tiny_models import save_tiny_llama

    checkpoint = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    # bf16 stated, so the numbers hold on CPUs without native bf16 too (where "auto" picks fp32)
    # Priced (memory/training_job.py, rank-16 adapters): full fine-tuning 835 KiB, LoRA 721 KiB, QLoRA 678 KiB.
    res = wd.resolve_device(
        "cpu", model=str(checkpoint), max_memory={"cpu": "700KiB"}, task="training", dtype=torch.bfloat16
    )
    plan = res.quantization
    assert plan is not None and plan.bits == 4 and res.device_map == "cpu"
    assert res.training_setup is not None and res.training_setup.train == "qlora"
    assert plan.full_bytes is not None and plan.quantized_bytes is not None
    assert plan.quantized_bytes < plan.full_bytes

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), **res.model_kwargs())
    assert isinstance(model.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
    assert abs(model.get_memory_footprint() - plan.quantized_bytes) < 0.05 * plan.quantized_bytes

    lora = wd.lora_training(model, res, r=8, lora_alpha=16, lora_dropout=0.0)
    assert lora.bits == 4 and lora.task_type == "CAUSAL_LM"
    assert lora.target_modules == LLAMA_LINEAR
    # r=8 on every linear layer of both layers: (in + out) * 8 per layer
    per_layer = 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 2 + (128 + 64))
    assert lora.trainable_parameters == 2 * per_layer == 16_384
    assert "prepare_model_for_kbit_training" in lora.explain()

    args = lora.training_arguments(
        str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=2e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    assert args.use_cpu and args.bf16 == bool(res.training_kwargs().get("bf16"))  # native bf16 here or not
    assert args.activation_checkpointing and args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert args.learning_rate == 2e-2 and args.max_steps == 4  # the caller's, untouched

    trainer = Trainer(model=lora.model, args=args, train_dataset=SameBatch())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    lora_b = [p for n, p in lora.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # lora_B starts at zero

    adapter = tmp_path / "adapter"
    lora.model.save_pretrained(adapter)
    assert (adapter / "adapter_model.safetensors").exists() and (adapter / "adapter_config.json").exists()

    batch = SameBatch()[0]["input_ids"][None]
    lora.model.eval()
    with torch.no_grad():
        trained = lora.model(input_ids=batch).logits.float()
    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), **res.model_kwargs())
    loaded = PeftModel.from_pretrained(base, adapter)
    loaded.eval()
    with torch.no_grad():
        again = loaded(input_ids=batch).logits.float()
    # same adapter on the same 4-bit weights; the trained copy computes its head in fp32 (upcast)
    assert torch.allclose(trained, again, atol=0.1), (trained - again).abs().max()
    with torch.no_grad(), loaded.disable_adapter():
        without = loaded(input_ids=batch).logits.float()
    assert not torch.allclose(without, again, atol=1e-3)  # the adapter really changes the output


# ------------------------------------------------------------ target modules per architecture


def test_targets_are_every_linear_layer_but_the_head() -> None:
    targets, why = lora_target_modules(_tiny_model())
    assert targets == LLAMA_LINEAR and "except the output head (lm_head)" in why


def test_targets_for_gpt2_conv1d() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64))
    targets, _ = lora_target_modules(model)
    assert targets == ("c_attn", "c_fc", "c_proj")


def test_sequence_classification_head_is_not_a_target(tmp_path) -> None:
    model = _tiny_model("LlamaForSequenceClassification", num_labels=3)
    targets, why = lora_target_modules(model)
    assert "score" not in targets and targets == LLAMA_LINEAR and "(score)" in why
    lora = wd.lora_training(model, wd.resolve_device("cpu", task="training"), gradient_checkpointing=False)
    assert lora.task_type == "SEQ_CLS"


def test_peft_default_when_no_linear_layers() -> None:
    class Embeddings(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"model_type": "llama"})()
            self.embed = torch.nn.Embedding(10, 4)

    targets, why = lora_target_modules(Embeddings())
    assert targets == ("q_proj", "v_proj") and "PEFT's default for model type 'llama'" in why
    bare = Embeddings()
    bare.config.model_type = "no-such-model"
    with pytest.raises(wd.DeviceError, match="pass target_modules"):
        lora_target_modules(bare)


# ------------------------------------------------------------- lora_training without k-bit


def test_unquantized_model_without_a_resolution() -> None:
    model = _tiny_model()
    lora = wd.lora_training(model, target_modules=["q_proj", "v_proj"], r=4)
    assert lora.resolution.device == "cpu" and lora.resolution.task == "training"
    assert lora.bits is None and lora.target_modules == ("q_proj", "v_proj") and lora.target_source == "as you passed"
    assert lora.trainable_parameters == 2 * 4 * ((64 + 64) + (64 + 32))
    assert lora.gradient_checkpointing and lora.model.get_base_model().is_activation_checkpointing
    data = lora.to_dict()
    assert data["r"] == 4 and data["bits"] is None and data["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(wd.ConfigConflictError, match="already has PEFT adapters"):
        wd.lora_training(lora.model)


def test_note_when_the_model_was_not_loaded_as_planned(tmp_path) -> None:
    from tiny_models import save_tiny_llama

    checkpoint = save_tiny_llama(tmp_path / "tiny", dtype=torch.bfloat16, tokenizer=False)
    res = wd.resolve_device("cpu", model=str(checkpoint), max_memory={"cpu": "150KiB"}, dtype="bfloat16")
    lora = wd.lora_training(_tiny_model(), res, gradient_checkpointing=False)
    assert any("planned 4-bit" in n for n in lora.notes)
    assert any("resolution is for inference" in n for n in lora.notes)


# ---------------------------------------------------------------- TrainingArguments for k-bit


@pytest.mark.parametrize(
    ("spec", "optim"),
    [("cuda:1", "paged_adamw_8bit"), ("cuda:1,variant=rocm", None), ("xpu:1", None), ("hpu:8", None), ("cpu", None)],
)
def test_kbit_kwargs_per_backend(spec, optim) -> None:
    with simulate(spec):
        res = wd.resolve_device(task="training", quantize="4bit")
    kwargs = kbit_training_kwargs(res, 4)
    assert kwargs["activation_checkpointing"] is True
    assert kwargs["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    assert kwargs.get("optim") == optim
    assert "ddp_find_unused_parameters" not in kwargs
    assert "optim" not in kbit_training_kwargs(res, None)  # unquantized: torch's AdamW
    # Stated off, so a resolution whose plan checkpoints (training_kwargs()) does not switch it back on.
    assert kbit_training_kwargs(res, 4, gradient_checkpointing=False) == ({"optim": optim} if optim else {}) | {
        "activation_checkpointing": False
    }


def test_kbit_kwargs_under_ddp(monkeypatch) -> None:
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with simulate("cuda:2"):
        res = wd.resolve_device(task="training")
    assert res.distributed is not None
    assert kbit_training_kwargs(res, 4)["ddp_find_unused_parameters"] is False


def test_user_kwargs_are_kept_as_passed(tmp_path) -> None:
    lora = wd.lora_training(_tiny_model(), wd.resolve_device("cpu", task="training"), r=4)
    # the deprecated name is the user's choice too: ours is not added beside it under the new name
    args = lora.training_arguments(str(tmp_path), gradient_checkpointing=False, report_to="none")
    assert args.activation_checkpointing is False
    args = lora.training_arguments(
        str(tmp_path), activation_checkpointing_kwargs={"use_reentrant": True}, report_to="none"
    )
    assert args.activation_checkpointing is True and args.activation_checkpointing_kwargs == {"use_reentrant": True}
    args = lora.training_arguments(str(tmp_path), optim="sgd", learning_rate=0.5, report_to="none")
    assert args.optim == "sgd" and args.learning_rate == 0.5
    assert lora.training_kwargs()["use_cpu"] is True
