"""Hub kernels layer by layer: a model's marked layers, looked up in the installed transformers' mapping,
for inference and for training, with nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

import whichdevice as wd
from tiny_models import save_tiny_llama, tiny_config
from whichdevice.attention.kernel_layers import _repos_here, marked_layers, model_kernel_layers
from whichdevice.testing import simulate

pytest.importorskip("kernels")


@pytest.fixture(autouse=True)
def nothing_downloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing reads the mapping and the classes; loading a kernel (the download) fails the test."""
    import kernels
    from kernels import LayerRepository

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Hub kernel was loaded while resolving")

    monkeypatch.setattr(kernels, "get_kernel", refuse)
    monkeypatch.setattr(LayerRepository, "load", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the Hub not switched off: kernels may be on


def _kernel_lines(res: wd.Resolution) -> list[str]:
    return [s.message for s in res.trace if s.topic == "kernels"]


def _resolve(spec: str, task: str, model: object = None) -> wd.Resolution:
    with simulate(spec):
        return wd.resolve_device(model=model if model is not None else tiny_config(), use_kernels="auto", task=task)


def test_a_llama_on_a_cuda_gpu_lists_its_layers_for_inference() -> None:
    res = _resolve("cuda:1", "inference")
    if not res.use_kernels:
        pytest.skip("the installed kernels is outside transformers' range: Hub kernels are off")
    (on, layers) = _kernel_lines(res)
    assert on.startswith("Hub kernels on")
    for layer, repo in (
        ("LlamaRMSNorm (RMSNorm) x5", "kernels-community/liger-kernels"),
        ("LlamaAttention.rotary_pos_emb (rotary_pos_emb) x2", "kernels-community/rotary"),
        ("SiLUActivation (SiLU) x2", "kernels-community/activation"),
    ):
        assert f"{layer} -> {repo}" in layers
    assert "mapping for cuda (cc 8.0), inference" in layers and "without one (their own forward): none" in layers
    assert res.model_kwargs()["use_kernels"] is True


def test_a_llama_on_a_cuda_gpu_for_training_names_the_layers_without_a_training_kernel() -> None:
    res = _resolve("cuda:1", "training")
    if not res.use_kernels:
        pytest.skip("the installed kernels is outside transformers' range: Hub kernels are off")
    training = _kernel_lines(res)[-1]
    trains, _, rest = training.partition("mapped for inference only")
    assert "LlamaRMSNorm (RMSNorm) x5" in trains and "LlamaAttention.rotary_pos_emb" in trains
    assert "SiLUActivation (SiLU) x2" in rest and "SiLUActivation" not in trains
    assert "has a backward is known once it is downloaded" in training


def test_other_devices_read_their_own_entries() -> None:
    xpu = _resolve("xpu:1", "inference")
    rocm = _resolve("cuda:1,variant=rocm", "training")
    if not (xpu.use_kernels and rocm.use_kernels):
        pytest.skip("Hub kernels are off here")
    layers = _kernel_lines(xpu)[-1]
    assert "without one (their own forward): LlamaRMSNorm (RMSNorm) x5" in layers  # cuda and rocm only
    assert "rotary_pos_emb) x2 -> kernels-community/rotary" in layers
    rocm_layers, rocm_training = _kernel_lines(rocm)[-2:]
    assert "rotary_pos_emb) x2 -> kernels-community/aiter-rope" in rocm_layers
    assert "inference only" in rocm_training and "rotary_pos_emb" in rocm_training.partition("inference only")[2]


def test_the_layers_are_read_from_the_built_model_and_the_installed_mapping() -> None:
    """The marks and the mapping come from transformers, checked here against the objects themselves."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.hub_kernels import get_kernel_mapping_transformers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config())
    marks = marked_layers(model)
    assert marks[("LlamaRMSNorm", "RMSNorm")] == 2 * 2 + 1  # two per decoder layer, one final
    mapping = get_kernel_mapping_transformers()
    for layer in model_kernel_layers(model, "cuda", (8, 0)):
        assert (layer.repository is not None) == ("cuda" in mapping.get(layer.layer_name, {}))


def test_a_capability_range_claims_only_its_gpus() -> None:
    """An entry keyed by a kernels Device with a capability range (the installed mapping's GB10-only one)."""
    from transformers.integrations.hub_kernels import get_kernel_mapping_transformers

    ranged = {
        name: entry
        for name, entry in get_kernel_mapping_transformers().items()
        if any(getattr(d, "properties", None) is not None for d in entry)
    }
    if not ranged:
        pytest.skip("no capability-ranged entry in this transformers' mapping")
    entry = next(iter(ranged.values()))
    device = next(d for d in entry if getattr(d, "properties", None) is not None)
    low, high = device.properties.min_capability, device.properties.max_capability
    inside = (low // 10, low % 10)
    assert _repos_here(entry, device.type, inside) is not None
    outside = (8, 0) if not low <= 80 <= high else (12, 9)
    assert _repos_here(entry, device.type, outside) is None
    assert _repos_here(entry, device.type, None) is None  # an unknown capability is not claimed


def test_without_model_the_trace_says_to_pass_it_and_off_says_nothing() -> None:
    with simulate("cuda:1"):
        on = wd.resolve_device(use_kernels="auto")
        off = wd.resolve_device(model=tiny_config())
    if on.use_kernels:
        assert _kernel_lines(on)[-1] == "pass model= to list which of the model's layers have a Hub kernel here"
    assert len(_kernel_lines(off)) == 1 and "Hub kernels off" in _kernel_lines(off)[0]


def test_a_model_folder_is_listed_from_its_config(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "llama", tokenizer=False)
    res = _resolve("cuda:1", "inference", str(path))
    if not res.use_kernels:
        pytest.skip("Hub kernels are off here")
    assert "LlamaRMSNorm (RMSNorm) x5 -> kernels-community/liger-kernels" in _kernel_lines(res)[-1]


def test_a_mamba2_lists_its_scan_kernels_and_the_layers_the_mapping_lacks() -> None:
    from transformers import Mamba2Config

    config = Mamba2Config(
        hidden_size=64, num_hidden_layers=2, vocab_size=64, num_heads=4, head_dim=32, state_size=8, n_groups=1
    )
    res = _resolve("cuda:1,cc=9.0,name=NVIDIA H100", "training", config)
    if not res.use_kernels:
        pytest.skip("Hub kernels are off here")
    layers, training = _kernel_lines(res)[-2:]
    assert (
        "Mamba2Mixer.mamba_chunk_scan_combined (mamba_chunk_scan_combined) x2 -> kernels-community/mamba-ssm" in layers
    )
    # Names transformers marks but maps to no kernel (it leaves them to vLLM): their own forward runs.
    without = layers.partition("without one (their own forward): ")[2]
    assert "Mamba2Mixer.mamba2_scan_forward (mamba2_scan_forward) x2" in without
    assert "Mamba2Mixer.mamba_chunk_scan_combined" in training.partition("inference only")[0]
