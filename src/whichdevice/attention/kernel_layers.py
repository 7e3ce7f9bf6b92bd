"""Hub kernels layer by layer: which of a model's layers have a kernel for this device, and which train with one.

transformers marks the layers a Hub kernel may replace (``@use_kernel_forward_from_hub("RMSNorm")``
on a class gives it ``kernel_layer_name``; a decorated function such as ``apply_rotary_pos_emb`` is
attached to the modules that call it through ``@use_kernelized_func``, each instance keeping it in
``_kernel_funcs``), and ``from_pretrained(use_kernels=True)`` registers its own mapping
(``transformers.integrations.hub_kernels.get_kernel_mapping_transformers()``): layer name -> device
(a key, or a kernels ``Device`` with a compute-capability range) -> a repository per kernels
``Mode``. Both are read here, never typed: the model is built on the meta device from its config
(transformers' own classes, no weights), and each marked layer is looked up for this device's key
and capability.

Modes: kernels picks a repository for the mode it kernelizes with (``_select_repository``), and
transformers kernelizes again with ``Mode.TRAINING`` when ``model.train()`` runs (Trainer does). A
layer mapped for inference only then keeps its original forward while training; it is named. Whether
a mapped kernel has a backward (``has_backward``) is known only once it is downloaded, and nothing
is downloaded here: kernels itself falls back to the original forward when it lacks one.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.frozen import NamedTuple

if TYPE_CHECKING:
    from whichdevice.core.records import ProbeResult, TraceStep
    from whichdevice.model.facts import ModelFacts

__all__ = ["KernelLayer", "kernel_layer_steps", "marked_layers", "model_kernel_layers"]


class KernelLayer(NamedTuple):
    """One marked layer of the model, and what transformers' mapping gives it on this device."""

    owner: str  # the class, or "Class.function" for a function attached with use_kernelized_func
    layer_name: str  # its kernel_layer_name, the mapping's key
    modules: int  # how many of the model's modules carry it
    repository: str | None  # the repository mapped here for inference; None: its own forward runs
    trains: bool  # the mapping also has a repository for kernels' Mode.TRAINING

    def shown(self) -> str:
        many = f" x{self.modules}" if self.modules > 1 else ""
        return f"{self.owner} ({self.layer_name}){many}"


def marked_layers(model: Any) -> Counter[tuple[str, str]]:
    """(class or "Class.function", kernel layer name) -> how many of the model's modules carry it."""
    found: Counter[tuple[str, str]] = Counter()
    for module in model.modules():
        name = getattr(type(module), "kernel_layer_name", None)
        if isinstance(name, str):
            found[(type(module).__name__, name)] += 1
        for attached, func in module.__dict__.get("_kernel_funcs", {}).items():
            name = getattr(type(func), "kernel_layer_name", None)
            if isinstance(name, str):
                found[(f"{type(module).__name__}.{attached}", name)] += 1
    return found


def _repos_here(entry: Any, key: str, capability: tuple[int, int] | None) -> Any:
    """The repositories (one, or a Mode -> repository dict) an entry of the mapping has for this device."""
    for device, repos in entry.items():
        if isinstance(device, str):
            if device == key:
                return repos
            continue
        if getattr(device, "type", None) != key:
            continue
        props = getattr(device, "properties", None)
        if props is None:
            return repos
        low, high = getattr(props, "min_capability", None), getattr(props, "max_capability", None)
        if capability is None or low is None or high is None:
            continue  # a range this machine's GPU cannot be placed in: not claimed
        if low <= capability[0] * 10 + capability[1] <= high:
            return repos
    return None


