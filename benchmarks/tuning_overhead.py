"""What the tuning's guarantees cost per decode step: the packed layers' checks and the one-row wrapper.

    python benchmarks/tuning_overhead.py [--rounds 9] [--hidden 768 --layers 12]

A Llama of the given shape (random weights, fp32, about 0.1B parameters by default) runs one decode
step at batch 4 (packed weights) and at batch 1 (the single-row wrapper), each in alternated rounds
against the same step without the guarantee: the same packed layers of the same model calling
oneDNN's op directly, with no check that the copy still holds the weight, and the forward with
oneDNN switched off by hand, no wrapper or process-wide count. Prints the median per-step times and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from whichdevice.tuning import packed_weights
from whichdevice.tuning.packed_weights import _ATTRIBUTE, install_packed_weights
from whichdevice.tuning.single_row import install_single_row


def _forwards(model: torch.nn.Module) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """Each packed layer's checked forward (installed) and one calling the op with no check (what the
    guarantee is measured against), to switch between on the same model: the same packed copies in
    the same memory (two models' copies differed by up to 7% here from where their memory landed)."""
    checked, unchecked = {}, {}
    for module in model.modules():
        packed = vars(module).get(_ATTRIBUTE)
        if packed is not None:
            checked[module] = vars(module)["forward"]
            unchecked[module] = lambda x, p=packed, b=module.bias: p.linear(x, p.tensor, b)
    return checked, unchecked


def _use(forwards: dict[Any, Any]) -> None:
    for module, forward in forwards.items():
        module.forward = forward


def _step(model: torch.nn.Module, batch: int) -> float:
    ids = torch.randint(3, 1000, (batch, 1), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return time.perf_counter() - start


def _rounds(rounds: int, runs: dict[str, Any]) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()  # warm
            times[name].append(min(run() for _ in range(5)))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=32000,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    packed_weights.PROBE_MIN_S = float("inf")  # pack whole, whatever the machine's speed
    layers = install_packed_weights(model, "float32", 4)[0]
    checked, unchecked = _forwards(model)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"Llama hidden {args.hidden}, {args.layers} layers ({params:.0f}M parameters), fp32, {layers} packed layers")

    def step_with(forwards: dict[Any, Any]) -> float:
        _use(forwards)
        return _step(model, 4)

    batch4 = _rounds(args.rounds, {"checked": lambda: step_with(checked), "bare": lambda: step_with(unchecked)})
    _use(checked)
    print(
        f"batch 4, packed: {batch4['checked'] * 1e3:.2f} ms a step with the checks, {batch4['bare'] * 1e3:.2f} ms "
        f"without: {batch4['checked'] / batch4['bare']:.3f}x"
    )

    torch.manual_seed(1)
    wrapped = LlamaForCausalLM(config).eval()
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict(wrapped.state_dict())
    install_single_row(wrapped)
    switch: Any = torch.backends.mkldnn

    def by_hand() -> float:
        switch.enabled = False
        try:
            return _step(plain, 1)
        finally:
            switch.enabled = True

    batch1 = _rounds(args.rounds, {"wrapped": lambda: _step(wrapped, 1), "by hand": by_hand})
    print(
        f"batch 1, oneDNN off: {batch1['wrapped'] * 1e3:.2f} ms a step through the wrapper, "
        f"{batch1['by hand'] * 1e3:.2f} ms switched by hand: {batch1['wrapped'] / batch1['by hand']:.3f}x"
    )


if __name__ == "__main__":
    main()
