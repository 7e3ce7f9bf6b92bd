"""The smoke test's steps, one function each: resolve, import, build, load, generate, train.

Each step takes the run's ``state`` (what earlier steps produced) and returns the few words the
progress line shows after "ok"; a step whose result is wrong raises :class:`SmokeCheckError`.
The sequence itself is ``whichdevice.smoke.run_smoke``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from whichdevice.device.request import as_task
from whichdevice.smoke.progress import Progress

__all__ = ["NEW_TOKENS", "TINY_LLAMA", "TRAIN_STEPS", "SmokeCheckError", "tiny_llama_config"]

# Small enough to build, save, load and train in about a second on a CPU.
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT_TOKENS = 8
NEW_TOKENS = 16
TRAIN_STEPS = 3
BATCH_SIZE = 2
SEQUENCE_LENGTH = 16


class SmokeCheckError(Exception):
    """A step ran but its result is wrong (a model on the wrong device, a NaN loss)."""


def tiny_llama_config() -> Any:
    """The transformers ``LlamaConfig`` of the smoke model."""
    from transformers import LlamaConfig

    return LlamaConfig(**TINY_LLAMA)


def _resolve(state: dict[str, Any], tasks: Sequence[str], device: str | None) -> str:
    from whichdevice import resolve_device  # the public API, as a user's script calls it

    for task in tasks:
        state[task] = resolve_device(device, task=as_task(task))
    state["device"] = device
    first = state[tasks[0]]
    state["where"] = f" on {first.device}"
    attention = first.attn_implementation or "attention left to transformers"
    return f"{first.device}, {first.dtype_name}, {attention}" + (" (SIMULATED)" if first.simulated else "")


def _import_transformers(state: dict[str, Any]) -> None:
    from whichdevice.core.errors import PackageVersionError
    from whichdevice.core.packages import stack_problems

    # Fail here, with the pip command, rather than steps later inside from_pretrained.
    problems = stack_problems()
    if problems:
        raise PackageVersionError("; ".join(problems))
    import torch
    import transformers

    state["torch"] = torch
    state["transformers"] = transformers


def _build(state: dict[str, Any], tmp: Path) -> str:
    torch = state["torch"]
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(tmp / "model")
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e3:.0f}k parameters"


def _load(state: dict[str, Any], tmp: Path, task: str) -> str:
    from transformers import AutoModelForCausalLM

    from whichdevice import resolve_device  # the public API, as a user's script calls it

    # Resolved again with the saved model, as a user loading it would: placement checks its size
    # and the attention can be the one verified for its architecture.
    res = state[task] = resolve_device(state["device"], task=as_task(task), model=tmp / "model")
    kwargs = res.model_kwargs()
    if kwargs.get("use_kernels"):
        # Hub kernels are downloaded on first use; the smoke test promises no downloads.
        kwargs["use_kernels"] = False
    model = AutoModelForCausalLM.from_pretrained(tmp / "model", trust_remote_code=False, **kwargs)
    model = res.prepare(model)  # the runtime settings the resolution measured, as the docs tell users
    _verify(model, res)
    state[f"model_{task}"] = model
    return f"{model.device}, {model.dtype}, {model.config._attn_implementation}".replace("torch.", "")


def _verify(model: Any, res: Any) -> None:
    """The loaded model sits where the resolution said, in its dtype, with its attention."""
    device = model.device
    if device.type != res.backend.name or (res.index is not None and device.index not in (None, res.index)):
        raise SmokeCheckError(f"the model loaded onto {device}, but the resolution says {res.device}")
    if res.dtype is not None and model.dtype != res.dtype:
        raise SmokeCheckError(f"the model loaded in {model.dtype}, but the resolution says {res.dtype}")
    attn = getattr(model.config, "_attn_implementation", None)
    # prepare() ran (_load): where it installs whichdevice's decode attention, that is what the model runs.
    said = res.tuning.attention_after_prepare(res.attn_implementation) if res.tuning else res.attn_implementation
    if attn != said:
        raise SmokeCheckError(f"the model uses attention {attn!r}, but the resolution says {said!r}")


def _random_ids(torch: Any, batch: int, length: int, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 3 up: 0-2 are the pad, bos and eos ids of the tiny config.
    return torch.randint(3, TINY_LLAMA["vocab_size"], (batch, length), generator=generator)


def _generate(state: dict[str, Any], result: dict[str, Any]) -> str:
    torch = state["torch"]
    model = state["model_inference"]
    res = state["inference"]
    ids = _random_ids(torch, 1, PROMPT_TOKENS, seed=1).to(model.device)
    mask = torch.ones_like(ids)
    settings = {"do_sample": False, "pad_token_id": TINY_LLAMA["pad_token_id"]}
    with torch.no_grad():
        # An untimed first run of the same length pays for one-time set-up outside the timing:
        # oneDNN and device kernels are prepared per shape, and every decoding step has its own.
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **settings)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **settings)
        out = out.cpu()  # waits for the device, so the time is the real one
        seconds = time.perf_counter() - start
    new = int(out.shape[-1] - ids.shape[-1])
    if new != NEW_TOKENS:
        raise SmokeCheckError(f"generate returned {new} new tokens, expected {NEW_TOKENS}")
    rate = new / seconds if seconds > 0 else float("inf")
    result["inference"] = {
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "attn_implementation": model.config._attn_implementation,
        "resolved_device": res.device,
        "new_tokens": new,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(rate, 1),
    }
    return f"{new} tokens, {rate:.1f} tokens/s"


def _train(state: dict[str, Any], tmp: Path, result: dict[str, Any], progress: Progress) -> str:
    torch = state["torch"]
    from transformers import PrinterCallback, ProgressCallback, Trainer

    from whichdevice import training_arguments  # the public API, as a user's script calls it

    res = state["training"]
    model = state["model_training"]
    ids = _random_ids(torch, BATCH_SIZE * TRAIN_STEPS, SEQUENCE_LENGTH, seed=2)
    dataset = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]
    args = training_arguments(
        output_dir=str(tmp / "out"),
        resolution=res,
        max_steps=TRAIN_STEPS,
        per_device_train_batch_size=BATCH_SIZE,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,  # the smoke progress line shows the steps instead
    )
    times: list[float] = []
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[_step_timer(times, progress)])
    # Trainer prints its final metrics (PrinterCallback) or a tqdm bar (ProgressCallback) to the
    # terminal; the smoke summary reports the same numbers.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    loss = float(trainer.train().training_loss)
    if not math.isfinite(loss):
        raise SmokeCheckError(f"the training loss is {loss}: {res.dtype_name} training diverged on {res.device}")
    result["training"] = _training_result(model, res, times, loss)
    return f"{_seconds_per_step(times):.3f} s/step, loss {loss:.3f}"


def _step_timer(times: list[float], progress: Progress) -> Any:
    """A Trainer callback that times each optimizer step into ``times`` and shows it on the progress line."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - self.start)
            progress.update(f"step {state.global_step}/{TRAIN_STEPS}")

    return StepTimer()


def _seconds_per_step(times: list[float]) -> float:
    # The first step prepares kernels and optimizer state; the steady rate is in the others.
    steady = times[1:] or times
    return sum(steady) / len(steady) if steady else float("nan")


def _training_result(model: Any, res: Any, times: list[float], loss: float) -> dict[str, Any]:
    per_step = _seconds_per_step(times)
    tokens_per_second = BATCH_SIZE * SEQUENCE_LENGTH / per_step if times and per_step > 0 else None
    param = next(model.parameters())
    return {
        "device": str(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "attn_implementation": model.config._attn_implementation,
        "resolved_device": res.device,
        "training_kwargs": {k: v for k, v in res.training_kwargs().items() if isinstance(v, (bool, int, float, str))},
        "steps": len(times),
        "seconds_per_step": round(per_step, 4),
        "first_step_seconds": round(times[0], 4) if times else None,
        "tokens_per_second": round(tokens_per_second, 1) if tokens_per_second else None,
        "loss": round(loss, 4),
    }
