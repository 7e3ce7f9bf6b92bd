"""``model.generate`` with what was measured for generation: packing decided by each call's tokens, the static cache.

Packing the linear weights (``tuning.packed_weights``) costs seconds once and saves a fraction of
every decode step, so whether it pays depends on how many tokens the job generates. Where
``max_new_tokens=`` was told, ``prepare`` packs at once. Where it was not, a guess (half of
``max_length``) decided wrongly both ways (docs/backends/cpu.md), so ``prepare`` packs nothing yet
and wraps ``model.generate``: each call reads its own prompt and new tokens (as transformers merges
them), and the first call they repay packs, within that call's budget. Pipelines and PEFT models
call the transformers model's ``generate`` and meet the same wrapper; a decode loop of its own
calling ``forward`` runs unpacked. The wrapper also passes ``cache_implementation="static"`` where the
resolution chose it, to calls that set no cache of their own: unlike a value written into the
model's ``generation_config``, it is not saved with the model. As with the single-row forward
(``tuning.single_row``), the model names the wrapper installed now (``INSTALLED``), and a wrapper it
does not name passes calls through: one that another's ``generate`` wrapper sits over is taken back so.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from whichdevice.tuning.instance_wrapper import take_back
from whichdevice.tuning.single_row import input_shape

if TYPE_CHECKING:
    from whichdevice.measure.packing_plan import PackingPlan

__all__ = ["DEFAULT_NEW_TOKENS", "INSTALLED", "call_tokens", "install_generate_hook", "remove_generate_hook"]

# The model's attribute naming the generate wrapper installed now.
INSTALLED = "_whichdevice_generate"

# The new tokens generate makes where no length is set anywhere (transformers 5 reads its default
# max_length of 20 as new tokens; 4.x sets max_length=20 in GenerationConfig, which is read below).
DEFAULT_NEW_TOKENS = 20
# One decision at a time: two threads calling generate on one model pack it once, and an unprepare
# that takes the wrapper back waits for a decision under way (which its stop request cuts short), so
# no generate packs after it. Reentrant: a decision takes the wrapper back itself.
_deciding = threading.RLock()


def _renew_lock_in_child() -> None:
    global _deciding  # the process's lock, renewed where a fork may have left it held
    _deciding = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock_in_child)


def _merged(name: str, kwargs: dict[str, Any], configs: tuple[Any, ...]) -> Any:
    """``name`` as generate merges it: the call's keyword, then its generation_config's, then the model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    return next((v for c in configs if (v := getattr(c, name, None)) is not None), None)


def call_tokens(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, int] | None:
    """(rows, prompt tokens, new tokens) a ``generate`` call computes, as transformers reads them:
    ``max_new_tokens`` before ``max_length`` (less the prompt), each the call's before its
    ``generation_config``'s before the model's; rows are sequences times beams. None: not readable."""
    shape = input_shape(args, kwargs)
    if shape is None:
        return None
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    batch, prompt = shape
    new = _merged("max_new_tokens", kwargs, configs)
    if new is None:
        length = _merged("max_length", kwargs, configs)
        new = DEFAULT_NEW_TOKENS if length is None else length - prompt if isinstance(length, int) else None
    beams = _merged("num_beams", kwargs, configs)
    rows = batch * (beams if isinstance(beams, int) and beams > 0 else 1)
    if not isinstance(new, int) or new < 1:
        return None
    return rows, prompt, new


def _sets_a_cache(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the call or the model's generation config already says which cache generate uses."""
    if kwargs.get("past_key_values") is not None or kwargs.get("cache_implementation") is not None:
        return True
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    return any(getattr(c, "cache_implementation", None) is not None for c in configs)


class _TunedGenerate:
    """``model.generate`` that packs at the first call whose tokens repay it (``plan``) and passes the
    static cache (``static_cache``). ``inner``: an instance-level generate that was there first.

    A callable object bound to its model, not a closure: a deepcopy or pickle of the model carries it
    bound to the copy."""

    __slots__ = ("inner", "model", "plan", "static_cache")

    def __init__(self, model: Any, plan: PackingPlan | None, static_cache: bool, inner: Any = None) -> None:
        self.model, self.plan, self.static_cache, self.inner = model, plan, static_cache, inner

    def __reduce__(self) -> tuple[Any, ...]:
        return (_TunedGenerate, (self.model, self.plan, self.static_cache, self.inner))

    @property
    def __wrapped__(self) -> Any:
        return self._generate()

    def _generate(self) -> Any:
        return self.inner if self.inner is not None else type(self.model).generate.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if vars(self.model).get(INSTALLED) is not self:  # taken back from under another's wrapper
            return self._generate()(*args, **kwargs)
        if self.plan is not None:
            self._pack_if_it_pays(args, kwargs)
        if self.static_cache and not _sets_a_cache(self.model, kwargs):
            kwargs["cache_implementation"] = "static"
        return self._generate()(*args, **kwargs)

    def _pack_if_it_pays(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        plan = self.plan
        shape = call_tokens(self.model, args, kwargs)
        budget = None if plan is None or shape is None or shape[0] < 2 else plan.budget_s(shape[1], shape[2])
        if budget is None or shape is None or plan is None:
            return
        from whichdevice.tuning.packed_weights import install_packed_weights

        with _deciding:
            # Another thread decided while this one waited, or unprepare took the wrapper back.
            if self.plan is None or vars(self.model).get(INSTALLED) is not self:
                return
            _, done = install_packed_weights(self.model, plan.dtype, plan.batch, budget)
            # Packed, or stopped as slower than the estimate (in part): either way decided.
            self.plan = None
            if not self.static_cache:
                remove_generate_hook(self.model)
        logging.getLogger("whichdevice").info(
            "generate (%d rows, %d + %d tokens a sequence): %s", shape[0], shape[1], shape[2], done
        )


def install_generate_hook(model: Any, plan: PackingPlan | None, static_cache: bool) -> bool:
    """Wrap ``model.generate`` to pack by ``plan`` at the first call its tokens repay, and to pass the
    static cache where ``static_cache``. False: nothing to wrap (no plan and no static cache, or no
    ``generate``). A wrapper of ours installed already gets the latest resolution's settings, wherever
    it sits."""
    if (plan is None and not static_cache) or not callable(getattr(type(model), "generate", None)):
        return False
    installed = vars(model).get(INSTALLED)
    if isinstance(installed, _TunedGenerate):
        with _deciding:
            installed.plan, installed.static_cache = plan, static_cache
        return True
    current = vars(model).get("generate")
    inner = current.inner if isinstance(current, _TunedGenerate) else current
    wrapper = _TunedGenerate(model, plan, static_cache, inner)
    model.generate = wrapper
    vars(model)[INSTALLED] = wrapper
    return True


def remove_generate_hook(model: Any) -> bool:
    """Take ``install_generate_hook``'s wrapper back from ``model``: off, where it is on top (an inner
    generate it wrapped goes back); passing calls through, where another's wrapper sits over it. A
    decision under way in another thread's call is waited for."""
    with _deciding:
        return take_back(model, "generate", INSTALLED, _TunedGenerate)
