"""What runs in a process that never imported whichdevice: a model it was handed, generating, read back.

Imported by a spawned worker (torch.multiprocessing) and run by ``python -c`` in a fresh interpreter;
it imports torch and transformers only. Whatever whichdevice the model needs comes with its pickle.
"""

from __future__ import annotations

import sys
from typing import Any


def generate_and_read_back(model: Any) -> dict[str, Any]:
    """Three greedy tokens, the attention the config names, the function transformers runs for it
    (counted as it runs), and whether whichdevice was imported before the model came."""
    import torch
    from transformers import AttentionInterface

    name = model.config._attn_implementation
    runs = AttentionInterface._global_mapping[name]
    calls: list[int] = []

    def counted(module: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(query.shape[2])
        return runs(module, query, *args, **kwargs)

    AttentionInterface._global_mapping[name] = counted
    try:
        ids = torch.tensor([[5, 6, 7, 8]])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    finally:
        AttentionInterface._global_mapping[name] = runs
    return {
        "attention": str(name),
        "function": f"{runs.__module__}.{runs.__qualname__}",
        "one_token_calls": calls.count(1),
        "tokens": out[0].tolist(),
    }


def spawned(model: Any, queue: Any) -> None:
    """A torch.multiprocessing spawn worker: the model arrives pickled."""
    try:
        queue.put(generate_and_read_back(model))
    except Exception as exc:
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def loaded(path: str) -> None:
    """A fresh interpreter: torch.load(weights_only=False) of a torch.save(model), printed as JSON."""
    import json

    import torch

    before = "whichdevice" in sys.modules
    try:
        result = generate_and_read_back(torch.load(path, weights_only=False))
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["whichdevice_before"] = before
    print(json.dumps(result))
