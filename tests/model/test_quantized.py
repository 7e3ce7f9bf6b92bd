"""Pre-quantized checkpoints: read from transformers' own mapping, sized as stored, never quantized
again, run where their method runs (or refused naming the package and the hardware), and fp16 only
for architectures known to be safe in it."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

import whichdevice as wd
from tiny_models import save_tiny_llama, tiny_config
from whichdevice.core.errors import ConfigConflictError, DamagedModelError, DeviceError, DeviceUnavailableError
from whichdevice.core.packages import package_version, simulated_packages
from whichdevice.model.facts import estimate_model_size
from whichdevice.model.quantized import NEEDS, known_methods, read_quantization
from whichdevice.testing import simulate

T4 = "cuda:1,cc=7.5,name=Tesla T4,mem=15GiB"
A100 = "cuda:1,cc=8.0,name=NVIDIA A100-SXM4-80GB,mem=80GiB"
H100 = "cuda:1,cc=9.0,name=NVIDIA H100,mem=80GiB"
SEVEN_B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32
)


def _folder(tmp_path: Path, name: str, quantization_config: dict, **config) -> str:
    """A 7B Llama checkpoint's config.json with the quantization_config transformers writes."""
    folder = tmp_path / name
    folder.mkdir()
    data = tiny_config(**{**SEVEN_B, "vocab_size": 32000}).to_dict() | config
    data["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)


def _gptq() -> dict:
    from transformers import GPTQConfig

    return GPTQConfig(bits=4, group_size=128).to_dict()


def _messages(res: wd.Resolution) -> str:
    return "\n".join(step.message for step in res.trace)


def test_every_method_transformers_knows_is_recognised_and_unknown_ones_fail_closed():
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert set(known_methods()) <= set(AUTO_QUANTIZER_MAPPING)
    with pytest.raises(DeviceError, match=r"quant_method='sparkle'.*upgrade transformers"):
        read_quantization({"quantization_config": {"quant_method": "sparkle"}}, "config.json")


def test_each_needs_row_matches_the_installed_quantizer_source():
    import transformers

    root = Path(transformers.__file__).parent
    for method, needs in NEEDS.items():
        assert method in known_methods(), method
        file, lines = needs.source.removeprefix("transformers/").split(":")
        text = (root / file).read_text()
        first, last = (int(n) for n in lines.split("-"))
        assert first < last <= len(text.splitlines()), needs.source
        for package in needs.packages:
            # The package's import name or pip name appears in the quantizer (validate_environment or __init__).
            names = {package, package.replace("-", "_"), package.removeprefix("optimum-")}
            assert any(n in text for n in names), (method, package)
        if needs.min_capability is not None:
            assert f"{needs.min_capability[0]}" in text and "get_device_capability" in text, method


def test_a_gptq_config_is_read_with_its_bits_group_and_estimated_size(tmp_path):
    size = estimate_model_size(_folder(tmp_path, "gptq", _gptq()))
    assert size.quantized is not None and size.quantized.method == "gptq"
    assert (size.quantized.bits, size.quantized.group_size) == (4, 128)
    # ~6.7B parameters in 4 bits with fp16 embeddings and lm_head: about 3.9 GB.
    assert 3.4 * 2**30 < size.bytes_in("float16") < 4.2 * 2**30
    assert "GPTQ 4-bit, group 128" in size.quantized.describe()


def test_gptq_runs_where_its_packages_are_and_is_never_quantized_again(tmp_path):
    path = _folder(tmp_path, "gptq", _gptq(), dtype="float16")
    with simulate(T4), simulated_packages({"optimum": "2.0.0", "gptqmodel": "5.0.0"}):
        res = wd.resolve_device(model=path)
    assert res.device == "cuda:0" and res.quantization is None
    assert "quantization_config" not in res.model_kwargs()
    assert "pre-quantized: GPTQ 4-bit, group 128" in _messages(res)


def test_gptq_without_its_packages_is_refused_naming_them(tmp_path):
    path = _folder(tmp_path, "gptq", _gptq())
    missing = simulated_packages({"optimum": None, "gptqmodel": None})
    with simulate(A100), missing, pytest.raises(DeviceUnavailableError, match="pip install optimum gptqmodel"):
        wd.resolve_device(model=path)


def test_asking_for_another_method_on_a_quantized_checkpoint_is_a_conflict(tmp_path):
    path = _folder(tmp_path, "gptq", _gptq())
    with simulate(A100), pytest.raises(ConfigConflictError, match=r"quantize='4bit'.*already quantized.*GPTQ"):
        wd.resolve_device(model=path, quantize="4bit")


def test_fp8_needs_cc_8_9_and_is_dequantized_on_a_t4(tmp_path):
    from transformers import FineGrainedFP8Config

    path = _folder(tmp_path, "fp8", FineGrainedFP8Config().to_dict(), dtype="bfloat16")
    with simulate(H100):
        fast = wd.resolve_device(model=path)
    with simulate(T4), pytest.raises(DeviceError) as err:
        wd.resolve_device(model=path)
    with simulate("cuda:1,cc=7.5,name=Quadro RTX 8000,mem=48GiB"):
        slow = wd.resolve_device(model=path)
    assert fast.device == slow.device == "cuda:0"
    assert "FP8 kernels need compute capability >= 8.9; this GPU is 7.5" in _messages(slow)
    assert "dequantized" in _messages(slow)
    # Dequantized, the 7B weights no longer fit 15 GiB: said, not hidden.
    assert "already quantized" in str(err.value) or "does not fit" in str(err.value)


def test_mxfp4_without_triton_and_kernels_loads_dequantized(tmp_path):
    from transformers import Mxfp4Config

    path = _folder(tmp_path, "mxfp4", Mxfp4Config().to_dict(), dtype="bfloat16")
    with simulate("cpu,mem=128GiB"), simulated_packages({"triton": None, "kernels": None}):
        res = wd.resolve_device(model=path)
    assert res.device == "cpu"
    assert "MXFP4 needs triton, kernels installed" in _messages(res)


def test_a_real_bitsandbytes_4bit_save_loads_and_generates_sized_as_stored(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = save_tiny_llama(tmp_path / "base", tokenizer=False, hidden_size=256, intermediate_size=512)
    quantized = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(load_in_4bit=True), device_map="cpu"
    )
    quantized.save_pretrained(tmp_path / "bnb4")
    res = wd.resolve_device("cpu", model=str(tmp_path / "bnb4"))
    size = estimate_model_size(str(tmp_path / "bnb4"))
    assert size.quantized is not None and size.quantized.stored_bytes is not None
    assert abs(size.bytes_in(res.dtype_name) - size.quantized.stored_bytes) <= 0.1 * size.quantized.stored_bytes
    assert "pre-quantized: bitsandbytes 4-bit" in _messages(res)
    with pytest.raises(ConfigConflictError, match=r"quantize='8bit'"):
        wd.resolve_device("cpu", model=str(tmp_path / "bnb4"), quantize="8bit")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bnb4", **res.model_kwargs())
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_a_real_torchao_int8_save_loads_and_generates_sized_as_loaded(tmp_path):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    base = save_tiny_llama(tmp_path / "base", tokenizer=False, hidden_size=256, intermediate_size=512)
    config = TorchAoConfig(Int8WeightOnlyConfig())
    AutoModelForCausalLM.from_pretrained(base, quantization_config=config, device_map="cpu").save_pretrained(
        tmp_path / "int8"
    )
    res = wd.resolve_device("cpu", model=str(tmp_path / "int8"))
    size = estimate_model_size(str(tmp_path / "int8"))
    stored = (tmp_path / "int8" / "model.safetensors").stat().st_size
    assert size.quantized is not None and size.quantized.method == "torchao"
    # The stored figure in the trace is the file's tensor data (the file less its JSON header).
    assert stored * 0.9 <= (size.quantized.stored_bytes or 0) <= stored
    assert "pre-quantized: torchao 8-bit" in _messages(res)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "int8", **res.model_kwargs())
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_an_adapter_folder_is_sized_as_its_base_plus_the_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = save_tiny_llama(tmp_path / "base", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(base)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    size = estimate_model_size(str(tmp_path / "adapter"))
    assert size.parameters == estimate_model_size(str(base)).parameters
    assert size.other_bytes > 0 and "plus the adapter" in size.source
    res = wd.resolve_device("cpu", model=str(tmp_path / "adapter"))
    assert "plus the adapter" in _messages(res)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(DeviceError, match=r"PEFT adapter for .*not here.*hf download"):
        wd.resolve_device("cpu", model=str(tmp_path / "adapter"))


def test_a_bin_only_folder_with_custom_code_is_refused_without_running_it(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    config = {"model_type": "sparkle_lm", "auto_map": {"AutoConfig": "conf.SparkleConfig"}, "hidden_size": 8}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "conf.py").write_text("raise SystemExit('the folder code ran')\n")
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(DeviceError, match="never runs") as err:
        estimate_model_size(str(folder))
    assert "damaged" not in str(err.value)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "gpt_oss"])
