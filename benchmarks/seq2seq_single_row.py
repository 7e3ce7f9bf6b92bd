"""Does the single-row hook speed up an encoder-decoder's decode steps?

    python benchmarks/seq2seq_single_row.py [--rounds 6]

A T5 of about 0.5B parameters (random weights, bf16: larger than the CPU's caches, so its weights
stream from memory as a real one's do), batch 1, 32 prompt tokens, 24 new: greedy ``generate`` on
the plain model and on one with ``install_single_row`` (decode steps of one decoder row with oneDNN
off), in interleaved rounds, the order reversed every other round. Asserts the same tokens and prints
each round's times and the hooked model's speed over the plain one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForSeq2SeqLM, T5Config

from whichdevice.tuning.single_row import install_single_row

CONFIG = {
    "d_model": 1024,
    "d_ff": 4096,
    "d_kv": 64,
    "num_layers": 12,
    "num_heads": 16,
    "vocab_size": 32128,
    "decoder_start_token_id": 0,
    "feed_forward_proj": "gated-gelu",
}


def run(model: Any, ids: torch.Tensor, new: int) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new", type=int, default=24)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    plain = AutoModelForSeq2SeqLM.from_config(T5Config(**CONFIG)).to(torch.bfloat16).eval()
    hooked = AutoModelForSeq2SeqLM.from_config(T5Config(**CONFIG)).to(torch.bfloat16).eval()
    hooked.load_state_dict(plain.state_dict())
    install_single_row(hooked)
    count = sum(p.numel() for p in plain.parameters())
    print(f"T5: {count / 1e6:.0f}M parameters, {count * 2 / 1e9:.2f} GB in bf16, torch {torch.__version__}")
    ids = torch.randint(3, 32000, (1, 32), generator=torch.Generator().manual_seed(0))
    run(plain, ids, 2), run(hooked, ids, 2)  # oneDNN builds its kernels on the first call
    ratios = []
    for r in range(args.rounds):
        order = (plain, hooked) if r % 2 == 0 else (hooked, plain)
        timed = {id(model): run(model, ids, args.new) for model in order}
        (t_plain, out_plain), (t_hooked, out_hooked) = timed[id(plain)], timed[id(hooked)]
        assert torch.equal(out_plain, out_hooked), "the hooked model generated other tokens"
        ratios.append(t_plain / t_hooked)
        print(f"round {r}: plain {t_plain:.3f} s, hooked {t_hooked:.3f} s")
    print(
        f"hooked over plain: {statistics.median(ratios):.2f}x (median of {len(ratios)} rounds; "
        f"{min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
