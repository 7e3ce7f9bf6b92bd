"""The packing's budget: what a packing may take and leave the whole job PACK_MARGIN faster, prompt counted."""

from __future__ import annotations

import pytest

from whichdevice.measure.packing_plan import PACK_MARGIN, PackingPlan

PLAN = PackingPlan(
    dtype="float32",
    batch=4,
    step_s=1.0,
    packed_step_s=0.5,
    pack_s=10.0,
    prompt_token_s=0.1,
    packed_prompt_token_s=0.05,
    prompt_tokens=10,
    new_tokens=64,
    told=False,
)


def _plain(prompt: int, new: int) -> float:
    return prompt * 0.1 + (new - 1) * 1.0  # the prompt's forward makes the first new token


def _packed_run(prompt: int, new: int) -> float:
    return prompt * 0.05 + (new - 1) * 0.5


def test_the_budget_follows_the_estimates_rule():
    # It is tried from the count on where the whole job, packing at the calibration's 10 s included,
    # is PACK_MARGIN faster packed; its budget is what the packing may take and leave it that much faster.
    assert PLAN.budget_s(10, 20) is None  # 20 against 19.5 + 10: no gain at all
    needed = next(n for n in range(1, 1000) if PLAN.budget_s(10, n) is not None)
    assert _plain(10, needed) >= (_packed_run(10, needed) + 10) * PACK_MARGIN
    assert _plain(10, needed - 1) < (_packed_run(10, needed - 1) + 10) * PACK_MARGIN
    assert PLAN.budget_s(10, 501) == pytest.approx(_plain(10, 501) / PACK_MARGIN - _packed_run(10, 501))
    assert PLAN.budget_for_job == pytest.approx(_plain(10, 64) / PACK_MARGIN - _packed_run(10, 64))  # its counts


def test_the_prompt_run_packed_counts_toward_the_packing():
    # A long prompt and few new tokens: the prompt's packed speed alone repays the packing.
    unpacked_prompt = PLAN._replace(packed_prompt_token_s=PLAN.prompt_token_s)
    assert unpacked_prompt.budget_s(2000, 4) is None
    assert PLAN.budget_s(2000, 4) == pytest.approx(_plain(2000, 4) / PACK_MARGIN - _packed_run(2000, 4))
