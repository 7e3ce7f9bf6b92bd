"""TF32: the gain said where a resolution computes in fp32, and tf32=True handed over only where it was cleared."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.core.packages import package_version
from whichdevice.model.facts import ModelFacts
from whichdevice.model.size import CheckpointDtype
from whichdevice.precision import tf32 as tf32_module
from whichdevice.precision.full_fp32 import FULL_FP32_MATMULS, SOURCE
from whichdevice.testing import simulate
from whichdevice.training.simulated import SimulatedTrainingError

ROOT = Path(__file__).resolve().parents[2]
SAME_TRANSFORMERS = (package_version("transformers") or "").split(".")[:2] == SOURCE.split(".")[:2]


def _bert():
    from transformers import BertConfig

    return BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)


def _deepseek():
    from transformers import DeepseekV3Config

    small = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2)
    return DeepseekV3Config(**small, num_attention_heads=4, num_key_value_heads=4, vocab_size=256)


def _tf32_line(res: wd.Resolution) -> str:
    return next(s.message for s in res.trace if s.topic == "tf32")


# --------------------------------------------------------------------------- the list and its source


def test_the_list_is_what_the_installed_transformers_computes_in_fp32() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_full_fp32.py"), "--check"], capture_output=True, text=True
    )
    if SAME_TRANSFORMERS:
        assert done.returncode == 0, done.stderr
    else:
        # Another transformers: the list is not trusted, so tf32 is never handed over (fails closed).
        facts = ModelFacts("x", {"model_type": "bert"}, CheckpointDtype("float32", "bert", "x"), None)
        problem = tf32_module._architecture_problem(facts)
        assert problem is not None and f"read from transformers {SOURCE}" in problem


@pytest.mark.skipif(not SAME_TRANSFORMERS, reason=f"the list was read from transformers {SOURCE}")
def test_every_entry_cites_an_fp32_matmul_in_the_installed_modeling_file() -> None:
    import transformers

    models = Path(transformers.__file__).parent / "models"
    assert len(FULL_FP32_MATMULS) > 10 and "deepseek_v3" in FULL_FP32_MATMULS and "llama" not in FULL_FP32_MATMULS
    for module, lines in FULL_FP32_MATMULS.items():
        text = (models / module / f"modeling_{module}.py").read_text(encoding="utf-8").splitlines()
        for number in lines:
            line = text[number - 1]
            assert "float" in line and any(m in line for m in ("linear(", "matmul(", "mm(", "einsum(", " @ ")), line


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"model_type": "bert"}, None),
        ({"model_type": "deepseek_v3"}, "'deepseek_v3' computes matmuls in fp32 on purpose"),
        ({"model_type": "llava", "text_config": {"model_type": "glm4v_moe_text"}}, "'glm4v_moe_text' computes"),
        ({"model_type": "bert", "auto_map": {"AutoModel": "x.Y"}}, "its own code"),
        ({"architectures": ["X"]}, "names no model_type"),
    ],
)
def test_architectures_are_cleared_only_when_known_and_read(config: dict, problem: str | None) -> None:
    if not SAME_TRANSFORMERS:
        pytest.skip(f"the list was read from transformers {SOURCE}")
    facts = ModelFacts("x", config, CheckpointDtype("float32", config.get("model_type"), "x"), None)
    found = tf32_module._architecture_problem(facts)
    assert (found is None) if problem is None else (found is not None and problem in found)
    assert "pass model=" in (tf32_module._architecture_problem(None) or "")


# ----------------------------------------------------------------------------------- the resolver


@pytest.mark.skipif(not SAME_TRANSFORMERS, reason=f"the list was read from transformers {SOURCE}")
def test_fp32_training_on_ampere_hands_tf32_over_with_the_gain() -> None:
    with simulate("cuda:1"):
        res = wd.resolve_device(task="training", dtype="float32", model=_bert())
    assert res.tf32 is True and res.training_kwargs()["tf32"] is True
    line = _tf32_line(res)
    assert "156 TFLOPS in TF32 against 19.5 in FP32 (8.0x; NVIDIA A100 datasheet" in line
    assert "'bert' computes no matmul in fp32 on purpose" in line


@pytest.mark.parametrize(
    ("spec", "kwargs", "words"),
    [
        ("cuda:1", {"dtype": "float32", "model": "deepseek"}, "computes matmuls in fp32 on purpose"),
        ("cuda:1", {"dtype": "float32"}, "no model= to check the architecture"),
        ("cuda:1,cc=9.0", {"dtype": "float32"}, "494.5 TFLOPS in TF32 against 67 in FP32"),
        ("cuda:1,name=NVIDIA GeForce RTX 4090", {"dtype": "float32"}, "82.6 TFLOPS in TF32 against 82.6 in FP32 (1.0x"),
        ("cuda:1,name=NVIDIA A40,cc=8.6,mem=48GiB", {"dtype": "float32"}, "peaks are not in whichdevice's table"),
    ],
)
def test_where_tf32_is_said_but_not_handed_over(spec: str, kwargs: dict, words: str) -> None:
    if kwargs.get("model") == "deepseek":
        kwargs = {**kwargs, "model": _deepseek()}
    with simulate(spec):
        res = wd.resolve_device(task="training", **kwargs)
    assert res.tf32 is None and "tf32" not in res.training_kwargs()
    assert words in _tf32_line(res)


@pytest.mark.parametrize(
    ("spec", "kwargs"),
    [
        ("cuda:1", {}),  # bf16 autocast: the matmuls are 16-bit already
        ("cuda:1,cc=7.5", {"dtype": "float32"}),  # a T4: no TF32
        ("cuda:1,variant=rocm", {"dtype": "float32"}),
        ("cpu", {"dtype": "float32"}),
    ],
)
def test_no_tf32_where_nothing_computes_in_fp32_on_tensor_cores(spec: str, kwargs: dict) -> None:
    with simulate(spec):
        res = wd.resolve_device(task="training", model=_bert(), **kwargs)
    assert res.tf32 is None and not any(s.topic == "tf32" for s in res.trace)


def test_inference_in_fp32_says_how_to_turn_it_on() -> None:
    with simulate("cuda:1"):
        res = wd.resolve_device(dtype="float32", model=_bert())
    assert res.tf32 is None
    assert "whichdevice sets nothing: to use it, set torch.backends.fp32_precision = 'tf32'" in _tf32_line(res)


def test_a_tf32_setting_of_the_users_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    with simulate("cuda:1"):
        res = wd.resolve_device(task="training", dtype="float32", model=_bert())
    assert res.tf32 is None and "you set TF32 yourself (NVIDIA_TF32_OVERRIDE='0')" in _tf32_line(res)
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
    before = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.fp32_precision)
    torch.set_float32_matmul_precision("high")
    try:
        with simulate("cuda:1"):
            res = wd.resolve_device(task="training", dtype="float32", model=_bert())
    finally:
        # set_float32_matmul_precision leaves cuda.matmul.fp32_precision set: restore both as found
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cuda.matmul.fp32_precision = before[1]
    assert res.tf32 is None and "you set TF32 yourself" in _tf32_line(res)


@pytest.mark.skipif(not SAME_TRANSFORMERS, reason=f"the list was read from transformers {SOURCE}")
def test_nothing_is_set_globally() -> None:
    import torch

    before = (torch.get_float32_matmul_precision(), torch.backends.fp32_precision)
    with simulate("cuda:1"):
        res = wd.resolve_device(task="training", dtype="float32", model=_bert())
        res.training_kwargs()
    assert res.tf32 is True
    assert (torch.get_float32_matmul_precision(), torch.backends.fp32_precision) == before


# ------------------------------------------------------------------ a real TrainingArguments on the CPU


def test_tf32_is_a_trainingarguments_keyword_that_transformers_checks_against_the_hardware(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    field = next(f for f in dataclasses.fields(TrainingArguments) if f.name == "tf32")
    assert field.default is None
    # On this CPU transformers refuses tf32=True (is_torch_tf32_available() is False without an
    # Ampere GPU) and takes tf32=False: so whichdevice hands it over only for a GPU that has TF32.
    with pytest.raises(ValueError, match="--tf32 requires Ampere or a newer GPU arch"):
        TrainingArguments(str(tmp_path), use_cpu=True, tf32=True, report_to=[])
    assert TrainingArguments(str(tmp_path), use_cpu=True, tf32=False, report_to=[]).tf32 is False
    assert "tf32" not in wd.resolve_device("cpu", task="training", dtype="float32", model=_bert()).training_kwargs()


@pytest.mark.skipif(not SAME_TRANSFORMERS, reason=f"the list was read from transformers {SOURCE}")
def test_what_training_arguments_would_build_with(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    with simulate("cuda:1"):
        res = wd.resolve_device(task="training", dtype="float32", model=_bert())
        with pytest.raises(SimulatedTrainingError) as ours:
            wd.training_arguments(str(tmp_path), resolution=res)
        with pytest.raises(SimulatedTrainingError) as theirs:
            wd.training_arguments(str(tmp_path), resolution=res, tf32=False)
    assert ours.value.kwargs["tf32"] is True and theirs.value.kwargs["tf32"] is False
    # The rest of what is handed over builds a real TrainingArguments here; tf32=True itself only
    # passes transformers' check on a GPU that has TF32 (above).
    built = TrainingArguments(**{**ours.value.kwargs, "tf32": None, "use_cpu": True, "report_to": []})
    assert built.bf16 is False and built.fp16 is False
