"""TrainingArguments keywords the user passed, checked against the backend they will train on.

Each check reads the installed stack or the registry row, never a list typed here:

- ``torch_compile_backend``: a device's own compile backend (the rows' ``compile_backend`` that is
  not inductor: Gaudi's ``hpu_backend``, Neuron's ``neuron``) compiles for that device only, and
  inductor does not compile for a device whose row names its own (TrainingArguments picks
  ``hpu_backend`` itself on Gaudi, training_args.py ``__post_init__``); on Gaudi, a backend transformers
  replaces (every one but those its ``hpu_backend_compile`` keeps, read from its source) is refused too;
- ``ddp_backend="ccl"``: oneCCL's backend exists only once ``oneccl_bindings_for_pytorch`` is imported
  (neither transformers nor accelerate imports it; transformers' own choices no longer list it);
- ``use_cpu=False`` on a machine whose resolution is the CPU: TrainingArguments trains on the CPU
  anyway (its device order ends in ``ACCELERATE_TORCH_DEVICE`` or cpu), but refuses ``bf16=True``
  there unless ``use_cpu=True`` ("Your setup doesn't support bf16/gpu").
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError
from whichdevice.hardware.registry import backends

if TYPE_CHECKING:
    from whichdevice.core.records import Backend

__all__ = [
    "ONECCL_MODULE",
    "REMOVED_SWITCHES",
    "check_compile_backend",
    "check_compile_mode",
    "check_ddp_package",
    "cpu_switch_off",
    "gaudi_compile_backends",
]

# TrainingArguments switches transformers 5 removed, and what does their job now (transformers 4.x
# deprecated each in its field's help text: "`no_cuda` is deprecated ... use `use_cpu` instead";
# "`use_mps_device` is deprecated ... mps device will be used by default if available"; use_ipex:
# "IPEX is deprecated ... and will be removed", Intel's CPU optimisations being upstream in torch).
REMOVED_SWITCHES = {
    "no_cuda": "use_cpu=True",
    "use_mps_device": "nothing: TrainingArguments uses MPS when it is available (use_cpu=True to avoid it)",
    "use_ipex": "nothing: IPEX's CPU optimisations are in torch itself; torch_compile=True compiles for the CPU",
}

# oneCCL's torch bindings (PyPI: oneccl_bind_pt); importing it registers the "ccl" process group.
ONECCL_MODULE = "oneccl_bindings_for_pytorch"


def _device_compilers() -> dict[str, str]:
    """compile backend -> the row it compiles for, for the rows whose compiler is their own."""
    return {b.compile_backend: b.name for b in backends() if b.compile_backend and b.compile_backend != "inductor"}


def check_compile_backend(backend: Backend, value: Any) -> None:
    """Refuse a ``torch_compile_backend`` that does not compile for ``backend``, naming the right one."""
    if not isinstance(value, str):
        return
    own = backend.compile_backend or "inductor"
    owner = _device_compilers().get(value)
    if owner is not None and owner != backend.name:
        raise ConfigConflictError(
            f"torch_compile_backend={value!r} compiles for {owner} only, but this run trains on {backend.name} "
            f"({backend.hardware}); pass torch_compile_backend={own!r} or leave it out"
        )
    if value == "inductor" and own != "inductor":
        raise ConfigConflictError(
            f"torch_compile_backend='inductor' does not compile for {backend.name} ({backend.hardware}); its "
            f"compile backend is {own!r} (TrainingArguments picks it itself when you leave torch_compile_backend out)"
        )
    kept = gaudi_compile_backends() if backend.name == "hpu" else None
    if kept is not None and value not in (*kept, own):
        raise ConfigConflictError(
            f"torch_compile_backend={value!r} on Gaudi: transformers replaces every torch.compile backend but "
            f"{', '.join(map(repr, kept)) or 'none'} with {own!r} once it has loaded Gaudi's plugin "
            f"(transformers/utils/import_utils.py, hpu_backend_compile, with a warning), so {value!r} would not "
            f"run; pass torch_compile_backend={own!r} or leave it out"
        )


# transformers' patch of torch.compile on Gaudi (utils/import_utils.py, 5.25), made by its first
# is_torch_hpu_available() where Gaudi's plugin loads:
#     def hpu_backend_compile(*args, **kwargs):
#         if kwargs.get("backend") not in ["hpu_backend", "eager"]: ... kwargs["backend"] = "hpu_backend"
_GAUDI_PATCH = re.compile(r"def hpu_backend_compile\(.*?kwargs\.get\(\"backend\"\) not in \[([^\]]*)\]", re.DOTALL)


@lru_cache(maxsize=1)
def gaudi_compile_backends() -> tuple[str, ...] | None:
    """The torch.compile backends the installed transformers keeps on Gaudi, read from its source without
    importing it; None where it patches nothing. A patch whose list cannot be read keeps none: every backend
    but the row's own is refused (fail closed)."""
    spec = importlib.util.find_spec("transformers")
    for root in (spec.submodule_search_locations or ()) if spec is not None else ():
        try:
            text = Path(root, "utils", "import_utils.py").read_text(encoding="utf-8")
        except OSError:
            continue
        if "def hpu_backend_compile(" not in text:
            return None
        found = _GAUDI_PATCH.search(text)
        return tuple(re.findall(r"[\"']([^\"']+)[\"']", found.group(1))) if found else ()
    return None


