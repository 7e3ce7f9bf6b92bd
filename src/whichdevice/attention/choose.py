"""Which attention implementation to ask transformers for, read from installed metadata only."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from whichdevice.attention.flash import FLASH, flash_attention_package, flash_fits
from whichdevice.attention.record import Attention
from whichdevice.core.errors import ConfigConflictError, DeviceError
from whichdevice.core.packages import pip_install

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, TraceStep
    from whichdevice.device.target import Target
    from whichdevice.measure.calibration import Calibration
    from whichdevice.model.facts import ModelFacts
    from whichdevice.model.support import AttentionSupport

__all__ = [
    "AUTO_HUB",
    "KNOWN_IMPLEMENTATIONS",
    "choose_attention",
    "flash_attention_package",
    "is_hub_kernel",
]

# Opt-in: like "auto", but when no FlashAttention package is usable, the Hub kernel transformers
# swaps in for it (kernels-community/flash-attn2, ...) where one exists and can be had.
AUTO_HUB = "auto-hub"

KNOWN_IMPLEMENTATIONS = (
    "sdpa",
    "whichdevice_sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)


def is_hub_kernel(value: str) -> bool:
    """Whether ``value`` names a Hub kernel ("org/repo", "org/repo@rev", "org/repo:name"), as
    transformers' ``is_kernel`` accepts for attn_implementation."""
    return re.fullmatch(r"[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?", value) is not None


# benchmarks/decode_accuracy.py's multi-head figures (whichdevice_sdpa against sdpa, dynamic cache).
_MULTI_HEAD_DISTANCE = {"bfloat16": "0.01037 against 0.00897", "float16": "0.00134 against 0.00122"}


def choose_attention(
    target: Target,
    dtype: str | None,
    requested: str = "auto",
    *,
    task: str = "inference",
    model: ModelFacts | None = None,
    measured: Calibration | None = None,
    serving: bool = False,
) -> tuple[Attention, list[TraceStep]]:
    """Pass an implementation only when it beats what transformers picks by itself (FlashAttention,
    a Hub FlashAttention kernel, the CPU decode attention) and every class ``model=`` loads as supports
    it; an explicit request is passed as asked, and refused when the model's classes refuse it.
    ``measured``: the CPU's calibration, which decides the CPU decode attention where it was timed.
    ``serving``: the job serves requests through generate_batch, which refuses some attentions
    (attention/serving.py): none of those is chosen, and asking for one is refused.
    Returns the choice and the trace line that says why."""
    # Read from the model's config, once per call (the classes' flags are cached per config's names);
    # model/support.py is imported only then: without model= no class is read.
    support = None
    if model is not None:
        from whichdevice.model.support import support_of_config

        support = support_of_config(model.config)
    if requested not in ("auto", AUTO_HUB):
        name, why = _as_requested(target, dtype, requested)
        if serving:
            _refuse_for_serving(name)
        line = why if why.startswith(name) else f"{name}: {why}"
        return _handed_over(Attention(name, True), line + _request_checked(name, support))
    wanted, why = _wanted(target, dtype, requested, task, model, measured)
    if serving and wanted is not None:
        wanted, why = _kept_for_serving(wanted, why)
    chosen, passed, line = _settle(wanted, why, support)
    return _handed_over(Attention(chosen, passed), line)


def _handed_over(choice: Attention, line: str) -> tuple[Attention, list[TraceStep]]:
    """The choice as the keywords hand it over. whichdevice's decode attention is a name only a process
    that imported whichdevice knows: the keywords name sdpa, which it runs under, and ``prepare()``
    installs it on the loaded model (tuning/decode_attention.py)."""
    from whichdevice.attention.decode import ATTENTION_NAME
    from whichdevice.core.records import TraceStep

    if choice.name != ATTENTION_NAME:
        return choice, [TraceStep("attention", line)]
    said = line.removeprefix(f"{ATTENTION_NAME}: ")
    return Attention("sdpa", True, decode=True), [
        TraceStep(
            "attention",
            f"sdpa handed over (a name transformers knows in any process), and res.prepare(model) runs "
            f"{ATTENTION_NAME} on the loaded model in its place, res.unprepare(model) puts sdpa back: {said}",
        )
    ]


