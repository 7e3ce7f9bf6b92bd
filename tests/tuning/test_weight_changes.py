"""A prepared model is the model: after every way users change weights, a model with packed weights
computes what the same model unprepared computes with the same change (logits compared). fp32, which
oneDNN packs on every CPU torch builds it for; each case first checks that the copy was in use."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import save_tiny, save_tiny_llama
from whichdevice.measure.cpu_memory import packing_ops
from whichdevice.tuning.packed_weights import install_packed_weights, is_packed, packable_layers, unpack

pytestmark = pytest.mark.skipif(packing_ops(torch) is None, reason="this torch has no oneDNN packing ops")

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("changes") / "tiny", dtype=torch.float32, tokenizer=False)


def _ids() -> torch.Tensor:
    return torch.randint(5, 200, (4, 10), generator=torch.Generator().manual_seed(3))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits.float()


def _pair(path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(plain, packed): the same checkpoint twice; the second packed, its copies checked to be in use."""
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    count, _ = install_packed_weights(packed, "float32", 4)
    assert count == len(packable_layers(plain, "float32")) > 0
    assert all(is_packed(m) for m in packable_layers(packed, "float32"))
    torch.testing.assert_close(_logits(packed), _logits(plain), **TOLERANCE)
    return plain, packed


def _delta(weight: torch.Tensor, seed: int = 1) -> torch.Tensor:
    return torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.5


def _proj(model: torch.nn.Module) -> torch.nn.Linear:
    return model.model.layers[0].self_attn.q_proj


def _data_add(model):
    _proj(model).weight.data += _delta(_proj(model).weight)


def _data_copy(model):
    _proj(model).weight.data.copy_(_delta(_proj(model).weight))


def _data_assign(model):
    _proj(model).weight.data = _delta(_proj(model).weight)


def _data_setitem(model):
    _proj(model).weight.data[3] = 7.0


def _inplace_no_grad(model):
    with torch.no_grad():
        _proj(model).weight.mul_(3.0)


def _detached(model):
    _proj(model).weight.detach().add_(_delta(_proj(model).weight))


def _init(model):
    torch.nn.init.normal_(_proj(model).weight, generator=torch.Generator().manual_seed(2))


def _init_whole_model(model):
    gen = torch.Generator().manual_seed(4)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.uniform_(module.weight, -0.2, 0.2, generator=gen)


def _load_state_dict(model):
    other = {k: v + _delta(v, 5) if k.endswith("proj.weight") else v for k, v in model.state_dict().items()}
    model.load_state_dict(other)


def _load_state_dict_assign_then_data(model):
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    _proj(model).weight.data += 1.0  # the new parameter object, through .data


def _optimizer_step(model):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model(_ids(), labels=_ids()).loss.backward()
    optimizer.step()
    model.eval()


def _sgd_foreach(model):
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, foreach=True)
    model(_ids(), labels=_ids()).loss.backward()
    optimizer.step()
    model.eval()


def _to_bf16_and_back(model):
    model.to(torch.bfloat16)
    model.to(torch.float32)


def _half_and_back(model):
    model.half()
    model.float()


def _to_empty_and_reload(model):
    # The move a model makes between devices, on a machine with only a CPU: new storage, then the weights
    # (and the buffers no state_dict carries, such as the rotary embedding's inv_freq).
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    model.to_empty(device="cpu")
    model.load_state_dict({k: v * 1.5 if k.endswith("proj.weight") else v for k, v in state.items()})
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def _vector_to_parameters(model):
    params = list(model.parameters())
    vector = torch.nn.utils.parameters_to_vector(params)
    torch.nn.utils.vector_to_parameters(vector * 0.9, params)


def _swap_tensors(model):
    layer = _proj(model)
    torch.utils.swap_tensors(layer.weight, torch.nn.Parameter(_delta(layer.weight)))


MUTATIONS: dict[str, Callable[[torch.nn.Module], None]] = {
    "weight.data +=": _data_add,
    "weight.data.copy_()": _data_copy,
    "weight.data = tensor": _data_assign,
    "weight.data[i] = x": _data_setitem,
    "weight.mul_() under no_grad": _inplace_no_grad,
    "weight.detach().add_()": _detached,
    "torch.nn.init.normal_": _init,
    "torch.nn.init on every Linear": _init_whole_model,
    "load_state_dict": _load_state_dict,
    "load_state_dict(assign=True), then .data": _load_state_dict_assign_then_data,
    "AdamW step": _optimizer_step,
    "SGD foreach step": _sgd_foreach,
    ".to(bf16) and back": _to_bf16_and_back,
    ".half() and .float()": _half_and_back,
    "to_empty and reload (a device move)": _to_empty_and_reload,
    "vector_to_parameters": _vector_to_parameters,
    "torch.utils.swap_tensors": _swap_tensors,
}


