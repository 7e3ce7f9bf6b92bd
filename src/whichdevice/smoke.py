"""``whichdevice smoke``: prove the resolution works end to end, with nothing to download.

A tiny Llama is built from a config (random weights), saved, resolved again with ``model=`` the
saved folder, loaded back with ``from_pretrained(path, **res.model_kwargs())``, checked for the
resolved device, dtype and attention, made to generate from random token ids, and trained for a
few steps with ``Trainer`` and ``whichdevice.training_arguments``. Each step reports on stderr as
it runs; what the libraries log meanwhile is collected as notes under the step, so the progress
display stays readable.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from whichdevice.envhooks import scoped_env
from whichdevice.errors import DeviceError

__all__ = ["SmokeCheckError", "render_summary", "run_smoke", "tiny_llama_config"]

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


# ------------------------------------------------------------------------------------ progress


@dataclass
class _Step:
    name: str
    ok: bool | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "seconds": round(self.seconds, 4),
            "notes": list(self.notes),
            "error": self.error,
        }


class Progress:
    """One line per step on ``stream``: rewritten in place on a terminal, appended otherwise."""

    def __init__(self, stream: TextIO | None, total: int) -> None:
        self.stream = stream
        self.total = total
        self.index = 0
        self.label = ""
        isatty = getattr(stream, "isatty", None)
        try:
            self.tty = bool(isatty and isatty())
        except (ValueError, OSError):
            self.tty = False
        from whichdevice.report import Style, use_color

        self.style = Style(use_color(stream) if stream is not None else False)

    def _write(self, text: str) -> None:
        if self.stream is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()

    def start(self, label: str) -> None:
        self.index += 1
        self.label = f"[{self.index}/{self.total}] {label}"
        self._write(f"\r\033[K{self.label} ..." if self.tty else f"{self.label} ... ")

    def update(self, detail: str) -> None:
        # Only a terminal can redraw a line; a log file gets the result when the step ends.
        if self.tty:
            self._write(f"\r\033[K{self.label} ... {detail}")

    def finish(self, step: _Step, detail: str = "") -> None:
        s = self.style
        if step.ok:
            outcome = s("ok", "green") + f" ({step.seconds:.2f} s)" + (f" {detail}" if detail else "")
        else:
            outcome = s("FAILED", "red", "bold") + f" ({step.seconds:.2f} s)"
        self._write((f"\r\033[K{self.label} ... " if self.tty else "") + outcome + "\n")
        for note in step.notes:
            self._write(s(f"      note: {note}", "dim") + "\n")


# --------------------------------------------------------------------------- library messages


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.messages.append(record.getMessage().strip().splitlines()[0])


@contextlib.contextmanager
def _collect_messages(sink: list[str]) -> Iterator[None]:
    """Library log records (WARNING and up) and Python warnings go to ``sink`` instead of stderr."""
    collector = _Collector()
    root = logging.getLogger()
    root.addHandler(collector)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            root.removeHandler(collector)
            messages = collector.messages + [
                str(w.message).strip().splitlines()[0]
                for w in caught
                # Deprecation notices speak to library authors, not to whoever runs the smoke test.
                if str(w.message).strip()
                and not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning))
            ]
            for m in messages:
                if m and m not in sink:
                    sink.append(m)


@contextlib.contextmanager
def _transformers_logs_to_root() -> Iterator[None]:
    # transformers logs through its own handler to stderr; let its records reach the collector.
    # Its tqdm bars (writing shards, loading weights) would break the progress line: off too.
    import importlib

    tf_logging: Any = importlib.import_module("transformers.utils.logging")
    bars = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_default_handler()
    tf_logging.enable_propagation()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            tf_logging.enable_progress_bar()
        tf_logging.disable_propagation()
        tf_logging.enable_default_handler()


# ---------------------------------------------------------------------------------------- run


class _Runner:
    def __init__(self, progress: Progress, debug: bool) -> None:
        self.progress = progress
        self.debug = debug
        self.steps: list[_Step] = []

    def step(self, name: str, function: Callable[[_Step], str | None]) -> bool:
        step = _Step(name)
        self.steps.append(step)
        self.progress.start(name)
        start = time.perf_counter()
        detail: str | None = None
        try:
            with _collect_messages(step.notes):
                detail = function(step)
            step.ok = True
        except Exception as exc:
            step.ok = False
            from whichdevice.report import exit_code_for

            code = exit_code_for(exc)
            step.error = {"type": type(exc).__name__, "message": str(exc), "exit_code": code}
            if self.debug:
                step.error["traceback"] = traceback.format_exc()
        step.seconds = time.perf_counter() - start
        self.progress.finish(step, detail or "")
        if not step.ok and self.debug and step.error is not None and self.progress.stream is not None:
            self.progress._write(step.error["traceback"])
        return bool(step.ok)


def _planned_steps(tasks: Sequence[str]) -> list[str]:
    names = ["resolve", "import transformers", "build and save a tiny Llama"]
    if "inference" in tasks:
        names += ["load for inference", "generate"]
    if "training" in tasks:
        names += ["load for training", f"train {TRAIN_STEPS} steps"]
    return names


def run_smoke(
    *,
    tasks: Sequence[str] = ("inference", "training"),
    device: str | None = None,
    progress_stream: TextIO | None = None,
    debug: bool = False,
    workdir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run the smoke test; returns the JSON-safe result (``ok``, ``exit_code``, steps, summaries).

    Progress goes to ``progress_stream`` (None: silent). Failures do not raise: the result
    carries the failing step and its error, and ``exit_code`` (1, or 2 for a bad request).
    """
    from whichdevice.report import SCHEMA_VERSION
    from whichdevice.testing import active

    for task in tasks:
        if task not in ("inference", "training"):
            raise DeviceError(f"task={task!r}: use 'inference', 'training' or both")
    if active():
        raise DeviceError("smoke runs real hardware; --simulate only changes the report")
    names = _planned_steps(tasks)
    runner = _Runner(Progress(progress_stream, len(names)), debug)
    state: dict[str, Any] = {}
    result: dict[str, Any] = {
        "kind": "smoke",
        "schema_version": SCHEMA_VERSION,
        "ok": False,
        "exit_code": 1,
        "tasks": list(tasks),
        "requested": device,
        "steps": [],
        "inference": None,
        "training": None,
        "seconds": 0.0,
        "error": None,
    }
    start = time.perf_counter()
    # "Nothing to download": the model comes from a config, and with the Hub switched off an
    # import-time fetch (bitsandbytes asks the Hub for a CPU kernel) fails fast instead of
    # waiting on the network. A user's own HF_HUB_OFFLINE is kept.
    offline = {} if "HF_HUB_OFFLINE" in os.environ else {"HF_HUB_OFFLINE": "1"}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="whichdevice-smoke-", dir=workdir)))
        ok = runner.step("resolve", lambda s: _resolve(state, tasks, device))
        if ok:
            stack.enter_context(scoped_env(**offline))
            ok = runner.step("import transformers", lambda s: _import_transformers(state))
            if ok:
                stack.enter_context(_transformers_logs_to_root())
        ok = ok and runner.step("build and save a tiny Llama", lambda s: _build(state, tmp))
        if ok and "inference" in tasks:
            ok = runner.step("load for inference", lambda s: _load(state, tmp, "inference"))
            ok = ok and runner.step("generate", lambda s: _generate(state, result))
        if ok and "training" in tasks:
            ok = runner.step("load for training", lambda s: _load(state, tmp, "training"))
            ok = ok and runner.step(f"train {TRAIN_STEPS} steps", lambda s: _train(state, tmp, result, runner))
    result["seconds"] = round(time.perf_counter() - start, 3)
    result["steps"] = [s.to_dict() for s in runner.steps]
    failed = next((s for s in runner.steps if not s.ok), None)
    if failed is None:
        result.update(ok=True, exit_code=0)
    else:
        assert failed.error is not None
        where = state.get("where", "")
        message = f"step '{failed.name}' failed{where}: {failed.error['type']}: {failed.error['message']}"
        result["error"] = {"step": failed.name, "type": failed.error["type"], "message": message}
        result["exit_code"] = failed.error["exit_code"]
    return result


