"""``whichdevice smoke``: prove the resolution works end to end, with nothing to download.

A tiny Llama is built from a config (random weights), saved, resolved again with ``model=`` the
saved folder, loaded back with ``from_pretrained(path, **res.model_kwargs())``, checked for the
resolved device, dtype and attention, made to generate from random token ids, and trained for a
few steps with ``Trainer`` and ``whichdevice.training_arguments``. Each step reports on stderr as
it runs; what the libraries log meanwhile is collected as notes under the step, so the progress
display stays readable.

``steps`` holds one function per step, ``progress`` the progress lines, notes and summary; the
sequence is :func:`run_smoke`, here. It calls each step through this module's names, so replacing
``whichdevice.smoke._import_transformers`` replaces that step (the tests do).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from whichdevice.core.errors import DeviceError
from whichdevice.core.progress import showing
from whichdevice.hardware.envhooks import scoped_env
from whichdevice.report.gather import SCHEMA_VERSION
from whichdevice.smoke.progress import (
    Progress,
    _Runner,
    _Step,
    _transformers_logs_to_root,
    render_summary,
)
from whichdevice.smoke.progress import _collect_messages as _collect_messages
from whichdevice.smoke.steps import (
    NEW_TOKENS,
    TINY_LLAMA,
    TRAIN_STEPS,
    SmokeCheckError,
    _build,
    _generate,
    _import_transformers,
    _load,
    _resolve,
    _train,
    tiny_llama_config,
)
from whichdevice.smoke.steps import _verify as _verify

__all__ = [
    "NEW_TOKENS",
    "SMOKE_REFUSAL",
    "TINY_LLAMA",
    "TRAIN_STEPS",
    "Progress",
    "SmokeCheckError",
    "render_summary",
    "run_smoke",
    "tiny_llama_config",
]

# Also the command's answer to ``whichdevice smoke --simulate``, before anything runs.
SMOKE_REFUSAL = "smoke runs real hardware; --simulate only changes the report"

_TASKS = ("inference", "training")


def run_smoke(
    *,
    tasks: Sequence[str] = _TASKS,
    device: str | None = None,
    progress_stream: TextIO | None = None,
    debug: bool = False,
    workdir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run the smoke test; returns the JSON-safe result (``ok``, ``exit_code``, steps, summaries).

    Progress goes to ``progress_stream`` (None: silent). Failures do not raise: the result
    carries the failing step and its error, and ``exit_code`` (1, or 2 for a bad request).
    """
    from whichdevice.testing import active

    for task in tasks:
        if task not in _TASKS:
            raise DeviceError(f"task={task!r}: use 'inference', 'training' or both")
    if active():
        raise DeviceError(SMOKE_REFUSAL)
    runner = _Runner(Progress(progress_stream, len(_planned_steps(tasks))), debug)
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
    # A slow part of a step (probing, reading the model) shows on the step's own line.
    with showing(runner.progress.working):
        _run_steps(runner, state, result, tasks, device, workdir)
    result["seconds"] = round(time.perf_counter() - start, 3)
    _conclude(result, runner.steps, state.get("where", ""))
    return result


def _planned_steps(tasks: Sequence[str]) -> list[str]:
    names = ["resolve", "import transformers", "build and save a tiny Llama"]
    if "inference" in tasks:
        names += ["load for inference", "generate"]
    if "training" in tasks:
        names += ["load for training", f"train {TRAIN_STEPS} steps"]
    return names


def _run_steps(
    runner: _Runner,
    state: dict[str, Any],
    result: dict[str, Any],
    tasks: Sequence[str],
    device: str | None,
    workdir: str | os.PathLike[str] | None,
) -> None:
    """Each step in order, until one fails."""
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
            ok = ok and runner.step(f"train {TRAIN_STEPS} steps", lambda s: _train(state, tmp, result, runner.progress))


def _conclude(result: dict[str, Any], steps: list[_Step], where: str) -> None:
    """The steps into ``result``, and the first failure as its error and exit code."""
    result["steps"] = [s.to_dict() for s in steps]
    failed = next((s for s in steps if not s.ok), None)
    if failed is None:
        result.update(ok=True, exit_code=0)
        return
    assert failed.error is not None
    message = f"step '{failed.name}' failed{where}: {failed.error['type']}: {failed.error['message']}"
    result["error"] = {"step": failed.name, "type": failed.error["type"], "message": message}
    result["exit_code"] = failed.error["exit_code"]