def check_compile_mode(backend: Backend, features: frozenset[str], torch_compile: Any) -> None:
    """Refuse torch_compile=True on Gaudi in lazy mode: hpu_backend compiles in eager mode only
    (Intel's PyTorch Support Matrix: torch.compile(backend="hpu_backend") Yes with PT_HPU_LAZY_MODE=0,
    No with PT_HPU_LAZY_MODE=1)."""
    from whichdevice.hardware.probes.hpu import LAZY_MODE_VARIABLE

    if backend.name == "hpu" and torch_compile is True and "execution-mode:lazy" in features:
        raise ConfigConflictError(
            f"torch_compile=True on Gaudi with {LAZY_MODE_VARIABLE}=1 (lazy mode): torch.compile runs in eager "
            f"mode only (Intel Gaudi PyTorch Support Matrix). Run with {LAZY_MODE_VARIABLE}=0, set before Python "
            "starts, or leave torch_compile out (lazy mode builds its own graphs)"
        )


def check_ddp_package(value: Any) -> str | None:
    """Refuse ``ddp_backend="ccl"`` without oneCCL's bindings; with them, the reminder to import them."""
    if value != "ccl":
        return None
    if importlib.util.find_spec(ONECCL_MODULE) is None:
        raise ConfigConflictError(
            f"ddp_backend='ccl' needs oneCCL's bindings ({ONECCL_MODULE}), which are not installed: "
            "pip install oneccl_bind_pt (from Intel's index), or use the backend torch ships: 'xccl' on Intel "
            "GPUs (torch 2.7 or newer), 'gloo' on the CPU"
        )
    return (
        f"ddp_backend='ccl': `import {ONECCL_MODULE}` before the Trainer starts; it registers 'ccl' and "
        "neither transformers nor accelerate imports it"
    )


def cpu_switch_off(
    backend: Backend,
    user: dict[str, Any],
    filled: dict[str, Any],
    why: str = "this machine has no usable accelerator",
) -> tuple[dict[str, Any], str]:
    """``use_cpu=False`` where the resolution is the CPU: the keywords to build with, and what was done.

    TrainingArguments would train on the CPU anyway, so the user's value is kept; bf16 autocast,
    which it refuses without ``use_cpu=True``, is dropped unless the user asked for it (then refused).
    """
    assert backend.name == "cpu" and user.get("use_cpu") is False
    if user.get("bf16") or user.get("bf16_full_eval"):
        raise ConfigConflictError(
            "bf16=True with use_cpu=False on a machine that trains on the CPU: TrainingArguments refuses it "
            "('Your setup doesn't support bf16/gpu'); pass use_cpu=True for bf16 on the CPU"
        )
    out = dict(filled)
    note = f"use_cpu=False kept: {why}, so TrainingArguments trains on the CPU anyway"
    if out.get("bf16") and "bf16" not in user:
        out["bf16"] = False
        note += (
            "; bf16=False, since TrainingArguments refuses bf16 on the CPU unless use_cpu=True (pass use_cpu=True "
            "for bf16 autocast)"
        )
    return out, note