def _resolve(state: dict[str, Any], tasks: Sequence[str], device: str | None) -> str:
    from whichdevice.resolver import resolve_device

    for task in tasks:
        state[task] = resolve_device(device, task=task)
    state["device"] = device
    first = state[tasks[0]]
    state["where"] = f" on {first.device}"
    return f"{first.device}, {first.dtype_name}, {first.attn_implementation}" + (
        " (SIMULATED)" if first.simulated else ""
    )


def _import_transformers(state: dict[str, Any]) -> None:
    from whichdevice.errors import PackageVersionError
    from whichdevice.packages import transformers_problem

    # Fail here, with the pip command, rather than steps later inside from_pretrained.
    problem = transformers_problem()
    if problem:
        raise PackageVersionError(problem)
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

    from whichdevice.resolver import resolve_device

    # Resolved again with the saved model, as a user loading it would: placement checks its size
    # and the attention can be the one verified for its architecture.
    res = state[task] = resolve_device(state["device"], task=task, model=tmp / "model")
    kwargs = res.model_kwargs()
    if kwargs.get("use_kernels"):
        # Hub kernels are downloaded on first use; the smoke test promises no downloads.
        kwargs["use_kernels"] = False
    model = AutoModelForCausalLM.from_pretrained(tmp / "model", **kwargs)
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
    if attn != res.attn_implementation:
        raise SmokeCheckError(f"the model uses attention {attn!r}, but the resolution says {res.attn_implementation!r}")


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


