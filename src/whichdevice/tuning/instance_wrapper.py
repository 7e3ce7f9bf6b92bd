"""Taking back an instance-level wrapper whichdevice set on a model (its forward or its generate)."""

from __future__ import annotations

from typing import Any

__all__ = ["take_back"]


def take_back(model: Any, attribute: str, installed: str, wrapper: type) -> bool:
    """Take ``wrapper`` off ``model.<attribute>`` and drop the ``installed`` mark: off, where it is on top
    (the inner callable it wrapped goes back, or the class's own where it wrapped none); where another's
    wrapper sits over it, ours stays below and passes calls through. Whether ours was installed."""
    marked = vars(model).pop(installed, None)
    current = vars(model).get(attribute)
    if not isinstance(current, wrapper):
        return marked is not None
    inner = getattr(current, "inner", None)
    if inner is not None:
        setattr(model, attribute, inner)
    else:
        delattr(model, attribute)
    return True