def _wanted(
    target: Target,
    dtype: str | None,
    requested: str,
    task: str,
    model: ModelFacts | None,
    measured: Calibration | None = None,
) -> tuple[str | None, str]:
    """The implementation whichdevice would pass on this hardware (None: transformers' own choice is best), and why."""
    for impl in ("flash_attention_3", "flash_attention_2"):
        if FLASH[impl][0] in target.backend.flash_attention_native and flash_fits(impl, target, dtype)[0]:
            # torch_npu's own kernels (transformers' integrations/npu_flash_attention.py): no package needed.
            return impl, f"served by {target.backend.module}'s own FlashAttention, no flash-attn package needed"
        version = flash_attention_package(impl)
        if version is None or not target.backend.flash_attn_builds:
            continue
        ok, why = flash_fits(impl, target, dtype)
        if ok:
            return impl, f"{FLASH[impl][1]} {version} is installed and fits this {target.name} and dtype"
    installed = [impl for impl in FLASH if flash_attention_package(impl)]
    packages = ", ".join(dict.fromkeys(FLASH[impl][1] for impl in installed))
    if not installed:
        have = "no FlashAttention package is installed"
    elif not target.backend.flash_attn_builds:
        # Installed, but the package builds for CUDA and ROCm only (the registry row says why): say so,
        # rather than claim nothing is installed or call it "unusable" as if a setting could fix it.
        have = f"{packages} is installed but has no build for {target.backend.hardware}"
    else:
        have = f"{', '.join(installed)} installed but unusable here"
    if requested == AUTO_HUB:
        from whichdevice.attention.kernels import hub_flash_attention

        repo, why = hub_flash_attention(target, dtype)
        if repo is not None:
            return repo, (
                f"{have}, so the Hub kernel transformers uses in its place "
                f"(attn_implementation='{AUTO_HUB}' opts in): {why}"
            )
        return _without_flash(
            target.backend,
            dtype,
            task,
            model,
            f"{have}, and attn_implementation='{AUTO_HUB}' found no Hub kernel: {why}",
            measured,
        )
    return _without_flash(target.backend, dtype, task, model, have, measured)


def _settle(wanted: str | None, why: str, support: AttentionSupport | None) -> tuple[str | None, bool, str]:
    """Pass ``wanted`` where the model's classes are read and support it; else leave it to transformers."""
    if support is None:
        if wanted is not None:
            why = f"{wanted} would fit ({why}), but without model= its support cannot be checked; pass model= to get it"
        return (None, False, f"left to transformers (sdpa where the model supports it, else eager): {why}")
    if support.unknown is not None:
        skipped = f"{wanted} not passed, " if wanted is not None else ""
        return (
            None,
            False,
            f"left to transformers: {skipped}the model's attention support is unknown ({support.unknown}); {why}",
        )
    refusal = support.refusal(wanted) if wanted is not None else None
    if wanted is not None and refusal is None:
        return (wanted, True, f"{wanted}: {why}; supported by {support.checked()}")
    if refusal is not None:
        why = f"{wanted} not passed: {refusal}; {why}"
    # Imported here, past the return without model=: a plain resolve_device() reads no model class.
    from whichdevice.model.support import transformers_default

    default = transformers_default(support)
    if default is None:
        return (None, False, f"left to transformers, which picks per model part ({_defaults(support)}): {why}")
    return (default, False, f"{default}, transformers' own choice (not passed): {_defaults(support)}; {why}")


def _serving_refusal(name: str) -> str | None:
    from whichdevice.attention.serving import continuous_batching_available, generate_batch_refusal

    return generate_batch_refusal(name) if continuous_batching_available()[0] else None


def _refuse_for_serving(name: str) -> None:
    refusal = _serving_refusal(name)
    if refusal is not None:
        raise ConfigConflictError(
            f"attn_implementation={name!r} with serving=True: model.generate_batch refuses it ({refusal}); leave "
            "attn_implementation='auto', pass 'sdpa', or serve with generate() (serving=False)"
        )


def _kept_for_serving(wanted: str, why: str) -> tuple[str | None, str]:
    refusal = _serving_refusal(wanted)
    if refusal is None:
        return wanted, why
    return None, f"{why}; {wanted} not passed for serving=True: model.generate_batch refuses it ({refusal})"


def _defaults(support: AttentionSupport) -> str:
    eager = support.refusal("sdpa")
    if eager is None:
        return f"{support.checked()} support sdpa"
    return f"{eager}, so transformers runs eager there (passing 'sdpa' would fail)"


def _request_checked(name: str, support: AttentionSupport | None) -> str:
    """Nothing to add, or the model's classes' support for an explicit request; raises when they refuse it."""
    if support is None:
        return ""
    if support.unknown is not None:
        return f"; not checked against the model: {support.unknown}"
    refusal = support.refusal(name)
    if refusal is not None:
        from whichdevice.model.support import transformers_default

        default = transformers_default(support) or "sdpa or eager per model part"
        raise ConfigConflictError(
            f"attn_implementation={name!r}: {refusal}, so from_pretrained would refuse it; leave "
            f"attn_implementation='auto' (transformers then picks {default} itself) or pass 'eager'"
        )
    return f"; supported by {support.checked()}"


