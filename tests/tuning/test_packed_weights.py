"""Packed linear weights on real models (Llama and eleven other architectures): the same outputs where
this CPU's oneDNN packs the dtype (a real try decides what is expected), and every case the packed
copy must not serve (gradients, a changed or moved weight, a deepcopy, another dtype) runs torch's
own linear. Every way users change weights has its own test in test_weight_changes.py."""

from __future__ import annotations

import copy
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import whichdevice as wd
from simulated_cpus import PACKS
from tiny_models import ARCHITECTURES, save_tiny, save_tiny_llama
from whichdevice.measure.cpu_memory import packable_dtypes, packing_ops
from whichdevice.testing import simulate
from whichdevice.tuning import packed_weights
from whichdevice.tuning.packed_weights import _ATTRIBUTE, install_packed_weights, is_packed, packable_layers, unpack

pytestmark = pytest.mark.skipif(packing_ops(torch) is None, reason="this torch has no oneDNN packing ops")

# What this CPU's oneDNN packs, read as torch decides it and confirmed by a real packing (not a
# simulation): bf16 needs AVX-512BW/VL/DQ or AVX-NE-CONVERT, which an AVX2-only CPU lacks.
PACKS_HERE = packable_dtypes()
REFUSED = "not packed: oneDNN cannot pack bfloat16 weights on this CPU"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("packed") / "tiny", dtype=torch.float32, tokenizer=False)


def _load(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _ids(batch: int = 4) -> torch.Tensor:
    return torch.randint(5, 200, (batch, 12), generator=torch.Generator().manual_seed(0))


def test_fp32_packs_wherever_torch_has_the_ops_and_bf16_as_a_real_try_says():
    assert "float32" in PACKS_HERE
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), 4)
        packs_bf16 = True
    except RuntimeError:
        packs_bf16 = False
    assert ("bfloat16" in PACKS_HERE) == packs_bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_model_computes_what_the_plain_one_does(path: Path, dtype: torch.dtype):
    name = str(dtype).removeprefix("torch.")
    plain, packed = _load(path, dtype), _load(path, dtype)
    count, done = install_packed_weights(packed, name, 4)
    if name in PACKS_HERE:
        assert count == len(packable_layers(plain, name)) > 0 and "packed for batch 4" in done
    else:  # packs where this torch can, runs unpacked with the same tokens where it cannot
        assert count == 0 and done.startswith(REFUSED) and not any(hasattr(m, _ATTRIBUTE) for m in packed.modules())
    with torch.inference_mode():
        expected, got = plain(_ids()).logits.float(), packed(_ids()).logits.float()
        tokens = packed.generate(_ids(), max_new_tokens=6, do_sample=False, pad_token_id=0)
        reference = plain.generate(_ids(), max_new_tokens=6, do_sample=False, pad_token_id=0)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(tokens, reference)
    assert packed.state_dict().keys() == plain.state_dict().keys()  # the weights are untouched beside the copy


