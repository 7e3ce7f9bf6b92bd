"""A bf16 model's forwards of many rows computed in fp32 from its weights (tuning.upcast): the same bits as
that computation done by hand, decode steps in bf16 as loaded, no copy that outlives its call, and all of
it taken back by unprepare."""

from __future__ import annotations

import copy
import pickle
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import whichdevice as wd
from epyc_figures import AVX2, EPYC
from tiny_models import save_tiny_llama
from whichdevice.testing import simulate
from whichdevice.tuning.upcast import ATTRIBUTE, install_upcast, remove_upcast, upcast_layers

ROWS = 4  # forwards of more rows than this run in fp32


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("upcast") / "tiny", dtype=torch.bfloat16, tokenizer=False)


def _load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _by_hand(model: torch.nn.Module, rows: int = ROWS) -> torch.nn.Module:
    """``model`` with each bf16 linear computing a forward of more than ``rows`` rows as fp32 matmuls on
    its bf16-rounded weights, rounded back to bf16: written out here, apart from the code under test."""

    def forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= rows:
            return torch.nn.functional.linear(x, module.weight, module.bias)
        bias = None if module.bias is None else module.bias.float()
        return torch.nn.functional.linear(x.float(), module.weight.float(), bias).to(torch.bfloat16)

    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = lambda x, module=module: forward(module, x)
    return model


def _ids(rows: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 250, (batch, rows), generator=torch.Generator().manual_seed(rows))


def _buffers(model: torch.nn.Module) -> int:
    pools = {id(vars(m)[ATTRIBUTE].pool): vars(m)[ATTRIBUTE].pool for m in model.modules() if ATTRIBUTE in vars(m)}
    return sum(len(pool.free) for pool in pools.values())


def test_prompts_compute_in_fp32_from_the_bf16_weights_and_equal_that_done_by_hand(path: Path):
    model, hand, plain = _load(path), _by_hand(_load(path)), _load(path)
    count, done = install_upcast(model, ROWS)
    assert count == len(upcast_layers(plain)) > 0 and f"more than {ROWS} rows" in done
    prompt = _ids(24)
    with torch.no_grad():
        ours, theirs, bf16 = (m(prompt).logits for m in (model, hand, plain))
    assert torch.equal(ours, theirs)  # the same bits as the computation done by hand
    assert torch.allclose(ours.float(), bf16.float(), atol=0.05, rtol=0.05)  # within bf16's tolerance
    assert _buffers(model) > 0  # the path was taken (bf16's own matmul may round to the same bits)
    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, hand.generate(prompt, max_new_tokens=8, do_sample=False))


def test_forwards_of_few_rows_and_gradients_run_bf16_as_loaded(path: Path):
    model, plain = _load(path), _load(path)
    install_upcast(model, ROWS)
    with torch.no_grad():
        assert torch.equal(model(_ids(ROWS)).logits, plain(_ids(ROWS)).logits)  # a decode-sized forward
    assert _buffers(model) == 0
    model.train()
    loss = model(_ids(24), labels=_ids(24)).loss
    loss.backward()  # training: torch's own linear, in bf16, with gradients
    assert _buffers(model) == 0 and model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_a_write_to_a_weight_after_prepare_is_always_seen(path: Path):
    model, hand = _load(path), _by_hand(_load(path))
    alias = model.model.layers[0].mlp.down_proj.weight.data  # taken before: no version counter moves
    install_upcast(model, ROWS)
    prompt = _ids(24)
    with torch.no_grad():
        model(prompt)
        alias.mul_(1.5)
        hand.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        assert torch.equal(model(prompt).logits, hand(prompt).logits)