# Round trips through a narrower dtype: the weights are rounded, the logits move by less than elsewhere.
ROUND_TRIPS = (".to(bf16) and back", ".half() and .float()")


@pytest.mark.parametrize("change", list(MUTATIONS))
def test_a_changed_weight_computes_what_the_unprepared_model_computes(path: Path, change: str):
    plain, packed = _pair(path)
    before = _logits(plain)
    for model in (plain, packed):
        MUTATIONS[change](model)
    expected = _logits(plain)
    moved = (expected - before).abs().max().item()
    assert moved > (1e-6 if change in ROUND_TRIPS else 1e-3), "the change must change the model's outputs"
    torch.testing.assert_close(_logits(packed), expected, **TOLERANCE)


@pytest.mark.parametrize("change", ["weight.data +=", "load_state_dict", "AdamW step"])
def test_generate_after_a_change_gives_the_unprepared_models_tokens(path: Path, change: str):
    plain, packed = _pair(path)
    for model in (plain, packed):
        MUTATIONS[change](model)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(packed.generate(_ids(), **kwargs), plain.generate(_ids(), **kwargs))


def _lora_pair(path: Path):
    peft = pytest.importorskip("peft")
    plain, packed = _pair(path)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(7)
    plain_lora = peft.get_peft_model(plain, config).eval()
    packed_lora = peft.get_peft_model(packed, config).eval()
    # The same adapter in both (only the adapter's tensors: the base weights stay packed).
    adapter = {k: v for k, v in plain_lora.state_dict().items() if "lora_" in k}
    packed_lora.load_state_dict(adapter, strict=False)
    assert any(is_packed(m) for m in packable_layers(packed_lora, "float32"))
    torch.testing.assert_close(_logits(packed_lora), _logits(plain_lora), **TOLERANCE)
    return plain_lora, packed_lora


@pytest.mark.parametrize("safe_merge", [False, True])
def test_peft_merge_and_unload(path: Path, safe_merge: bool):
    """The case that computed wrong before: peft merges with weight.data += delta, which moves neither
    the address nor the version counter (logits differed by up to 0.68)."""
    plain_lora, packed_lora = _lora_pair(path)
    plain = plain_lora.merge_and_unload(safe_merge=safe_merge)
    packed = packed_lora.merge_and_unload(safe_merge=safe_merge)
    torch.testing.assert_close(_logits(packed), _logits(plain), **TOLERANCE)


def test_peft_merge_adapter_and_unmerge_adapter(path: Path):
    plain_lora, packed_lora = _lora_pair(path)
    for lora in (plain_lora, packed_lora):
        lora.merge_adapter()
    torch.testing.assert_close(_logits(packed_lora), _logits(plain_lora), **TOLERANCE)
    for lora in (plain_lora, packed_lora):
        lora.unmerge_adapter()
    torch.testing.assert_close(_logits(packed_lora), _logits(plain_lora), **TOLERANCE)


def test_a_tied_heads_weight_changed_through_the_embedding(tmp_path: Path):
    """gemma ties its head to the token embedding: the packed head must see an edit made through the
    embedding module (the same Parameter)."""
    auto = save_tiny("gemma", tmp_path)
    plain, packed = (auto.from_pretrained(tmp_path, dtype=torch.float32).eval() for _ in range(2))
    install_packed_weights(packed, "float32", 4)
    assert packed.lm_head.weight is packed.model.embed_tokens.weight and is_packed(packed.lm_head)
    for model in (plain, packed):
        model.model.embed_tokens.weight.data *= 1.5
    torch.testing.assert_close(_logits(packed), _logits(plain), **TOLERANCE)


def test_a_deepcopy_a_pickle_and_torch_compile_compute_the_same_and_change_on_their_own(path: Path):
    plain, packed = _pair(path)
    twin = copy.deepcopy(packed)
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    compiled = torch.compile(packed, backend="eager")
    for other in (twin, loaded):
        assert all(type(p) is torch.nn.Parameter for p in other.parameters())  # plain weights in copies
        torch.testing.assert_close(_logits(other), _logits(plain), **TOLERANCE)
    torch.testing.assert_close(_logits(compiled), _logits(plain), **TOLERANCE)
    assert all(is_packed(m) for m in packable_layers(packed, "float32"))  # copying did not unpack the original
    # A change to the copy is the copy's: the original still computes its own weights, packed.
    _data_add(twin)
    torch.testing.assert_close(_logits(packed), _logits(plain), **TOLERANCE)
    _data_add(packed)
    _data_add(plain)
    torch.testing.assert_close(_logits(compiled), _logits(plain), **TOLERANCE)