def test_unlisted_architectures_get_fp32_on_a_t4_with_the_opt_in(tmp_path, model_type):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "dtype": "bfloat16"}))
    with simulate(T4):
        res = wd.resolve_device(model=str(folder), device_map="cuda:0")
        training = wd.resolve_device(model=str(folder), device_map="cuda:0", task="training")
        opted = wd.resolve_device(model=str(folder), device_map="cuda:0", dtype="float16")
    assert res.dtype_name == "float32"
    assert "not on the fp16 allow-list" in _messages(res) and "dtype='float16' to opt in" in _messages(res)
    assert training.training_kwargs()["fp16"] is False
    assert opted.dtype_name == "float16"


def test_every_fp16_allow_list_entry_names_its_evidence():
    from transformers import CONFIG_MAPPING

    from whichdevice.precision.fp16_safe import FP16_SAFE

    for model_type, evidence in FP16_SAFE.items():
        assert model_type in CONFIG_MAPPING, model_type
        assert re.search(r"config\.json|paper|model card", evidence), model_type


def test_package_names_come_from_the_quantizer_source_not_a_guess():
    from transformers.quantizers.quantizer_gptq import GptqHfQuantizer

    source = inspect.getsource(GptqHfQuantizer.validate_environment)
    for package in NEEDS["gptq"].packages:
        assert f"pip install {package}" in source
    assert package_version("transformers") is not None


