"""The Resolution fields Resolution.tuning replaced: still read, with a DeprecationWarning naming the replacement."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.measure.packing_plan import PackingPlan
from whichdevice.resolve.deprecated_names import DEPRECATED_NAMES, REMOVED_IN
from whichdevice.testing import simulate
from whichdevice.tuning.record import Tuning

# A plan for 4 rows whose tokens were not told (so the packing waits for generate), budget from its figures.
PLAN = PackingPlan("bfloat16", 4, 0.02, 0.01, 0.5, 0.001, 0.0008, 64, 128, False)
TUNED = Tuning(single_row=True, packing=PLAN, static_cache=True)


def _resolution(tuning: Tuning | None) -> wd.Resolution:
    with simulate("cpu"):
        res = wd.resolve_device()
    return dataclasses.replace(res, tuning=tuning)


@pytest.mark.parametrize("name", sorted(DEPRECATED_NAMES))
def test_each_removed_name_returns_what_tuning_holds_and_warns_with_its_replacement(name: str) -> None:
    res = _resolution(TUNED)
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(res, name)
    assert value == getattr(TUNED, name)
    message = str(caught[0].message)
    assert f"Resolution.{name}" in message and f"res.tuning.{name}" in message and REMOVED_IN in message
    # The warning points at the line that read the name, not inside whichdevice.
    assert caught[0].filename == __file__


def test_the_removed_names_read_as_before_where_nothing_is_tuned() -> None:
    res = _resolution(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        values = {name: getattr(res, name) for name in DEPRECATED_NAMES}
    # The fields' defaults before Resolution.tuning (git show 6f8d9a9^:src/whichdevice/resolve/resolution.py).
    assert values == {
        "single_row": False,
        "packed_for_batch": None,
        "packing_budget_s": None,
        "packing": None,
        "static_cache": False,
        "packing_at_generate": False,
    }


def test_the_removed_names_are_read_only_and_stay_out_of_the_report() -> None:
    res = _resolution(TUNED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.static_cache = False  # type: ignore[misc]
    with warnings.catch_warnings():
        # Building the report reads none of them: a warning here would reach every --json run.
        warnings.simplefilter("error", DeprecationWarning)
        report = res.to_dict()
        json.dumps(report)
    assert "packing" not in report and "static_cache" not in report
    assert report["tuning"]["static_cache"] is True


def test_the_policy_and_the_changelog_name_every_deprecated_name() -> None:
    root = Path(__file__).resolve().parents[2]
    api = (root / "docs" / "api.md").read_text(encoding="utf-8")
    policy = api.split("## Deprecation policy", 1)[1].split("\n## ", 1)[0]
    unreleased = (root / "CHANGELOG.md").read_text(encoding="utf-8").split("## [Unreleased]", 1)[1].split("\n## [")[0]
    deprecated = unreleased.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
    assert "### Removed" in unreleased and "one minor version" in policy and "DeprecationWarning" in policy
    for name, replacement in DEPRECATED_NAMES.items():
        assert f"| `res.{name}` | `{replacement}` |" in policy, name
        assert f"`{name}`" in deprecated or f"`Resolution.{name}`" in deprecated, name
    assert REMOVED_IN in policy and REMOVED_IN in deprecated