def _pick(repos: Any, mode: Any) -> Any:
    """The repository kernels selects for ``mode`` (its own ``_select_repository``), or None."""
    if not isinstance(repos, dict):
        return repos  # no modes given: kernels uses it for every mode (Mode.FALLBACK)
    try:
        from kernels._internals.layer.repos import _select_repository
    except ImportError:  # another kernels: the flags themselves, as that function reads them
        from kernels import Mode

        wanted = [m for m in repos if mode in m or m == Mode.FALLBACK]
        return repos[wanted[0]] if wanted else None
    picked = _select_repository(repos, mode=mode)
    return picked[0] if picked is not None else None


def _repo_text(repo: Any) -> str:
    return str(getattr(repo, "_repo_id", None) or getattr(repo, "repo_id", None) or repo)


def model_kernel_layers(model: Any, key: str, capability: tuple[int, int] | None) -> list[KernelLayer]:
    """The model's marked layers with the repository transformers' mapping gives this device for
    inference, and whether it also has one for training."""
    from kernels import Mode
    from transformers.integrations.hub_kernels import get_kernel_mapping_transformers

    mapping = get_kernel_mapping_transformers()
    out = []
    for (owner, name), count in sorted(marked_layers(model).items()):
        entry = mapping.get(name)
        repos = _repos_here(entry, key, capability) if isinstance(entry, dict) else None
        inference = _pick(repos, Mode.INFERENCE) if repos is not None else None
        training = _pick(repos, Mode.TRAINING) if repos is not None else None
        shown = _repo_text(inference) if inference is not None else None
        out.append(KernelLayer(owner, name, count, shown, training is not None))
    return out


def _config_of(model: ModelFacts) -> Any:
    from whichdevice.model.size import auto_config

    if model.config_object is not None:
        return model.config_object
    if model.path is None:
        return None
    return auto_config(model.path if model.path.is_dir() else model.path.parent)


def kernel_layer_steps(model: ModelFacts | None, key: str | None, result: ProbeResult, task: str) -> list[TraceStep]:
    """The trace lines: which of ``model``'s layers run a Hub kernel here, and, for training, which do not
    train with one."""
    from whichdevice.core.packages import package_version
    from whichdevice.core.records import TraceStep

    if key is None:
        return []
    if model is None:
        return [TraceStep("kernels", "pass model= to list which of the model's layers have a Hub kernel here")]
    from whichdevice.model.built import build_on_meta

    try:
        config = _config_of(model)
    except DeviceError as exc:
        return [TraceStep("kernels", f"the model's layers could not be listed: {exc}")]
    built, errors = build_on_meta(config) if config is not None else (None, ["no transformers config"])
    if built is None:
        return [TraceStep("kernels", f"the model's layers could not be listed: {'; '.join(errors)}")]
    capability = result.min_capability
    layers = model_kernel_layers(built, key, capability)
    where = f"{key}" + (f" (cc {capability[0]}.{capability[1]})" if capability else "")
    source = f"transformers {package_version('transformers')}'s kernel mapping for {where}"
    if not layers:
        return [TraceStep("kernels", f"no layer of {type(built).__name__} is marked for Hub kernels ({source})")]
    mapped = [f"{layer.shown()} -> {layer.repository}" for layer in layers if layer.repository]
    unmapped = [layer.shown() for layer in layers if not layer.repository]
    steps = [
        TraceStep(
            "kernels",
            f"layers with a Hub kernel ({source}, inference): {'; '.join(mapped) or 'none'}; without one (their own "
            f"forward): {', '.join(unmapped) or 'none'}",
        )
    ]
    if task == "training":
        trains = [layer.shown() for layer in layers if layer.repository and layer.trains]
        inference_only = [layer.shown() for layer in layers if layer.repository and not layer.trains]
        steps.append(
            TraceStep(
                "kernels",
                "training (model.train() kernelizes again with kernels' Mode.TRAINING): with a training kernel: "
                f"{', '.join(trains) or 'none'}; mapped for inference only, so their own forward trains: "
                f"{', '.join(inference_only) or 'none'}; whether a training kernel has a backward is known once it "
                "is downloaded (kernels then falls back to the layer's own forward)",
            )
        )
    return steps