def _train(state: dict[str, Any], tmp: Path, result: dict[str, Any], runner: _Runner) -> str:
    torch = state["torch"]
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback

    from whichdevice.training import training_arguments

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
    progress = runner.progress

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        """Times each optimizer step and shows it on the progress line."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter() - self.start)
            progress.update(f"step {state.global_step}/{TRAIN_STEPS}")

    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[StepTimer()])
    # Trainer prints its final metrics (PrinterCallback) or a tqdm bar (ProgressCallback) to the
    # terminal; the smoke summary reports the same numbers.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    output = trainer.train()
    loss = float(output.training_loss)
    if not math.isfinite(loss):
        raise SmokeCheckError(f"the training loss is {loss}: {res.dtype_name} training diverged on {res.device}")
    # The first step prepares kernels and optimizer state; the steady rate is in the others.
    steady = times[1:] or times
    per_step = sum(steady) / len(steady) if steady else float("nan")
    tokens_per_second = BATCH_SIZE * SEQUENCE_LENGTH / per_step if times and per_step > 0 else None
    param = next(model.parameters())
    result["training"] = {
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
    return f"{per_step:.3f} s/step, loss {loss:.3f}"


# ------------------------------------------------------------------------------------- output


def render_summary(result: dict[str, Any]) -> str:
    """The closing summary a person reads: device, dtype, attention, speed, per task."""
    lines = [f"smoke passed in {result['seconds']:.1f} s (nothing downloaded)"]
    inf = result.get("inference")
    if inf:
        lines.append(
            f"  inference  device {inf['device']}, dtype {inf['dtype']}, attention {inf['attn_implementation']}: "
            f"{inf['new_tokens']} new tokens at {inf['tokens_per_second']} tokens/s"
        )
    tr = result.get("training")
    if tr:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in tr["training_kwargs"].items())
        rate = f", {tr['tokens_per_second']} tokens/s" if tr["tokens_per_second"] else ""
        lines.append(
            f"  training   device {tr['device']}, dtype {tr['dtype']}, attention {tr['attn_implementation']}, "
            f"TrainingArguments({kwargs}): {tr['steps']} steps, {tr['seconds_per_step']} s/step{rate} "
            f"after a first step of {tr['first_step_seconds']} s, loss {tr['loss']}"
        )
    return "\n".join(lines) + "\n"
