"""Counts the opens of config.json and of each safetensors file during one resolve_device(model=path).

Run from a checkout with ``PYTHONPATH=src``: prints, per call shape, the opens of each model file.
Each file is read once per call when the model is read once (model/facts.py).
"""

from __future__ import annotations

import builtins
import collections
import io
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def counting_opens(folder: Path) -> Iterator[collections.Counter[str]]:
    """Counts every open() of a file in ``folder`` (builtins.open and io.open, which pathlib uses)."""
    counts: collections.Counter[str] = collections.Counter()
    real_open = io.open

    def counted(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and Path(os.fspath(file)).parent == folder:
            counts[Path(os.fspath(file)).name] += 1
        return real_open(file, *args, **kwargs)

    builtins.open = counted
    io.open = counted
    try:
        yield counts
    finally:
        builtins.open = real_open
        io.open = real_open


def tiny_model(folder: Path, *, shards: bool) -> Path:
    """A two-layer Llama saved (sharded when ``shards``) into ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB" if shards else "1GB")
    return folder


def main() -> None:
    import whichdevice as wd

    calls: dict[str, Callable[[Path], Any]] = {
        "inference": lambda p: wd.resolve_device(model=p),
        "inference, batch_size=2, max_length=64": lambda p: wd.resolve_device(model=p, batch_size=2, max_length=64),
        "training": lambda p: wd.resolve_device(model=p, task="training"),
        "training, batch_size=2, max_length=64": lambda p: wd.resolve_device(
            model=p, task="training", batch_size=2, max_length=64
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for shards in (False, True):
            folder = tiny_model(Path(tmp) / ("sharded" if shards else "single"), shards=shards).resolve()
            for name, call in calls.items():
                with counting_opens(folder) as counts:
                    call(folder)
                files = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
                print(f"{'sharded' if shards else 'one file'}, {name}: {files}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
