"""Resolution names removed in a release, kept one minor version as read-only properties that warn.

The deprecation policy (docs/api.md#deprecation-policy): a public name that is removed keeps working for
one minor version, returning what it returned before, with a ``DeprecationWarning`` that names its
replacement; the CHANGELOG lists it under "Deprecated", and under "Removed" in the release that drops it.
These names are not part of ``to_dict()`` or the report's schema (its flat 1.x fields are their own).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from whichdevice.measure.packing_plan import PackingPlan
    from whichdevice.tuning.record import Tuning

__all__ = ["DEPRECATED_NAMES", "DeprecatedNames"]

# name -> what replaces it: each entry is read by the properties below and by
# the test that checks every one warns and returns what the replacement holds.
DEPRECATED_NAMES: dict[str, str] = {
    "single_row": "res.tuning.single_row",
    "packed_for_batch": "res.tuning.packed_for_batch",
    "packing_budget_s": "res.tuning.packing_budget_s",
    "packing": "res.tuning.packing",
    "static_cache": "res.tuning.static_cache",
    "packing_at_generate": "res.tuning.packing_at_generate",
}
# Deprecated in 0.2.0 (the release that brought Resolution.tuning), removed in 0.3.0.
REMOVED_IN = "0.3.0"


def _warn(name: str) -> None:
    # stacklevel 3: the user's line that read the property, not this helper or the property itself.
    warnings.warn(
        f"Resolution.{name} is deprecated and will be removed in whichdevice {REMOVED_IN}: read "
        f"{DEPRECATED_NAMES[name]} instead (res.tuning is None where nothing is tuned)",
        DeprecationWarning,
        stacklevel=3,
    )


class DeprecatedNames:
    """The fields ``Resolution.tuning`` replaced, read from it as they read before (None: nothing tuned)."""

    tuning: Tuning | None

    @property
    def single_row(self) -> bool:
        _warn("single_row")
        return self.tuning is not None and self.tuning.single_row

    @property
    def packed_for_batch(self) -> int | None:
        _warn("packed_for_batch")
        return self.tuning.packed_for_batch if self.tuning is not None else None

    @property
    def packing_budget_s(self) -> float | None:
        _warn("packing_budget_s")
        return self.tuning.packing_budget_s if self.tuning is not None else None

    @property
    def packing(self) -> PackingPlan | None:
        _warn("packing")
        return self.tuning.packing if self.tuning is not None else None

    @property
    def static_cache(self) -> bool:
        _warn("static_cache")
        return self.tuning is not None and self.tuning.static_cache

    @property
    def packing_at_generate(self) -> bool:
        _warn("packing_at_generate")
        return self.tuning is not None and self.tuning.packing_at_generate
