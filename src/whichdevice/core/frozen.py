"""``@frozen_record``: a frozen dataclass whose methods are shared, not compiled class by class.

``dataclass(frozen=True)`` writes ``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__`` and
``__delattr__`` as source and compiles each with ``exec`` when the class is made: 0.66 ms a class on
Python 3.11, 14 ms of a fresh ``import whichdevice; resolve_device()`` for its 19 records
(docs/performance.md). ``frozen_record`` lets ``dataclass`` do everything else (the fields with their
defaults and flags, ``fields()``, ``replace()``, ``asdict()``, ``__match_args__``, the checks on mutable
defaults) and gives every class the same six functions, which read the class's fields: what they
return, raise and print is what the generated ones would (tests/core/test_frozen.py compares them on
every record of the package). One difference: a plain subclass of a record cannot set attributes of
its own either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import reprlib
import sys
from collections.abc import Callable
from dataclasses import Field, FrozenInstanceError, field
from typing import Any, TypeVar, overload

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # typing_extensions comes with torch
    from typing_extensions import dataclass_transform

__all__ = ["frozen_record"]

C = TypeVar("C", bound=type)

_SPEC = "__frozen_record__"  # the class's (init, repr, compare, hash) field lists, set at decoration


class _Spec:
    __slots__ = ("compared", "hashed", "init", "repr")

    def __init__(self, fields: tuple[Field[Any], ...]) -> None:
        # (name, default, default_factory) in __init__'s order; MISSING where there is none
        self.init = tuple((f.name, f.default, f.default_factory) for f in fields if f.init)
        self.repr = tuple(f.name for f in fields if f.repr)
        self.compared = _values_of(tuple(f.name for f in fields if f.compare))
        self.hashed = _values_of(tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)))


def _values_of(names: tuple[str, ...]) -> Callable[[object], tuple[Any, ...]]:
    """The tuple of those fields' values (attrgetter reads them in C: eq and hash cost what dataclass's do)."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    return (lambda record: (getattr(record, names[0]),)) if names else (lambda record: ())


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    spec: tuple[tuple[str, Any, Any], ...] = getattr(type(self), _SPEC).init
    name = type(self).__qualname__
    if len(args) > len(spec):
        raise TypeError(f"{name}.__init__() takes {len(spec) + 1} positional arguments but {len(args) + 1} were given")
    setter = object.__setattr__
    for (field_name, _, _), value in zip(spec, args, strict=False):
        if field_name in kwargs:
            raise TypeError(f"{name}.__init__() got multiple values for argument {field_name!r}")
        setter(self, field_name, value)
    missing = []
    for field_name, default, factory in spec[len(args) :]:
        if field_name in kwargs:
            setter(self, field_name, kwargs.pop(field_name))
        elif default is not dataclasses.MISSING:
            setter(self, field_name, default)
        elif factory is not dataclasses.MISSING:
            setter(self, field_name, factory())
        else:
            missing.append(field_name)
    if kwargs:
        raise TypeError(f"{name}.__init__() got an unexpected keyword argument {next(iter(kwargs))!r}")
    if missing:
        raise TypeError(
            f"{name}.__init__() missing {len(missing)} required argument(s): {', '.join(map(repr, missing))}"
        )


@reprlib.recursive_repr()
def _repr(self: Any) -> str:
    names = getattr(type(self), _SPEC).repr
    return f"{type(self).__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"


def _eq(self: object, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented  # type: ignore[no-any-return]  # typeshed types NotImplemented as Any
    values = getattr(type(self), _SPEC).compared
    return values(self) == values(other)  # type: ignore[no-any-return]


def _hash(self: object) -> int:
    return hash(getattr(type(self), _SPEC).hashed(self))


def _setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


class _Signature:
    """``inspect.signature(cls)``, built when asked (a shared ``__init__`` shows only ``*args, **kwargs``)."""

    def __get__(self, instance: object, owner: type) -> inspect.Signature | None:
        if instance is not None:
            return None
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params, types = [], {f.name: f.type for f in dataclasses.fields(owner)}
        for name, default, factory in getattr(owner, _SPEC).init:
            shown = _FACTORY if factory is not dataclasses.MISSING else default
            shown = inspect.Parameter.empty if shown is dataclasses.MISSING else shown
            params.append(inspect.Parameter(name, kind, default=shown, annotation=types[name]))
        return inspect.Signature(params, return_annotation=None)


class _Factory:
    def __repr__(self) -> str:
        return "<factory>"  # what dataclass's own signature shows for a default_factory


_FACTORY = _Factory()


@overload
def frozen_record(cls: C, /) -> C: ...
@overload
def frozen_record(*, eq: bool = True) -> Callable[[C], C]: ...
@dataclass_transform(frozen_default=True, field_specifiers=(field, Field))
def frozen_record(cls: C | None = None, /, *, eq: bool = True) -> C | Callable[[C], C]:
    """``@dataclass(frozen=True)`` (``eq=False``: compared and hashed by identity, as there)."""

    def wrap(cls: C) -> C:
        made: C = _make(cls, eq)
        return made

    return wrap if cls is None else wrap(cls)


def _make(cls: Any, eq: bool) -> Any:
    own = vars(cls)
    for name in ("__post_init__", "__setattr__", "__delattr__"):
        if name in own:
            raise TypeError(f"{cls.__qualname__} defines {name}: use dataclasses.dataclass for it, not frozen_record")
    # As dataclass does: a method the class writes itself is kept, and so is a __hash__ it writes.
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    had_doc = cls.__doc__ is not None
    # A record that extends a record must say frozen=True to dataclass (which then compiles the two
    # frozen methods, replaced below); the others are made without a single exec.
    frozen_base = any(getattr(getattr(b, "__dataclass_params__", None), "frozen", False) for b in cls.__mro__[1:])
    cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False, frozen=frozen_base)
    fields = dataclasses.fields(cls)
    for f in fields:
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__qualname__}.{f.name}: frozen_record takes only plain init fields")
    setattr(cls, _SPEC, _Spec(fields))
    methods: dict[str, Any] = {"__init__": _init, "__repr__": _repr}
    if eq:
        methods["__eq__"] = _eq
    methods = {name: method for name, method in methods.items() if name not in own}
    if eq and not explicit_hash:
        methods["__hash__"] = _hash
    methods.update(__setattr__=_setattr, __delattr__=_delattr)
    if "__init__" not in own:
        methods["__signature__"] = _Signature()
    for name, method in methods.items():
        setattr(cls, name, method)
    # What dataclass(frozen=True) would have recorded; best effort, since the record is private to
    # dataclasses (tests/core/test_frozen.py compares it on the Python that runs the tests).
    with contextlib.suppress(AttributeError, TypeError):
        params = cls.__dataclass_params__
        params.init = params.repr = params.frozen = True
        params.eq = eq
    if not had_doc:
        cls.__doc__ = cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")
    return cls
