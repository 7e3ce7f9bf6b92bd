"""training_arguments(arguments_class=...): the TrainingArguments subclasses users pass (TRL,
sentence-transformers, optimum-habana), their own keywords passed through, and their defaults not
allowed to override whichdevice's precision."""

from __future__ import annotations

import dataclasses
import os

import pytest
from transformers import TrainingArguments

import whichdevice as wd
from whichdevice.testing import simulate
from whichdevice.training.arguments import ArgumentsClassError

# TrainingArguments exports ACCELERATE_* variables by design (see conftest.py)
pytestmark = pytest.mark.usefixtures("restore_accelerate_variables")


@dataclasses.dataclass
class VendorTrainingArguments(TrainingArguments):
    """Stands in for optimum-habana's GaudiTrainingArguments (which needs the Gaudi software stack):
    a subclass with keywords of its own."""

    use_vendor_graphs: bool = False
    vendor_config_name: str | None = None


def test_sft_config_keeps_its_keywords_and_takes_the_resolved_precision(tmp_path, cpu_kind):
    from trl import SFTConfig

    args = wd.training_arguments(str(tmp_path), arguments_class=SFTConfig, max_length=32, report_to=[])
    assert type(args) is SFTConfig
    assert args.max_length == 32
    assert str(args.device) == "cpu"
    # SFTConfig defaults bf16=True; whichdevice states both flags, so the probe decides.
    assert args.bf16 is (cpu_kind.dtype == "bfloat16")
    assert args.fp16 is False


@pytest.mark.parametrize("name", ["DPOConfig", "GRPOConfig"])
def test_other_trl_configs_on_a_cpu_without_native_bf16(tmp_path, name):
    import trl

    with simulate("cpu,flags="):
        args = wd.training_arguments(str(tmp_path), arguments_class=getattr(trl, name), report_to=[])
    assert type(args).__name__ == name
    assert args.bf16 is False and args.fp16 is False  # their default is bf16=True


def test_sentence_transformers_arguments(tmp_path, monkeypatch):
    # Importing sentence-transformers exports two OpenMP settings (its doing, not whichdevice's).
    for name in ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # remembered, and put back afterwards
        monkeypatch.delenv(name)
    from sentence_transformers import SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers

    args = wd.training_arguments(
        str(tmp_path),
        arguments_class=SentenceTransformerTrainingArguments,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        report_to=[],
    )
    assert isinstance(args, SentenceTransformerTrainingArguments)
    assert args.batch_sampler == BatchSamplers.NO_DUPLICATES
    assert args.use_cpu is True


def test_a_vendor_subclass_gets_its_own_keywords(tmp_path):
    args = wd.training_arguments(
        str(tmp_path), arguments_class=VendorTrainingArguments, use_vendor_graphs=True, report_to=[]
    )
    assert type(args) is VendorTrainingArguments
    assert args.use_vendor_graphs is True and args.vendor_config_name is None


@pytest.mark.parametrize("wrong", [dict, "SFTConfig", 3])
def test_a_class_that_is_not_training_arguments_is_refused(tmp_path, wrong):
    with pytest.raises(ArgumentsClassError) as err:
        wd.training_arguments(str(tmp_path), arguments_class=wrong)
    assert isinstance(err.value, TypeError) and isinstance(err.value, wd.DeviceError)
    text = str(err.value)
    assert "not a subclass of transformers.TrainingArguments" in text and "trl.SFTConfig" in text


def test_an_instance_instead_of_the_class_says_so(tmp_path):
    instance = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ArgumentsClassError, match="pass the class itself"):
        wd.training_arguments(str(tmp_path), arguments_class=instance)  # type: ignore[arg-type]


def test_a_keyword_of_another_class_names_arguments_class(tmp_path):
    with pytest.raises(ArgumentsClassError) as err:
        wd.training_arguments(str(tmp_path), max_length=32)
    assert "TrainingArguments takes no max_length" in str(err.value)
    assert "arguments_class=" in str(err.value)
    with pytest.raises(ArgumentsClassError, match="did you mean learning_rate"):
        wd.training_arguments(str(tmp_path), learning_rte=1e-3)


@pytest.mark.slow
def test_sft_trainer_trains_three_steps(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from tiny_models import save_tiny_llama

    path = save_tiny_llama(tmp_path / "model")
    texts = [" ".join(f"t{(7 * i + j) % 250}" for j in range(12)) for i in range(16)]
    args = wd.training_arguments(
        str(tmp_path / "out"),
        arguments_class=SFTConfig,
        max_length=32,
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    res = wd.resolve_device(task="training", model=path)
    model = AutoModelForCausalLM.from_pretrained(path, **res.model_kwargs(dtype=None))
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=AutoTokenizer.from_pretrained(path),
    )
    result = trainer.train()
    assert result.global_step == 3
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
