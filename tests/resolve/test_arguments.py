"""resolve_device()'s switches are checked before anything is probed: undocumented values are refused."""

from __future__ import annotations

from typing import Any

import pytest

import whichdevice as wd
from whichdevice.core.errors import ConfigConflictError
from whichdevice.testing import simulate


@pytest.mark.parametrize("value", [None, "yes", 1, "AUTO", ["auto"]], ids=["none", "yes", "one", "upper", "list"])
def test_use_kernels_takes_only_its_documented_values(value: Any) -> None:
    with simulate("cuda:1"), pytest.raises(ConfigConflictError) as info:
        wd.resolve_device(use_kernels=value)
    assert "use 'auto', True or False" in str(info.value) and "the default, leaves Hub kernels off" in str(info.value)


@pytest.mark.parametrize("value", [False, "auto"])
def test_the_documented_values_of_use_kernels_resolve(value: Any) -> None:
    with simulate("cuda:1"):
        assert wd.resolve_device(use_kernels=value).device == "cuda:0"