def test_threads_running_one_model_each_get_their_own_buffer(path: Path):
    model = _load(path)
    install_upcast(model, ROWS)
    prompts = [_ids(16 + i) for i in range(4)]
    with torch.no_grad():
        expected = [model(p).logits for p in prompts]
    results: dict[int, list[bool]] = {i: [] for i in range(4)}

    def run(i: int) -> None:
        with torch.no_grad():
            for _ in range(15):
                results[i].append(torch.equal(model(prompts[i]).logits, expected[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(all(r) and len(r) == 15 for r in results.values())


def test_copies_pickles_and_unprepare(path: Path):
    model, hand = _load(path), _by_hand(_load(path))
    install_upcast(model, ROWS)
    prompt = _ids(24)
    with torch.no_grad():
        model(prompt)
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert _buffers(other) == 0  # its own buffers, made at its first forward
            assert torch.equal(other(prompt).logits, hand(prompt).logits)
    pools = {vars(m)[ATTRIBUTE].pool for m in model.modules() if ATTRIBUTE in vars(m)}
    assert remove_upcast(model) == len(upcast_layers(model))
    assert all(not pool.free for pool in pools) and _buffers(model) == 0
    assert not any("forward" in vars(m) or ATTRIBUTE in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, _load(path)(prompt).logits)


def test_a_resolution_on_a_cpu_whose_bf16_prompts_are_slow_loads_bf16_and_hands_it_over(path: Path):
    with simulate(f"cpu,calib={AVX2}"):
        unstated = wd.resolve_device(model=path, batch_size=1, max_length=264)
        told = wd.resolve_device(model=path, batch_size=1, max_length=528, max_new_tokens=16)
    for res in (unstated, told):
        assert res.tuning is not None and res.tuning.upcast_above == 12, res.explain()
        line = " | ".join(s.message for s in res.trace if s.topic == "generation")
        assert "more than 12 rows (a prompt) in fp32" in line
        assert res.to_dict()["tuning"]["upcast_above"] == 12
    model = _load(path)
    unstated.prepare(model)
    assert all(vars(m)[ATTRIBUTE].rows == 12 for m in upcast_layers(model))
    unstated.unprepare(model)
    assert not any(ATTRIBUTE in vars(m) for m in model.modules())
    with simulate(f"cpu,flags=avx512_bf16,calib={EPYC}"):  # native bf16: its prompts are fast, nothing to do
        native = wd.resolve_device(model=path, batch_size=1, max_length=264)
    assert native.tuning is None or native.tuning.upcast_above is None


def test_with_packed_weights_prompts_run_in_fp32_and_steps_packed_either_taken_back_first(path: Path):
    from whichdevice.measure.cpu_memory import packable_dtypes
    from whichdevice.tuning.layer_forward import PACKED
    from whichdevice.tuning.packed_weights import install_packed_weights, is_packed, unpack

    if "bfloat16" not in packable_dtypes():  # a real try: this CPU's oneDNN packs bf16 or not
        pytest.skip("this CPU's oneDNN does not pack bf16 weights")
    for order in ("upcast first", "packed first"):
        model, hand, plain = _load(path), _by_hand(_load(path)), _load(path)
        steps = [
            lambda model=model: install_upcast(model, ROWS),
            lambda model=model: install_packed_weights(model, "bfloat16", 4),
        ]
        for install in steps if order == "upcast first" else steps[::-1]:
            install()
        layer = model.model.layers[0].mlp.up_proj
        assert is_packed(layer) and ATTRIBUTE in vars(layer)
        with torch.no_grad():
            assert torch.equal(model(_ids(24)).logits, hand(_ids(24)).logits)  # the prompt: in fp32
            step = model(_ids(1, batch=4)).logits  # a batch-4 step: the packed copy
            torch.testing.assert_close(step, plain(_ids(1, batch=4)).logits, atol=0.02, rtol=0.02)
        remove_upcast(model)
        assert is_packed(layer) and "forward" in vars(layer)  # the packing keeps the layer's forward
        unpack(model)
        assert not any("forward" in vars(m) or PACKED in vars(m) for m in model.modules())


def test_under_inference_mode_as_pipelines_run(path: Path):
    model, hand = _load(path), _by_hand(_load(path))
    install_upcast(model, ROWS)
    prompt = _ids(24)
    with torch.inference_mode():
        first = model(prompt).logits  # the buffers are made here: not inference tensors
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, hand(prompt).logits)  # reused outside it
    assert torch.equal(first, hand(prompt).logits.detach())
