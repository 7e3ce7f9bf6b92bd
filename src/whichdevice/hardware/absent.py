"""Backends that are simply not installed: said in one line where a trace or the report lists them.

A machine has one or two backends and lacks the rest; listing each absent one with its install command
before the answer buried it (issue 58). A backend is *simply* absent when its probe's reason is the plain
one written here: its package is not installed (or, simulated, it is not on the simulated machine). A
backend that is installed but unusable, or whose torch build lacks it, keeps its own line and reason.
Nothing is dropped: the JSON keeps every step and row, and ``explain(verbose=True)`` and
``whichdevice --verbose`` print each install command.
"""

from __future__ import annotations

from collections.abc import Sequence

from whichdevice.core.errors import printable
from whichdevice.core.records import TraceStep
from whichdevice.hardware.probes.common import NOT_SIMULATED, absent_reason, simulated_absent_reason
from whichdevice.hardware.registry import backends

__all__ = ["absent_kind", "collapse_absent", "trace_text"]

NOT_INSTALLED = "not installed"
# Where each install command is, said on the collapsed line.
_EACH = "each one's install command: explain(verbose=True), whichdevice --verbose or --json"


def absent_kind(name: str, reason: str | None) -> str | None:
    """ "not installed" or "not present on the simulated machine" where ``reason`` is the plain one for the
    registry row ``name``; None for any other reason (or a name no row has)."""
    row = next((b for b in backends() if b.name == name), None)
    if row is None or reason is None:
        return None
    return {absent_reason(row): NOT_INSTALLED, simulated_absent_reason(row): NOT_SIMULATED}.get(reason)


def collapse_absent(steps: Sequence[TraceStep]) -> list[TraceStep]:
    """The trace with detection's "not chosen" steps of simply absent backends as one step per kind, in the
    place of the first: "not installed: neuron, tpu, npu, hpu, mlu, musa"."""
    kinds = [_step_kind(step) for step in steps]
    groups: dict[str, list[str]] = {}
    for step, kind in zip(steps, kinds, strict=True):
        if kind is not None:
            groups.setdefault(kind, []).append(step.topic)
    out: list[TraceStep] = []
    for step, kind in zip(steps, kinds, strict=True):
        if kind is None:
            out.append(step)
        elif step.topic == groups[kind][0]:
            out.append(TraceStep("others", f"{kind}: {', '.join(groups[kind])} ({_EACH})", False))
    return out


def _step_kind(step: TraceStep) -> str | None:
    prefix = "not chosen: "
    if step.chosen is not False or not step.message.startswith(prefix):
        return None
    return absent_kind(step.topic, step.message.removeprefix(prefix))


def trace_text(header: str, steps: Sequence[TraceStep], *, verbose: bool = False) -> str:
    """A trace as ``Resolution.explain()`` prints it, the absent backends folded unless ``verbose`` (the report
    renders a gathered or replayed trace the same way)."""
    shown = list(steps) if verbose else collapse_absent(steps)
    width = max((len(s.topic) for s in shown), default=8)
    # A step quotes what devices, files and variables said: escaped, so one line stays one line.
    lines = [printable(header)]
    for step in shown:
        mark = {True: "+", False: "-", None: " "}[step.chosen]
        lines.append(f"  {mark} {step.topic.ljust(width)}  {printable(step.message)}")
    return "\n".join(lines)