def _as_requested(target: Target, dtype: str | None, requested: Any) -> tuple[str, str]:
    """An explicit attn_implementation: kept as asked, checked, and said what it will do."""
    if isinstance(requested, str) and is_hub_kernel(requested):
        from whichdevice.attention.kernels import hub_access, kernels_compatibility

        kernel = requested.split("@")[0].split(":")[0]
        problems = [why for ok, why in (kernels_compatibility(), hub_access(kernel)) if not ok]
        return requested, f"{requested}: a Hub kernel, as you asked" + (
            f"; transformers will not load it: {'; '.join(problems)}" if problems else ""
        )
    if not isinstance(requested, str) or requested not in KNOWN_IMPLEMENTATIONS:
        raise DeviceError(
            f"attn_implementation={requested!r} is not known; use 'auto', '{AUTO_HUB}' (also a Hub "
            f"FlashAttention kernel), a Hub kernel ('org/repo') or one of {', '.join(KNOWN_IMPLEMENTATIONS)}"
        )
    if requested not in FLASH:
        return requested, "as you asked"
    ok, why = flash_fits(requested, target, dtype)
    if not ok:
        raise ConfigConflictError(f"attn_implementation={requested!r}: {why}")
    if FLASH[requested][0] in target.backend.flash_attention_native:
        return requested, f"{requested} as you asked: served by {target.backend.module}'s own FlashAttention"
    if flash_attention_package(requested) is not None:
        return requested, "as you asked"
    from whichdevice.attention.kernels import hub_flash_attention

    package = FLASH[requested][1]
    repo, why = hub_flash_attention(target, dtype, requested)
    if repo is not None:
        return requested, (
            f"{requested} as you asked; {package} is not installed, so transformers loads the Hub kernel {why}"
        )
    return requested, (
        f"{requested} as you asked, but {package} is not installed and transformers cannot "
        f"use a Hub kernel instead ({why}), so loading the model will fail: {pip_install(package)}"
    )


def _without_flash(
    backend: Backend,
    dtype: str | None,
    task: str,
    model: ModelFacts | None,
    no_flash: str,
    measured: Calibration | None = None,
) -> tuple[str | None, str]:
    """None (transformers' own choice), or on the CPU in bf16/fp16 for inference the decode attention
    (see decode_attention); and why, after ``no_flash``."""
    from whichdevice.attention.decode import ATTENTION_NAME, VERIFIED_MODEL_TYPES

    # The decode attention is a fix for torch's fused CPU kernel: a fact about the CPU, not a capability.
    if backend.name != "cpu" or task != "inference" or dtype not in ("bfloat16", "float16"):
        return None, no_flash
    # Read only here: everywhere else the architecture does not change the answer.
    model_type = model.model_type if model is not None else None
    # benchmarks/attention.py (AMD EPYC, torch 2.13): 6-16x, 160 to 4,096 cached tokens, batch 1 and 4.
    # Not this CPU's figure: said as the benchmark's, until this CPU's calibration replaces it below.
    faster = (
        f"torch's fused CPU kernel called one query row per head took 6-16x as long for a {dtype} step in "
        "benchmarks/attention.py on an AMD EPYC (not measured on this CPU)"
    )
    if measured is not None:
        from whichdevice.precision.measured import measured_attention

        wins, text = measured_attention(measured, dtype)
        if wins is False:
            return None, f"{no_flash}; {ATTENTION_NAME} not passed: {text}"
        if wins:
            faster = text
    if model is None:
        return None, f"{no_flash}; pass model= to get {ATTENTION_NAME} ({faster}) for a verified architecture"
    if model_type is None:
        return (
            None,
            f"{no_flash}; {ATTENTION_NAME} needs the model's architecture, and model= has no readable model_type",
        )
    if model_type not in VERIFIED_MODEL_TYPES:
        return None, f"{no_flash}; {ATTENTION_NAME} is not verified for model_type {model_type!r}"
    # Passed only where its logits are no further from eager fp32 than sdpa's (issue 25;
    # benchmarks/decode_accuracy.py, largest logit difference over 3 prompts x 12 steps, dynamic/static
    # cache). A grouped-query model's steps run sdpa's own fused kernel with the heads grouped: equal
    # (bf16 0.00889/0.00870, fp16 0.00127/0.00118). A multi-head model's run eager's plain matmuls, with
    # bf16 scores: further (bf16 0.01037 against 0.00897/0.00905, fp16 0.00134 against 0.00122/0.00128),
    # and greedy decoding with padding left eager's tokens where sdpa kept them.
    shape = model.shape
    if shape is None:
        return None, f"{no_flash}; {ATTENTION_NAME} needs the model's heads, and model='s config does not give them"
    if shape.kv_heads >= shape.heads:
        far = _MULTI_HEAD_DISTANCE[dtype]
        return None, (
            f"{no_flash}; {ATTENTION_NAME} not passed for a multi-head model: its plain matmuls' logits are "
            f"further from eager fp32 than sdpa's ({far}); attn_implementation={ATTENTION_NAME!r} takes it "
            "for its speed on long prompts"
        )
    return ATTENTION_NAME, (
        f"sdpa for prompts, and for one-token decode steps the same fused kernel with the query heads grouped"
        f" by key/value head, since {faster}; verified for model_type {model_type!r}; {no_flash}"
    )