def _used_packed(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether the first packed layer served ``x`` from its packed copy (spied on the linear op)."""
    layer = next(m for m in model.modules() if hasattr(m, _ATTRIBUTE))
    calls: list[int] = []
    state = layer._whichdevice_packed
    original = state.linear
    state.linear = lambda *a: calls.append(1) or original(*a)
    try:
        layer(x.to(layer.weight.dtype))
    finally:
        state.linear = original
    return bool(calls)


def test_gradients_a_changed_weight_and_another_dtype_run_torchs_own_linear(path: Path):
    model = _load(path, torch.float32)
    install_packed_weights(model, "float32", 4)
    layer = packable_layers(model, "float32")[0]
    x = torch.randn(4, 1, layer.in_features)
    with torch.no_grad():
        assert _used_packed(model, x)
    assert not _used_packed(model, x)  # grad enabled with trainable weights: autograd needs torch's op
    model(_ids()).logits.sum().backward()  # training through the packed model works
    assert layer.weight.grad is not None
    with torch.no_grad():
        layer.weight.mul_(2.0)  # changed in place since packing
        assert not _used_packed(model, x) and not is_packed(layer)
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer._whichdevice_packed.tensor is None  # a stale copy is dropped, its memory freed


def test_a_deepcopy_runs_unpacked_and_unpack_takes_it_all_back(path: Path):
    model = _load(path, torch.float32)
    count, _ = install_packed_weights(model, "float32", 4)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert not _used_packed(twin, torch.randn(4, 1, 64))
        assert torch.allclose(twin(_ids()).logits, model(_ids()).logits, atol=1e-4)
    assert unpack(model) == count and not any("forward" in vars(m) for m in model.modules())
    assert install_packed_weights(model, "float32", 4)[0] == count  # and it can be packed again


def test_nothing_is_packed_where_the_copy_would_crowd_the_memory(path: Path, monkeypatch: pytest.MonkeyPatch):
    model = _load(path, torch.float32)
    monkeypatch.setattr(packed_weights, "available_memory", lambda: 1024)
    count, why = install_packed_weights(model, "float32", 4)
    assert count == 0 and "would take more than 50% of the" in why
    assert install_packed_weights(_load(path, torch.float16), "float16", 4)[0] == 0  # fp16 is not packed


def test_a_simulated_cpu_that_cannot_pack_refuses_on_every_machine(path: Path):
    """No variable makes an AVX-512 CPU refuse bf16 packing; a simulated CPU does, on every machine:
    the resolution does not hand bf16 packing over, and says why."""
    with simulate(PACKS + ",packs=float32"):
        res = wd.resolve_device(model=str(path), batch_size=4, max_length=1024, max_new_tokens=768, dtype="bfloat16")
        assert install_packed_weights(_load(path, torch.bfloat16), "bfloat16", 4) == (0, REFUSED + _REASON)
    assert res.tuning is None or res.tuning.packing is None
    assert any(s.topic == "generation" and "oneDNN cannot pack bfloat16" in s.message for s in res.trace)


_REASON = " (torch's check asks for AVX-512BW/VL/DQ or AVX-NE-CONVERT, or Arm BF16)"


def test_available_memory_reads_meminfo(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert packed_weights.available_memory(meminfo) == 12000000 * 1024
    meminfo.write_text("MemTotal: 1 kB\nMemAvailable: lots\n")
    assert packed_weights.available_memory(meminfo) is None
    assert packed_weights.available_memory(tmp_path / "absent") is None


def test_prepare_packs_only_where_the_resolution_chose_it(path: Path, monkeypatch):
    # The simulated figures' budget for this tiny model is milliseconds, which a busy machine's
    # packing can pass: the budget has its own test, so here it never stops the packing.
    monkeypatch.setattr(packed_weights, "PROBE_MIN_S", float("inf"))
    with simulate(PACKS):
        four = wd.resolve_device(model=str(path), batch_size=4, max_length=1024, max_new_tokens=768)
        one = wd.resolve_device(model=str(path), batch_size=1, max_length=1024)
    assert four.tuning is not None and four.tuning.packed_for_batch == 4
    assert one.tuning is None or one.tuning.packing is None
    model = AutoModelForCausalLM.from_pretrained(path, **four.model_kwargs()).eval()
    assert four.prepare(model) is model
    layers = packable_layers(model, four.dtype_name or "")
    if (four.dtype_name or "") in PACKS_HERE:
        assert layers and all(is_packed(m) for m in layers)
    else:  # the simulated CPU packs bf16; this one does not: prepare's real try refuses, nothing changes
        assert not any(hasattr(m, _ATTRIBUTE) for m in model.modules())
    other = AutoModelForCausalLM.from_pretrained(path, **one.model_kwargs()).eval()
    one.prepare(other)
    assert not any(hasattr(m, "_whichdevice_packed") for m in other.modules())
    assert all(type(p) is torch.nn.Parameter for p in model.parameters()) or (four.dtype_name or "") in PACKS_HERE


def test_torch_compile_of_a_packed_model_traces_torchs_own_linear(path: Path):
    plain, packed = _load(path, torch.float32), _load(path, torch.float32)
    install_packed_weights(packed, "float32", 4)
    compiled = torch.compile(packed, backend="eager")  # dynamo's tracing, without inductor's build time
    with torch.no_grad():
        assert torch.allclose(compiled(_ids()).logits, plain(_ids()).logits, atol=1e-4)
        assert _used_packed(packed, torch.randn(4, 1, 64))  # uncompiled calls still use the copy


def test_a_onednn_that_cannot_pack_leaves_the_model_as_it_was(path: Path, monkeypatch: pytest.MonkeyPatch):
    real = packing_ops(torch)
    assert real is not None
    calls: list[int] = []

    def pack(weight: torch.Tensor, batch: int) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("could not create a primitive descriptor\nmore")
        return real[0](weight, batch)

    monkeypatch.setattr(packed_weights, "packing_ops", lambda torch: (pack, real[1]))
    model = _load(path, torch.float32)
    count, why = install_packed_weights(model, "float32", 4)
    assert count == 0 and "oneDNN could not pack float32 weights (could not create a primitive descriptor)" in why
    assert not any(hasattr(m, "_whichdevice_packed") or "forward" in vars(m) for m in model.modules())


def test_a_packing_priced_past_its_budget_stops_and_keeps_what_it_packed(path: Path, monkeypatch):
    from whichdevice.tuning.packed_weights import PROBE_SHARE

    model = _load(path, torch.float32)
    layers = packable_layers(model, "float32")
    sizes = [m.weight.numel() * m.weight.element_size() for m in layers]
    ids = torch.randint(5, 200, (4, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids).logits
    # A clock that moves one second per layer packed: the whole copy is priced at many seconds.
    ticks = iter(range(10_000))
    monkeypatch.setattr(packed_weights, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    count, done = install_packed_weights(model, "float32", 4, budget_s=0.5)
    # It stopped as soon as PROBE_SHARE of the copy was made after the first weight (which carries the
    # first call's one-time costs and is not taken as the rate), not at the end.
    first = next(i for i in range(1, len(sizes)) if sum(sizes[1 : i + 1]) >= PROBE_SHARE * sum(sizes))
    assert 0 < first < len(layers) - 1 and count == first + 1
    assert f"packing stopped after {sum(sizes[:count]) / sum(sizes):.0%} of the copy ({count} of {len(layers)}" in done
    assert "the whole copy would take" in done and "kept packed" in done
    # The layers packed by then stay packed (they repay part of the time spent); the rest run as before.
    assert [hasattr(m, "_whichdevice_packed") for m in layers] == [i < count for i in range(len(layers))]
    assert all("forward" not in vars(m) for m in layers[count:])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain, rtol=1e-4, atol=1e-4)
    # Within its budget, or with none, the whole model is packed (a second call packs the rest).
    assert install_packed_weights(model, "float32", 4, budget_s=1e9)[0] == len(layers) - count
    assert all(hasattr(m, "_whichdevice_packed") for m in layers)
    unpack(model)
    assert install_packed_weights(model, "float32", 4)[0] == len(layers)


def test_a_resolution_that_packs_carries_the_estimates_budget(path: Path):
    with simulate(PACKS):
        four = wd.resolve_device(model=str(path), batch_size=4, max_length=1024, max_new_tokens=768)
        one = wd.resolve_device(model=str(path), batch_size=1, max_length=1024)
    tuning = four.tuning
    assert tuning is not None and tuning.packed_for_batch == 4
    assert tuning.packing_budget_s is not None and tuning.packing_budget_s > 0
    assert four.to_dict()["tuning"]["packing_budget_s"] == round(tuning.packing_budget_s, 3)
    assert one.tuning is None or one.tuning.packing is None


def test_the_price_takes_its_rate_after_the_first_weight_and_leaves_out_the_time_spent(monkeypatch):
    # The first weight takes 10 s (the first call's one-time costs), every later one 1 s: the whole
    # copy (1,000 bytes) is priced at 10 bytes a second, 100 s, and the 10 s already spent on the first
    # is not added: the rest of the copy repays its share whatever the start cost.
    now = iter([0.0, 10.0, 11.0, 12.0, 14.0])
    monkeypatch.setattr(packed_weights, "time", types.SimpleNamespace(perf_counter=lambda: next(now)))
    monkeypatch.setattr(packed_weights, "PROBE_SHARE", 0.01)
    clock = packed_weights._Clock(size=1000)
    assert clock.add(10) is None  # the first weight: not the rate
    assert clock.add(5) is None  # 0.5% of the copy after the first: not yet read
    assert clock.add(10) == pytest.approx(1000 * 2 / 15)
    assert clock.add(10) == pytest.approx(1000 * 4 / 25)  # the rate slows as it runs: priced again


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_other_architectures_pack_their_plain_linears_and_generate_the_same(
    tmp_path: Path, model_type: str, dtype: str
):
    auto = save_tiny(model_type, tmp_path)
    plain, packed = (auto.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).eval() for _ in range(2))
    linears = [m for m in plain.modules() if type(m) is torch.nn.Linear]
    count, _ = install_packed_weights(packed, dtype, 4)
    assert count == (len(linears) if dtype in PACKS_HERE else 0) and linears
    # Subclasses of nn.Linear and GPT-2's Conv1D keep their own forward.
    assert all(_ATTRIBUTE not in vars(m) for m in packed.modules() if type(m) is not torch.nn.Linear)
    ids = _ids()
    extra = {"decoder_input_ids": ids[:, :3]} if plain.config.is_encoder_decoder else {}
    with torch.inference_mode():
        expected, got = plain(ids, **extra).logits.float(), packed(ids, **extra).logits.float()
        kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(packed.generate(ids, **kwargs), plain.generate(ids, **kwargs))
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    assert torch.allclose(got, expected, atol=tolerance, rtol=tolerance)
