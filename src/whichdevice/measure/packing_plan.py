"""The figures a CPU model's weight packing is decided by: the estimate makes them, the tuning acts on them."""

from __future__ import annotations

from whichdevice.core.frozen import NamedTuple

__all__ = ["PACK_MARGIN", "PackingPlan"]

# Packed weights must make the whole job this much faster: the copy takes the weights' memory again,
# and the packed step's figure moved between quiet calibrations (bf16.p4 over bf16.s4 from 1.16 to
# 2.07 in six runs). The packing's own price is not in this margin: it is checked as it runs.
PACK_MARGIN = 1.1


class PackingPlan(NamedTuple):
    """The estimate's figures for packing ``dtype`` weights at ``batch`` rows, in seconds (the calibration's, scaled to
    the model): one decode step unpacked and packed, the packing itself at the calibration's rate (the
    fastest a model's packing ran here; a slower one is stopped by its own clock), one prompt token of
    every sequence unpacked and packed; ``prompt_tokens``/``new_tokens``: the counts the resolve
    counted against; ``told``: whether the caller said them (max_new_tokens=), else they are decided
    again at each generate call."""

    dtype: str
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
