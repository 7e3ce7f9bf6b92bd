"""When packing a CPU model's weights pays for a generation: the estimate's figures, and the generate() hook.

Packing the linear weights ahead (``whichdevice.precision.packed_weights``) costs seconds once and
saves a fraction of every decode step, so whether it pays depends on how many tokens the job
generates. Where ``max_new_tokens=`` was passed to ``resolve_device``, the count is known and
``Resolution.prepare(model)`` packs at once. Where it was not, the resolver could only guess (half
of ``max_length``), and the guess decided wrongly both ways: 21 tokens counted where a job made 9
(a capped CPU, batch 4: the resolved load ran 0.85x and 0.94x the best), 128 counted where a job
made thousands. So there ``prepare`` packs nothing yet and hooks ``model.generate``: each call reads
its own prompt and new tokens (its ``max_new_tokens``, else ``max_length`` less the prompt, from the
call or the model's ``generation_config``), and the first call they repay packs, with the
packing's time limit (its budget: the call still ``PACK_MARGIN`` faster) counted for that call.
Pipelines and PEFT models call the model's ``generate`` and meet the same hook; a decode loop of
its own calling ``forward`` runs unpacked (pass ``max_new_tokens=`` to resolve_device to have it packed at ``prepare``).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from whichdevice.precision.single_row import input_shape

__all__ = [
    "DEFAULT_NEW_TOKENS",
    "PACK_MARGIN",
    "PackingPlan",
    "call_tokens",
    "install_packing_at_generate",
    "remove_packing_hook",
]

# Packed weights must make the whole job this much faster: the copy takes the weights' memory again,
# and the packed step's figure moves between quiet calibrations (bf16.p4 over bf16.s4 from 1.16 to
# 2.07 in six runs). The packing's own price is not in this margin: it is checked as it runs.
PACK_MARGIN = 1.1


class PackingPlan(NamedTuple):
    """The estimate's figures for packing at ``batch`` rows, in seconds (the calibration's, scaled to
    the model): one decode step unpacked and packed, the packing itself at the calibration's rate (the
    fastest a model's packing ran here; a slower one is stopped by its own clock), one prompt token of
    every sequence unpacked and packed; ``prompt_tokens``/``new_tokens``: the counts the resolve
    counted against; ``told``: whether the caller said them (max_new_tokens=), else they are decided
    again at each generate call."""

    batch: int
    step_s: float
    packed_step_s: float
    pack_s: float
    prompt_token_s: float
    packed_prompt_token_s: float
    prompt_tokens: int
    new_tokens: int
    told: bool

    def budget_s(self, prompt_tokens: int, new_tokens: int) -> float | None:
        """The seconds the packing may take for a job of ``prompt_tokens`` + ``new_tokens`` a
        sequence and leave the whole job ``PACK_MARGIN`` faster packed; None where that is less than
        the packing takes at the calibration's rate (then it is not tried). The prompt's forward
        makes the first new token, so ``new_tokens - 1`` decode steps follow it."""
        steps = max(new_tokens - 1, 0)
        plain = prompt_tokens * self.prompt_token_s + steps * self.step_s
        packed = prompt_tokens * self.packed_prompt_token_s + steps * self.packed_step_s
        budget = plain / PACK_MARGIN - packed
        return budget if budget >= self.pack_s else None

    @property
    def budget_for_job(self) -> float:
        """The packing's budget for the counts the resolve counted against (it chose packing: it paid)."""
        return self.budget_s(self.prompt_tokens, self.new_tokens) or 0.0


# The new tokens generate makes where no length is set anywhere (transformers 5 reads its default
# max_length of 20 as new tokens; 4.x sets max_length=20 in GenerationConfig, which is read below).
DEFAULT_NEW_TOKENS = 20


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


class _PackAtGenerate:
    """``model.generate`` that first packs the weights at the first call whose tokens repay it.

    A callable object, not a closure: a deepcopy or pickle of the model carries it bound to the copy."""

    __slots__ = ("dtype", "model", "plan")

    def __init__(self, model: Any, dtype: str, plan: PackingPlan) -> None:
        self.model, self.dtype, self.plan = model, dtype, plan

    def __reduce__(self) -> tuple[Any, ...]:
        return (_PackAtGenerate, (self.model, self.dtype, self.plan))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        shape = call_tokens(model, args, kwargs)
        budget = None if shape is None or shape[0] < 2 else self.plan.budget_s(shape[1], shape[2])
        if budget is not None and shape is not None:
            from whichdevice.precision.packed_weights import install_packed_weights

            _, done = install_packed_weights(model, self.dtype, self.plan.batch, budget)
            # Packed, or stopped as slower than the estimate (in part): either way decided, and the hook goes.
            remove_packing_hook(model)
            logging.getLogger("whichdevice").info(
                "generate (%d rows, %d + %d tokens a sequence): %s", shape[0], shape[1], shape[2], done
            )
        return type(model).generate(model, *args, **kwargs)


def install_packing_at_generate(model: Any, dtype: str, plan: PackingPlan) -> bool:
    """Hook ``model.generate`` to pack its ``dtype`` weights at the first call whose prompt and new
    tokens repay the packing by ``plan``. False: the model has no ``generate``, an instance-level
    ``generate`` of someone else's (left alone), or the hook already."""
    if not callable(getattr(type(model), "generate", None)) or "generate" in vars(model):
        return False
    model.generate = _PackAtGenerate(model, dtype, plan)
    return True


def remove_packing_hook(model: Any) -> None:
    """Take ``install_packing_at_generate``'s hook off ``model`` (nothing where there is none)."""
    if isinstance(vars(model).get("generate"), _PackAtGenerate):
        del model.generate
