"""What a person sees while the smoke test runs: one progress line per step, library messages as notes.

:class:`Progress` writes the lines (rewritten in place on a terminal, appended in a log), the
collectors turn what transformers and Python warn meanwhile into notes under the step, and
:func:`render_summary` closes the run.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from whichdevice.core.errors import exit_code_for, printable
from whichdevice.core.progress import LOGGER
from whichdevice.report.render import Style, use_color

__all__ = ["Progress", "render_summary"]


@dataclass
class _Step:
    name: str
    ok: bool | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None
    # What another package logged while it was being imported (bitsandbytes reaching for a Hub
    # kernel): not about this run, so out of the notes, and shown with --debug only.
    import_notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "seconds": round(self.seconds, 4),
            "notes": list(self.notes),
            "import_notes": list(self.import_notes),
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
            self._write(f"\r\033[K{self.label} ... {printable(detail)}")

    def working(self, what: str | None) -> None:
        """A slow part of the step (``whichdevice.core.progress``): shown after the label, then gone."""
        if self.tty:
            self._write(f"\r\033[K{self.label} ..." + (f" {printable(what)}" if what else ""))

    def finish(self, step: _Step, detail: str = "") -> None:
        s = self.style
        if step.ok:
            outcome = s("ok", "green") + f" ({step.seconds:.2f} s)" + (f" {printable(detail)}" if detail else "")
        else:
            outcome = s("FAILED", "red", "bold") + f" ({step.seconds:.2f} s)"
        self._write((f"\r\033[K{self.label} ... " if self.tty else "") + outcome + "\n")
        for note in step.notes:
            # A note is a library's message, which may quote a device's name or a file: escaped.
            self._write(s(f"      note: {printable(note)}", "dim") + "\n")


# --------------------------------------------------------------------------- library messages


def _importing(outer: set[int]) -> str | None:
    """The package whose module code (an import) is running under the caller, inside the collected
    block (frames in ``outer`` are the block's callers), or None; whichdevice's own imports are not one."""
    frame = sys._getframe(1)
    while frame is not None and id(frame) not in outer:
        name = frame.f_globals.get("__name__")
        if frame.f_code.co_name == "<module>" and isinstance(name, str) and name != "__main__":
            package = name.split(".")[0]
            if package != "whichdevice":
                return package
        frame = frame.f_back  # type: ignore[assignment]
    return None


class _Collector(logging.Handler):
    def __init__(self, outer: set[int]) -> None:
        super().__init__(logging.WARNING)
        self.outer = outer
        self.messages: list[tuple[str, str | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.messages.append((record.getMessage().strip().splitlines()[0], _importing(self.outer)))


@contextlib.contextmanager
def _collect_messages(sink: list[str], import_sink: list[str] | None = None) -> Iterator[None]:
    """Library log records (WARNING and up) and Python warnings go to ``sink`` instead of stderr;
    those logged while another package was being imported go to ``import_sink`` (dropped if None)."""
    outer = set()
    frame = sys._getframe(2)  # the block's caller and its callers: their own imports are not a package's
    while frame is not None:
        outer.add(id(frame))
        frame = frame.f_back  # type: ignore[assignment]
    collector = _Collector(outer)
    root = logging.getLogger()
    root.addHandler(collector)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            # Deprecation notices speak to library authors, not to whoever runs the smoke test.
            if not issubclass(category, (DeprecationWarning, PendingDeprecationWarning)):
                collector.messages.append(
                    (str(message).strip().splitlines()[0] if str(message).strip() else "", _importing(outer))
                )

        warnings.showwarning = show  # called where the warning is raised, so its stack is readable
        try:
            yield
        finally:
            root.removeHandler(collector)
            for message, package in collector.messages:
                if not message:
                    continue
                target, text = (
                    (sink, message) if package is None else (import_sink, f"{message} (on importing {package})")
                )
                if target is not None and text not in target:
                    target.append(text)


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
            with _collect_messages(step.notes, step.import_notes):
                detail = function(step)
            step.ok = True
        except Exception as exc:
            step.ok = False
            code = exit_code_for(exc)
            step.error = {"type": type(exc).__name__, "message": str(exc), "exit_code": code}
            if self.debug:
                step.error["traceback"] = traceback.format_exc()
        step.seconds = time.perf_counter() - start
        LOGGER.info("smoke step %s: %s in %.2f s", name, "ok" if step.ok else "failed", step.seconds)
        self.progress.finish(step, detail or "")
        if self.debug:
            for note in step.import_notes:
                self.progress._write(self.progress.style(f"      import note: {printable(note)}", "dim") + "\n")
        if not step.ok and self.debug and step.error is not None and self.progress.stream is not None:
            self.progress._write(step.error["traceback"])
        return bool(step.ok)


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
    return "\n".join(printable(line) for line in lines) + "\n"