def test_inference_tensors_are_not_packed(path: Path):
    """A weight made under inference_mode keeps no version counter, so an in-place change made under
    inference_mode could not be seen: such a layer runs torch's own linear."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layer = _proj(model)
    with torch.inference_mode():
        weight = layer.weight.detach().clone()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert layer.weight.is_inference()
    count, _ = install_packed_weights(model, "float32", 4)
    assert count == len(packable_layers(model, "float32")) > 0 and not hasattr(layer, "_whichdevice_packed")


def test_unpack_leaves_plain_parameters(path: Path):
    _, packed = _pair(path)
    assert unpack(packed) > 0
    assert all(type(p) is torch.nn.Parameter for p in packed.parameters())
    assert not any("forward" in vars(m) for m in packed.modules())


# Writes the version counter cannot see (issue 56): through a tensor that aliases the weight's storage,
# kept from before prepare(), and from another process writing shared memory. Each scales every
# projection of the first layer by 1.5, as the users did.


def _projections(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [m.weight for name, m in model.named_modules() if name.endswith("proj")]


def _scale(tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor in tensors:
            tensor.mul_(1.5)


def _kept_data(model: torch.nn.Module) -> Callable[[], None]:
    kept = [w.data for w in _projections(model)]
    return lambda: _scale(kept)


def _kept_ema_list(model: torch.nn.Module) -> Callable[[], None]:
    # An EMA of the weights, written back into them through the list it kept (decay 0.5 toward 2x).
    kept = [p.data for p in model.parameters()]

    def update() -> None:
        with torch.no_grad():
            for data in kept:
                target = data * 2
                data.mul_(0.5).add_(target, alpha=0.5)

    return update


def _kept_storage(model: torch.nn.Module) -> Callable[[], None]:
    kept = [(w.untyped_storage(), w.dtype, w.shape) for w in _projections(model)]

    def write() -> None:
        views = [torch.empty(0, dtype=dtype).set_(storage, 0, shape) for storage, dtype, shape in kept]
        _scale(views)

    return write


ALIASES: dict[str, Callable[[torch.nn.Module], Callable[[], None]]] = {
    "w.data kept from before prepare": _kept_data,
    "[p.data for p in model.parameters()] kept from before prepare": _kept_ema_list,
    "w.untyped_storage() kept from before prepare": _kept_storage,
}


@pytest.mark.parametrize("alias", list(ALIASES))
def test_a_write_through_an_alias_kept_from_before_packing_is_seen(path: Path, alias: str):
    """The issue's rows: 0.502 / 0.773 / 0.502 apart before, the stale copies serving."""
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    writes = [ALIASES[alias](model) for model in (plain, packed)]  # kept before packing
    install_packed_weights(packed, "float32", 4)
    assert all(is_packed(m) for m in packable_layers(packed, "float32"))
    before = _logits(plain)
    for write in writes:
        write()
    expected = _logits(plain)
    assert (expected - before).abs().max().item() > 1e-3, "the write must change the model's outputs"
    torch.testing.assert_close(_logits(packed), expected, **TOLERANCE)


def _write_from_a_child(method: str, models: tuple[torch.nn.Module, ...]) -> None:
    import multiprocessing

    from hogwild_worker import scale_in_place

    weights = [w.detach() for model in models for w in _projections(model)]
    child = multiprocessing.get_context(method).Process(target=scale_in_place, args=(weights, 1.5))
    child.start()
    child.join(120)
    assert child.exitcode == 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_weights_in_shared_memory_are_not_packed_and_a_childs_writes_are_seen(
    path: Path, method: str, caplog: pytest.LogCaptureFixture
):
    """Hogwild: model.share_memory(), prepare(), then a child process writes the shared weights in place.
    The parent's version counter never moves, so a copy could not know: shared weights are not packed."""
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for model in (plain, packed):
        model.share_memory()
    count, done = install_packed_weights(packed, "float32", 4)
    layers = [m for m in packed.modules() if type(m) is torch.nn.Linear]
    assert count == 0 and not any(is_packed(m) for m in layers)
    assert f"{len(layers)} linear layers in shared memory not packed" in done
    before = _logits(plain)
    _write_from_a_child(method, (plain, packed))
    expected = _logits(plain)
    assert (expected - before).abs().max().item() > 1e-3, "the child's write must reach the parent"
    torch.testing.assert_close(_logits(packed), expected, **TOLERANCE)


def test_a_model_moved_to_shared_memory_after_packing_runs_unpacked(path: Path):
    plain, packed = _pair(path)
    for model in (plain, packed):
        model.share_memory()  # new storage: the copies made from the old one are dropped
    assert not any(is_packed(m) for m in packable_layers(packed, "float32"))
    assert install_packed_weights(packed, "float32", 4)[0] == 0  # and nothing packs again while it is shared
    _write_from_a_child("fork", (plain, packed))
    torch.testing.assert_close(_logits(packed), _logits(plain), **TOLERANCE)
