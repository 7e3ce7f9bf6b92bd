"""whichdevice's CPU decode attention on a loaded model: installed by ``prepare()`` under its sdpa, and taken back.

The keywords a resolution hands over name ``"sdpa"``, which transformers knows in any process: a
scheduler or a serving process loads them without importing whichdevice. ``prepare()`` then points the
model's config at ``ATTENTION_NAME`` (whichdevice.attention.decode), registered with transformers here,
and ``unprepare()`` points it back at ``"sdpa"``. transformers looks the function up by that name at
every forward, so nothing else on the model changes, and ``save_pretrained`` writes no attention
(transformers does not serialize ``_attn_implementation_internal``).

The name prepare() writes is a ``str`` whose pickle is a call that registers it (``_registered``), so
the decode path travels with the model: pickled, ``torch.save``d and ``torch.load``ed, or sent to a
spawned worker (torch.multiprocessing, a DataLoader or Ray worker), the copy runs what the original
runs, registered where it lands by its own unpickling, as the single-row wrapper travels with it
(whichdevice must be importable there, as for that wrapper). The alternative, dropping the decode path
when pickling so that the copy runs plain sdpa, would make a copy run other code than the model it
copies, and still leave the single-row wrapper needing whichdevice; a model that must travel without
whichdevice is ``unprepare``d first, as the keywords themselves never need it.
"""

from __future__ import annotations

from typing import Any

from whichdevice.attention.decode_forward import ATTENTION_NAME, ensure_registered

__all__ = ["install_decode_attention", "installed_configs", "remove_decode_attention"]


class _Installed(str):
    """``ATTENTION_NAME`` as prepare() writes it into a config: the mark unprepare() looks for, and a
    pickle that registers the name with transformers wherever it is loaded."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_registered, ())

    def __copy__(self) -> _Installed:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Installed:
        return self


def _registered() -> _Installed:
    """The installed name, registered with this process's transformers first (called by unpickling)."""
    ensure_registered()
    return _Installed(ATTENTION_NAME)


def _configs(model: Any) -> list[Any]:
    """The configs of ``model`` and of every module in it that holds one (a composite model's parts), each once."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            found.setdefault(id(config), config)
    return list(found.values())


def installed_configs(model: Any) -> list[Any]:
    """The configs of ``model`` that run the decode attention prepare() installed."""
    return [c for c in _configs(model) if isinstance(c._attn_implementation_internal, _Installed)]


def install_decode_attention(model: Any) -> int:
    """Run the decode attention where ``model`` runs sdpa; the number of configs switched. A config that
    runs anything else (eager, FlashAttention, a name the user passed) is left as loaded."""
    configs = [c for c in _configs(model) if type(c._attn_implementation_internal) is str]
    configs = [c for c in configs if c._attn_implementation_internal == "sdpa"]
    if configs:
        ensure_registered()
    for config in configs:
        config._attn_implementation_internal = _Installed(ATTENTION_NAME)
    return len(configs)


def remove_decode_attention(model: Any) -> int:
    """Point every config prepare() switched back at sdpa; the number of configs switched back."""
    configs = installed_configs(model)
    for config in configs:
        config._attn_implementation_internal = "sdpa"
    return len(configs)
