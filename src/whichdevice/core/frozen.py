"""Records made without compiling code class by class: ``@frozen_record`` (a frozen dataclass) and ``NamedTuple``.

``dataclass(frozen=True)`` writes ``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__`` and
``__delattr__`` as source and compiles each with ``exec`` when the class is made: 0.66 ms a class on
Python 3.11, 14 ms of a fresh ``import whichdevice; resolve_device()`` for its 19 records
(docs/performance.md). ``frozen_record`` lets ``dataclass`` do everything else (the fields with their
defaults and flags, ``fields()``, ``replace()``, ``asdict()``, ``__match_args__``, the checks on mutable
defaults) and gives every class the same six functions, which read the class's fields: what they
return, raise and print is what the generated ones would (tests/core/test_frozen.py compares them on
every record of the package). One difference: a plain subclass of a record cannot set attributes of
its own either.

``NamedTuple`` is ``typing.NamedTuple`` for mypy and, when the module runs, a class base that makes the
same tuple class without typing's check of each annotation: under ``from __future__ import annotations``
each annotation is a string, and typing compiles every one into a ``ForwardRef`` (15 us a field, 1.3 ms
of a fresh resolve for its 87; docs/performance.md). The class is ``collections.namedtuple``'s, as
typing's is, with the annotations kept as the strings written.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import operator
import reprlib
import sys
import typing
from collections.abc import Callable
from dataclasses import Field, FrozenInstanceError, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # typing_extensions comes with torch
    from typing_extensions import dataclass_transform

__all__ = ["NamedTuple", "frozen_record"]

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


# ------------------------------------------------------------------------------------------ NamedTuple

# What typing refuses or skips in a NamedTuple's class body (typing._prohibited and _special, the same
# on Python 3.10 to 3.13).
_PROHIBITED = frozenset(
    {"__new__", "__init__", "__slots__", "__getnewargs__", "_fields", "_field_defaults", "_make", "_replace"}
    | {"_asdict", "_source"}
)
_SPECIAL = frozenset({"__module__", "__name__", "__annotations__"})


class _TupleRecordMeta(type):
    """``class X(NamedTuple)`` as typing.NamedTupleMeta makes it, the annotations left as written."""

    def __new__(mcls, typename: str, bases: tuple[type, ...], ns: dict[str, Any]) -> Any:
        if bases != (_TupleRecordBase,):
            raise TypeError("can only inherit from a NamedTuple type")
        types: dict[str, Any] = ns.get("__annotations__", {})
        default_names: list[str] = []
        for field_name in types:
            if field_name in ns:
                default_names.append(field_name)
            elif default_names:
                raise TypeError(
                    f"Non-default namedtuple field {field_name} cannot follow default field"
                    f"{'s' if len(default_names) > 1 else ''} {', '.join(default_names)}"
                )
        make_tuple: Any = collections.namedtuple  # mypy wants literal arguments: these are the class's own
        made = make_tuple(typename, list(types), defaults=[ns[n] for n in default_names], module=ns["__module__"])
        made.__annotations__ = made.__new__.__annotations__ = dict(types)
        for key, value in ns.items():
            if key in _PROHIBITED:
                raise AttributeError("Cannot overwrite NamedTuple attribute " + key)
            if key in _SPECIAL:
                continue
            if key not in made._fields:
                setattr(made, key, value)
            if sys.version_info >= (3, 13) and hasattr(type(value), "__set_name__"):
                type(value).__set_name__(value, made, key)  # as typing does from 3.13
        if "__orig_bases__" in ns:
            made.__orig_bases__ = (typing.NamedTuple,)
        return made


_TupleRecordBase = type.__new__(_TupleRecordMeta, "NamedTuple", (), {})


if TYPE_CHECKING:
    from typing import NamedTuple as NamedTuple
else:

    def NamedTuple(typename, fields=None, /, **kwargs):  # noqa: N802  # typing's name
        """The call form, ``NamedTuple("X", [("a", int)])``: typing's own."""
        return typing.NamedTuple(typename, fields, **kwargs)

    NamedTuple.__mro_entries__ = lambda bases: (_TupleRecordBase,)
