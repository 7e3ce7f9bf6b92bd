"""``@frozen_record`` (whichdevice.core.frozen) behaves as ``@dataclass(frozen=True)`` on every record of
the package: each is rebuilt here as a plain frozen dataclass with the same fields and compared on
construction, repr, equality, hashing, assignment, the signature, ``replace``, ``asdict`` and pickling.
Its ``NamedTuple`` makes the class ``typing.NamedTuple`` makes: each of the package's is compared with the
one typing makes from the same source."""

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


# ------------------------------------------------------------------------------------------ NamedTuple


def _package_tuples() -> list[type]:
    _package_classes()  # imports every module
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("whichdevice."):
            for value in vars(module).values():
                is_tuple = inspect.isclass(value) and issubclass(value, tuple) and hasattr(value, "_fields")
                if is_tuple and value.__module__ == name:
                    found[f"{name}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


TUPLES = _package_tuples()


def _typing_twin(cls: type) -> type:
    """The same class source, made by typing.NamedTuple in the module's own namespace."""
    import textwrap
    import typing

    namespace = dict(vars(sys.modules[cls.__module__]), NamedTuple=typing.NamedTuple)
    exec(compile(textwrap.dedent(inspect.getsource(cls)), inspect.getsourcefile(cls) or "?", "exec"), namespace)
    twin: type = namespace[cls.__name__]
    return twin


def _annotations_as_written(cls: type) -> dict[str, str]:
    return {k: getattr(v, "__forward_arg__", v) for k, v in cls.__annotations__.items()}


def test_every_named_tuple_of_the_package_is_made_without_typing():
    """Each is made by core.frozen's NamedTuple: its annotations are the strings written, not ForwardRefs."""
    assert len(TUPLES) >= 28
    for cls in TUPLES:
        assert all(isinstance(v, str) for v in cls.__annotations__.values()), cls


@pytest.mark.parametrize("cls", TUPLES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_a_named_tuple_is_the_class_typing_makes(cls):
    import typing

    twin = _typing_twin(cls)
    assert cls.__mro__[1:] == twin.__mro__[1:] == (tuple, object)
    assert type(cls) is type(twin) is type
    assert (cls._fields, cls._field_defaults, cls.__match_args__) == (
        twin._fields,
        twin._field_defaults,
        twin.__match_args__,
    )
    assert (cls.__doc__, cls.__module__, cls.__qualname__) == (twin.__doc__, twin.__module__, twin.__qualname__)
    assert _annotations_as_written(cls) == _annotations_as_written(twin)
    assert cls.__new__.__annotations__ == cls.__annotations__
    assert cls.__orig_bases__ == twin.__orig_bases__ == (typing.NamedTuple,)
    # __slotnames__: copyreg's cache, set on a class once an instance was copied or pickled
    own = {k: v for k, v in vars(cls).items() if k != "__slotnames__"}
    assert sorted(own) == sorted(vars(twin))
    for name, value in own.items():  # the class body's own methods and constants, carried over alike
        other = vars(twin)[name]
        if inspect.isfunction(value):
            assert value.__code__.co_code == other.__code__.co_code, name
        elif isinstance(value, property):
            assert value.fget.__code__.co_code == other.fget.__code__.co_code, name
    required = [f for f in cls._fields if f not in cls._field_defaults]
    values = [f"v-{f}" for f in required]
    one, two = cls(*values), twin(*values)
    assert tuple(one) == tuple(two) and one == tuple(two)
    assert repr(one) == repr(two)
    assert one._asdict() == two._asdict() and one._replace(**{cls._fields[0]: 1})[0] == 1
    assert pickle.loads(pickle.dumps(one)) == one and type(pickle.loads(pickle.dumps(one))) is cls
    assert copy.deepcopy(one) == one and hash(one) == hash(tuple(one))
    for args, kwargs in (((), {}), ((*values, *range(len(cls._fields) + 1)), {}), (values, {"nope": 1})):
        assert _outcome(lambda a=args, k=kwargs: cls(*a, **k)) == _outcome(lambda a=args, k=kwargs: twin(*a, **k))


def test_a_named_tuple_refuses_what_typing_refuses():
    import typing

    def bodies(base):
        def non_default_after_default():
            class A(base):
                x: int = 1
                y: int

        def prohibited():
            class B(base):
                x: int

                def _replace(self):
                    return self

        def two_bases():
            class C(base, dict):  # type: ignore[misc]
                x: int

        return non_default_after_default, prohibited, two_bases

    for ours, theirs in zip(bodies(frozen.NamedTuple), bodies(typing.NamedTuple), strict=True):
        with pytest.raises((TypeError, AttributeError)) as mine:
            ours()
        with pytest.raises((TypeError, AttributeError)) as typings:
            theirs()
        assert type(mine.value) is type(typings.value)
        if ours.__name__ != "two_bases":  # typing's message for extra bases differs by Python version
            assert str(mine.value) == str(typings.value)


def test_the_call_form_is_typings():
    made = frozen.NamedTuple("Pair", [("a", int), ("b", str)])
    assert made._fields == ("a", "b") and made.__annotations__ == {"a": int, "b": str}


def test_no_module_of_the_package_makes_its_named_tuples_with_typing():
    """typing.NamedTuple compiles each string annotation (1.3 ms of a fresh resolve): core.frozen's is used."""
    import ast
    from pathlib import Path

    root = Path(whichdevice.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            from_typing = isinstance(node, ast.ImportFrom) and node.module == "typing"
            if from_typing and "NamedTuple" in [a.name for a in node.names] and path.name != "frozen.py":
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
