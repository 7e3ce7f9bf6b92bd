"""``@frozen_record`` (whichdevice.core.frozen) behaves as ``@dataclass(frozen=True)`` on every record of
the package: each is rebuilt here as a plain frozen dataclass with the same fields and compared on
construction, repr, equality, hashing, assignment, the signature, ``replace``, ``asdict`` and pickling."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import pickle
import pkgutil
import subprocess
import sys
from dataclasses import FrozenInstanceError, field

import pytest

import whichdevice
from whichdevice.core import frozen
from whichdevice.core.frozen import frozen_record


def _package_classes() -> list[type]:
    for info in pkgutil.walk_packages(whichdevice.__path__, "whichdevice."):
        importlib.import_module(info.name)
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("whichdevice."):
            for value in vars(module).values():
                if inspect.isclass(value) and value.__module__ == name and dataclasses.is_dataclass(value):
                    found[f"{name}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


DATACLASSES = _package_classes()
RECORDS = [c for c in DATACLASSES if "__frozen_record__" in vars(c)]


def _reference(cls: type) -> type:
    """The same fields, made by dataclass(frozen=True) itself."""
    annotations, namespace = {}, {}
    for f in dataclasses.fields(cls):
        annotations[f.name] = f.type
        namespace[f.name] = field(
            default=f.default, default_factory=f.default_factory, repr=f.repr, compare=f.compare, hash=f.hash
        )
    for name in ("__repr__", "__eq__", "__hash__", "__init__"):  # what the record wrote itself
        for klass in cls.__mro__[:-1]:
            if name in vars(klass) and vars(klass)[name] is not getattr(frozen, f"_{name.strip('_')}", None):
                namespace[name] = vars(klass)[name]
                break
    namespace.update(__annotations__=annotations, __module__=cls.__module__, __qualname__=cls.__qualname__)
    bases = tuple(b for b in cls.__bases__ if not dataclasses.is_dataclass(b))  # FlatNames' properties, say
    made = type(cls.__name__, bases, namespace)
    return dataclasses.dataclass(frozen=True, eq=cls.__dataclass_params__.eq)(made)


def _values(cls: type, tag: str) -> dict[str, object]:
    return {f.name: f"{tag}-{f.name}" for f in dataclasses.fields(cls)}


def _outcome(call):
    try:
        return ("value", call())
    except Exception as exc:  # the kind of error is what is compared
        return ("raised", type(exc))


def _shown(record):
    """repr, or the kind of error a repr the class writes itself raises on made-up values."""
    return _outcome(lambda: repr(record))


def _hashed_alike(one, other):
    return _outcome(lambda: hash(one) == hash(other))


def _made(cls, args, kwargs):
    return _outcome(lambda: vars(cls(*args, **kwargs)))


def _hashed(record, eq):
    # eq=False: hashed by identity, as object does
    return _outcome(lambda: hash(record)) if eq else ("value", hash(record) == object.__hash__(record))


def test_every_frozen_dataclass_of_the_package_is_a_frozen_record():
    # A frozen record made with dataclass() costs a fresh import 0.66 ms; the mutable ones stay dataclasses.
    plain_frozen = [c for c in DATACLASSES if c.__dataclass_params__.frozen and c not in RECORDS]
    assert RECORDS and plain_frozen == []
    assert len(RECORDS) > 50


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__qualname__)
def test_a_record_behaves_as_the_frozen_dataclass_with_its_fields(cls):
    ref = _reference(cls)
    a, b = _values(cls, "a"), _values(cls, "b")
    ours, theirs = cls(**a), ref(**a)
    eq = cls.__dataclass_params__.eq
    assert _shown(ours) == _shown(theirs)
    assert _shown(cls(*a.values())) == _shown(ours) and (cls(*a.values()) == ours) is (ref(*a.values()) == theirs)
    assert str(inspect.signature(cls)) == str(inspect.signature(ref))
    assert cls.__match_args__ == ref.__match_args__
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    assert dataclasses.astuple(ours) == dataclasses.astuple(theirs)
    for name in ("init", "repr", "eq", "frozen", "order", "unsafe_hash"):
        assert getattr(cls.__dataclass_params__, name) == getattr(ref.__dataclass_params__, name), name
    assert (ours == cls(**a)) is (theirs == ref(**a))
    assert _hashed(ours, eq) == _hashed(theirs, eq)
    for name in a:  # one field changed at a time: equal and hashed alike where the dataclass says so
        changed = {**a, name: b[name]}
        assert (ours == cls(**changed)) is (theirs == ref(**changed)), name
        assert (ours != cls(**changed)) is (theirs != ref(**changed)), name
        assert _hashed_alike(cls(**changed), ours) == _hashed_alike(ref(**changed), theirs), name
        assert _shown(dataclasses.replace(ours, **{name: b[name]})) == _shown(cls(**changed))
    assert (ours == theirs) is False and ours.__eq__(object()) is NotImplemented
    for target in (ours, theirs):
        with pytest.raises(FrozenInstanceError, match="cannot assign to field 'x'"):
            target.x = 1
        with pytest.raises(FrozenInstanceError, match="cannot delete field"):
            del target.x
    restored = pickle.loads(pickle.dumps(ours))
    assert (restored == ours) is (ref(**a) == theirs)  # False where eq=False
    assert _shown(restored) == _shown(ours) and _shown(copy.deepcopy(ours)) == _shown(ours)
    assert vars(restored) == vars(ours)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__qualname__)
def test_a_record_refuses_the_calls_the_dataclass_refuses(cls):
    ref = _reference(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING]
    calls = [
        ((), {}),
        (tuple(range(len(names) + 1)), {}),
        ((), {**dict.fromkeys(names, 0), "not_a_field": 1}),
        ((0,), {names[0]: 0}),
        ((), dict.fromkeys(required, 0)),
    ]
    for args, kwargs in calls:
        assert _made(cls, args, kwargs) == _made(ref, args, kwargs), (args, kwargs)


def test_defaults_and_factories_are_given_fresh_to_each_record():
    @frozen_record
    class Bag:
        items: list[int] = field(default_factory=list)
        label: str = "bag"

    one, two = Bag(), Bag()
    assert one.items == [] and one.items is not two.items and one.label == "bag"
    assert str(inspect.signature(Bag)) == "(items: 'list[int]' = <factory>, label: 'str' = 'bag') -> None"
    assert Bag.__doc__ is None or Bag.__doc__.startswith("Bag(")


def test_what_the_class_writes_itself_is_kept_and_what_frozen_record_cannot_honour_is_refused():
    @frozen_record
    class Named:
        name: str

        def __repr__(self) -> str:
            return f"<{self.name}>"

        def __hash__(self) -> int:
            return 7

    assert repr(Named("x")) == "<x>" and hash(Named("x")) == 7 and Named("x") == Named("x")
    for body in (
        {"__post_init__": lambda self: None},
        {"__setattr__": object.__setattr__},
        {"y": field(default=0, init=False)},
        {"y": field(default=0, kw_only=True)},
    ):
        namespace = {"__annotations__": {"y": "int"}, "__module__": __name__, **body}
        with pytest.raises(TypeError, match="frozen_record"):
            frozen_record(type("Refused", (), namespace))


def test_identity_records_and_records_that_extend_records():
    @frozen_record(eq=False)
    class Handle:
        path: str

    first = Handle("p")
    assert first == first and first != Handle("p")

    @frozen_record
    class Base:
        a: int
        b: int = 2

    @frozen_record
    class Child(Base):
        c: int = 3

    assert repr(Child(1)) == "test_identity_records_and_records_that_extend_records.<locals>.Child(a=1, b=2, c=3)"
    assert Child(1) != Base(1, 2) and Child(1) == Child(1, 2, 3)
    with pytest.raises(FrozenInstanceError):
        Child(1).a = 2


def test_a_record_holding_itself_prints_an_ellipsis_as_the_dataclass_does():
    @frozen_record
    class Node:
        children: list[object] = field(default_factory=list)

    node = Node()
    node.children.append(node)
    assert repr(node).endswith("Node(children=[...])")


def test_a_fresh_resolve_compiles_no_dataclass_method():
    # dataclass() compiles its methods with exec; whichdevice's records do without (0.66 ms a class on
    # Python 3.11). Counted in a fresh process, after torch's own imports.
    code = (
        "import builtins, dataclasses, torch\n"
        "made = []\n"
        "real = builtins.exec\n"
        "def counting(source, globals=None, locals=None, *rest):\n"
        "    if isinstance(source, str) and globals and globals.get('__name__', '').startswith('whichdevice'):\n"
        "        made.append(globals['__name__'])\n"
        "    return real(source, globals, locals, *rest)\n"
        "builtins.exec = counting\n"
        "import whichdevice\n"
        "whichdevice.resolve_device()\n"
        "print(sorted(set(made)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
