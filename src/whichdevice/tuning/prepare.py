"""``prepare()`` and ``unprepare()``: a ``Tuning`` installed on the objects users pass, and taken back.

Accepted: a transformers model (``PreTrainedModel``), a PEFT model (its base model is tuned: peft
calls its forward and generate) and a transformers pipeline (its model). Anything else is a
``DeviceError`` naming these, whether or not there is anything to install, so a wrong object is
never silently left as it was. docs/tuning.md says what each setting changes and what is guaranteed.
"""

from __future__ import annotations

import logging
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DeviceError, printable
from whichdevice.tuning.at_generate import INSTALLED as _GENERATE
from whichdevice.tuning.at_generate import remove_generate_hook
from whichdevice.tuning.decode_attention import installed_configs, remove_decode_attention
from whichdevice.tuning.single_row import INSTALLED as _SINGLE_ROW
from whichdevice.tuning.single_row import remove_single_row

if TYPE_CHECKING:
    from whichdevice.tuning.record import Tuning

__all__ = ["model_of", "prepare", "unprepare"]

ACCEPTED = (
    "a transformers model (PreTrainedModel, as from_pretrained returns), a PEFT model (PeftModel) "
    "or a transformers pipeline"
)


def _class(module: str, name: str) -> Any:
    # Only classes already imported: an object of theirs exists only where the module is loaded.
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def model_of(obj: Any) -> Any:
    """The transformers model that ``obj`` (a model, a PEFT model or a pipeline) runs."""
    pipeline = _class("transformers.pipelines.base", "Pipeline")
    inner = obj.model if pipeline is not None and isinstance(obj, pipeline) else obj
    peft_model = _class("peft.peft_model", "PeftModel")
    if peft_model is not None and isinstance(inner, peft_model):
        inner = inner.get_base_model()
    pretrained = _class("transformers.modeling_utils", "PreTrainedModel")
    if pretrained is not None and isinstance(inner, pretrained):
        return inner
    got = type(inner).__module__ + "." + type(inner).__qualname__
    hint = "; pass the transformers model inside it" if hasattr(inner, "modules") else ""
    raise DeviceError(f"prepare() takes {ACCEPTED}; got {printable(got)}{hint}")


def prepare(tuning: Tuning | None, obj: Any) -> Any:
    """Install ``tuning`` on the model ``obj`` runs and return ``obj``; nothing where ``tuning`` is None."""
    model = model_of(obj)
    if tuning is None:
        return obj
    log = logging.getLogger("whichdevice")
    if tuning.decode_attention:
        from whichdevice.tuning.decode_attention import install_decode_attention

        if not install_decode_attention(model) and not installed_configs(model):
            log.info("prepare: the decode attention is not installed: the model does not run sdpa")
    if tuning.single_row:
        from whichdevice.tuning.single_row import install_single_row

        install_single_row(model)
    if tuning.upcast_above is not None:
        from whichdevice.tuning.upcast import install_upcast

        log.info("prepare: %s", install_upcast(model, tuning.upcast_above)[1])
    plan = tuning.packing
    if plan is not None and plan.told:
        from whichdevice.tuning.packed_weights import install_packed_weights

        _, done = install_packed_weights(model, plan.dtype, plan.batch, plan.budget_for_job)
        log.info("prepare: %s", done)
    at_generate = plan if tuning.packing_at_generate else None
    if at_generate is not None or tuning.static_cache:
        from whichdevice.tuning.at_generate import install_generate_hook

        if install_generate_hook(model, at_generate, tuning.static_cache) and at_generate is not None:
            log.info("prepare: generate packs at the first call its tokens repay")
    return obj


def unprepare(obj: Any) -> Any:
    """Take back everything ``prepare`` installed on the model ``obj`` runs (any resolution's), and
    return ``obj``: its forward and generate are the class's again (or what was there before), no
    layer keeps a packed copy or an fp32 buffer, every weight is a plain Parameter. A packing in progress in another
    thread (a generate deciding, a prepare) is stopped at its next layer and waited for."""
    model = model_of(obj)
    with _packing_stopped(model):
        if any(name in vars(model) for name in ("forward", "generate", _SINGLE_ROW, _GENERATE)):
            # Wherever they sit: on top, or under another's wrapper (accelerate's, a user's), where they
            # then pass every call through.
            remove_single_row(model)
            remove_generate_hook(model)
        if "torch" in sys.modules:
            from whichdevice.tuning.packed_weights import unpack
            from whichdevice.tuning.upcast import remove_upcast

            remove_upcast(model)
            unpack(model)
    remove_decode_attention(model)
    return obj


def _packing_stopped(model: Any) -> AbstractContextManager[Any]:
    # Only where torch is loaded can anything be packing (packed_weights imports it).
    if "torch" not in sys.modules:
        return nullcontext()
    from whichdevice.tuning.packed_weights import stopping

    return stopping(model)
