"""A tiny model of each fp16 allow-listed architecture, run in fp16 and fp32 on one probe batch.

Run: ``python benchmarks/fp16_check.py`` (seconds; ``--json PATH``). Builds each architecture from its default
config shrunk to a few layers (random weights, fixed seed), runs the same tokens in fp32 and fp16 on
the CPU, and prints any inf/NaN and the largest logit difference. A tiny random model says little
about how trained weights overflow, so this is a sanity check beside the published evidence in
whichdevice/precision/fp16_safe.py, never a reason to add an architecture.
"""

from __future__ import annotations

import argparse
from typing import Any

import harness
import torch

from whichdevice.precision.fp16_safe import FP16_SAFE

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=256,
    n_embd=64,
    n_layer=2,
    n_head=4,
    ffn_dim=128,
    word_embed_proj_dim=64,
    rotary_dim=8,
)


def check(model_type: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoConfig.for_model(model_type)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in SMALL.items() if hasattr(base, k)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens).logits.float()
        half = model.half()(tokens).logits.float()
    finite = bool(torch.isfinite(half).all())
    return {"model_type": model_type, "finite": finite, "max_diff": (half - full).abs().max().item(),
            "logits_up_to": full.abs().max().item()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    harness.add_json_argument(parser)
    args = parser.parse_args()
    machine = harness.machine()
    print(harness.machine_line(machine))
    found = [check(model_type) for model_type in FP16_SAFE]
    rows = [[r["model_type"], r["finite"], f"{r['max_diff']:.2e}", f"{r['logits_up_to']:.2e}"] for r in found]
    print(harness.table(["architecture", "fp16 finite", "max |fp16 - fp32|", "logits up to"], rows))
    harness.write_json(args.json, {"machine": machine, "fp16_check": found})


if __name__ == "__main__":
    main()