def test_an_unlisted_architecture_that_does_not_fit_in_fp32_gets_4bit_weights_with_fp32_compute(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3", **SEVEN_B, vocab_size=32000).to_dict() | {"dtype": "bfloat16"}
    folder = tmp_path / "qwen3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with simulate(T4):
        res = wd.resolve_device(model=str(folder))
    assert res.dtype_name == "float32"
    assert res.quantization is not None and res.quantization.bits == 4
    assert res.quantization.compute_dtype == "float32"
    assert "not on the fp16 allow-list" in _messages(res)


def _adapter_naming(folder, base) -> None:
    folder.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": str(base)}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_an_adapter_chain_or_cycle_is_refused_naming_both_adapter_configs(tmp_path):
    # transformers follows one adapter to its base (models/auto/auto_factory.py): two adapters naming
    # each other was a RecursionError, printed by the command as an internal error.
    _adapter_naming(tmp_path / "a", tmp_path / "b")
    _adapter_naming(tmp_path / "b", tmp_path / "a")
    with pytest.raises(DamagedModelError, match="a cycle") as err:
        wd.resolve_device("cpu", model=str(tmp_path / "a"))
    assert str(tmp_path / "a" / "adapter_config.json") in str(err.value)
    assert str(tmp_path / "b" / "adapter_config.json") in str(err.value)
    # A chain (an adapter over an adapter over a model) is refused the same way, without "cycle".
    save_tiny_llama(tmp_path / "model", tokenizer=False)
    _adapter_naming(tmp_path / "c", tmp_path / "model")
    _adapter_naming(tmp_path / "d", tmp_path / "c")
    with pytest.raises(DamagedModelError, match="PEFT adapter too") as err:
        wd.resolve_device("cpu", model=str(tmp_path / "d"))
    assert "a cycle" not in str(err.value) and "base_model_name_or_path" in str(err.value)
    assert wd.resolve_device("cpu", model=str(tmp_path / "c")).device == "cpu"  # one adapter: its base


def test_an_adapter_whose_base_is_no_model_folder_is_named_as_the_adapters_claim(tmp_path, monkeypatch):
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0\n")
    (tmp_path / "deep").mkdir()
    _adapter_naming(tmp_path / "deep" / "er", "../../etc")
    monkeypatch.chdir(tmp_path / "deep" / "er")  # transformers reads the base's path from the working folder
    with pytest.raises(DamagedModelError) as err:
        wd.resolve_device("cpu", model=".")
    said = str(err.value)
    assert "names '../../etc' as its base model" in said and "not a model" in said
    assert "incomplete download" not in said and "--force-download" not in said


@pytest.mark.parametrize("spec", [None, "cpu,flags=avx512_bf16", "cpu,flags="])
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_4bit_checkpoint_announces_the_compute_dtype_and_weights_it_loads_with(tmp_path, spec, stored):
    """A pre-quantized bitsandbytes checkpoint keeps its saved bnb_4bit_compute_dtype and its stored float
    weights whatever dtype= says: what the trace announces is read back from the loaded model."""
    import contextlib

    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = save_tiny_llama(tmp_path / "base", dtype=stored, tokenizer=False)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(base, dtype=stored, quantization_config=config, device_map="cpu") \
        .save_pretrained(tmp_path / "bnb4")  # fmt: skip
    with simulate(spec) if spec else contextlib.nullcontext():
        res = wd.resolve_device(model=str(tmp_path / "bnb4"))
    said = _messages(res)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bnb4", **res.model_kwargs())
    layer = next(m for m in loaded.modules() if isinstance(m, bnb.nn.Linear4bit))
    assert f"its 4-bit layers compute in {str(layer.compute_dtype).removeprefix('torch.')}" in said
    assert res.dtype == loaded.model.embed_tokens.weight.dtype == loaded.model.norm.weight.dtype == stored
    assert "downcast" not in said
    if not wd.probe("cpu").devices[0].bf16 if spec is None else spec.endswith("="):
        assert "the 4-bit layers compute in bfloat16, which is slow here" in said
    if spec is None:
        # dtype= asked for is not what loads: said, and what is handed over is what loads.
        asked = wd.resolve_device(model=str(tmp_path / "bnb4"), dtype="float16")
        assert "dtype='float16' does not apply here" in _messages(asked) and asked.dtype == stored
