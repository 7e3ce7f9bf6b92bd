"""``import torch`` with the plugins it autoloads, and ``whichdevice.backends`` plugins, each bounded.

torch imports every ``torch.backends`` entry point on ``import torch`` (torch_npu registers one);
one that hangs or aborts would take the whole call with it. Here each plugin is tried in a child
first (:mod:`whichdevice.hardware.probes.trial`) while torch is imported in this process with autoload off;
the plugins that passed are then loaded as torch would, each in a thread with the limit. Without
plugins this is a plain ``import torch``.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from typing import Any

from whichdevice.core.entry_points import AUTOLOAD_VARIABLE, entry_points
from whichdevice.core.entry_points import TORCH_GROUP as TORCH_PLUGIN_GROUP
from whichdevice.hardware.envhooks import scoped_env
from whichdevice.hardware.probes.outcomes import changes_since, environment_snapshot
from whichdevice.hardware.probes.verdicts import HUNG, bad_imports, remember_bad_import, top_module
from whichdevice.hardware.registry import ENTRY_POINT_GROUP

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from whichdevice.hardware.probes.trial import Step

__all__ = ["import_torch", "load_plugin", "torch_plugins"]


def torch_plugins() -> list[Step]:
    """The ``torch.backends`` entry points ``import torch`` would load (none when autoload is off)."""
    if os.environ.get(AUTOLOAD_VARIABLE, "1") != "1":
        return []
    found = entry_points(group=TORCH_PLUGIN_GROUP)
    if not found:
        return []  # the trial's machinery is imported only where there is something to try
    from whichdevice.hardware.probes.trial import Step

    return [
        Step(
            f"{TORCH_PLUGIN_GROUP} plugin {ep.name!r} ({ep.value})", top_module(ep.value), (TORCH_PLUGIN_GROUP, ep.name)
        )
        for ep in found
    ]


def import_torch(timeout: float) -> list[str]:
    """``import torch`` with its autoloaded plugins each bounded by ``timeout``; warnings to report.

    Without plugins this is a plain ``import torch``. With them, each plugin is tried in a child
    while torch is imported here with autoload off; plugins that passed are then loaded here as
    torch would have, each in a thread with the limit.
    """
    if "torch" in sys.modules:
        return []
    plugins = torch_plugins()
    if not plugins:
        import torch

        return []
    from whichdevice.hardware.probes.trial import trial_imports

    tried = threading.Thread(target=trial_imports, args=(plugins, timeout), daemon=True)
    tried.start()
    before = environment_snapshot()
    with scoped_env(**{AUTOLOAD_VARIABLE: "0"}):
        import torch  # noqa: F401
    tried.join()
    warnings = []
    for step in plugins:
        if step.module in bad_imports():
            warnings.append(f"torch's {step.label}: {bad_imports()[step.module]}")
            continue
        problem = _load_in_thread(step, timeout)
        if problem:
            warnings.append(f"torch's {step.label} {problem}")
    changed = changes_since(before)
    if changed:
        warnings.append(f"importing torch and its plugins changed the environment: {', '.join(changed)}")
    return warnings


def _load_in_thread(step: Step, timeout: float) -> str:
    box: dict[str, BaseException] = {}

    def load() -> None:
        try:
            for ep in entry_points(group=TORCH_PLUGIN_GROUP):
                if (TORCH_PLUGIN_GROUP, ep.name) == step.entry_point:
                    ep.load()()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=load, name=f"whichdevice-plugin-{step.module}", daemon=True)
    thread.start()
    thread.join(None if math.isinf(timeout) else timeout)
    if thread.is_alive():
        reason = f"importing {step.label} {HUNG} within {timeout:g} s"
        remember_bad_import([step.module], reason)
        return f"did not finish loading within {timeout:g} s; whichdevice gave up on it"
    if "error" in box:
        exc = box["error"]
        return f"failed to load ({type(exc).__name__}: {exc}); torch itself would refuse to import"
    return ""


def load_plugin(ep: Any, timeout: float) -> Any:
    """Load a ``whichdevice.backends`` entry point, once every plugin has been tried in a child."""
    from whichdevice.hardware.probes.trial import Step, trial_imports

    steps = [
        Step(f"whichdevice plugin {e.name!r} ({e.value})", top_module(e.value), (ENTRY_POINT_GROUP, e.name))
        for e in entry_points(group=ENTRY_POINT_GROUP)
    ]
    bad = trial_imports(steps, timeout)
    top = top_module(ep.value)
    if top in bad:
        raise RuntimeError(bad[top])
    return ep.load()
