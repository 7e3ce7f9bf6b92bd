"""A CPU model's linear weights packed ahead in oneDNN's blocked layout, for decode steps of several rows.

A decode step at batch 4 multiplies four rows by every weight; in torch's plain layout each matmul
reorders the weights for oneDNN (bf16) or runs a kernel made for larger shapes (fp32), and reads
them at a fraction of the memory bandwidth. Packed once in oneDNN's layout (the op torch's inductor
uses when it freezes a model) they are read near all of it. The figures, and the packing's own
clock (``_Clock``: priced at its own rate as it runs, stopped past the job's budget, what it packed
kept), are in docs/backends/cpu.md ("Packed weights").

A prepared model is the model: the packed copy sits beside each weight and serves a forward only
while it is certain to hold that weight's current values. Every way torch lets a weight change is
seen: in place through autograd's view of it (an optimizer step, ``load_state_dict``,
``torch.nn.init``, ``weight.mul_()``: its version counter), replaced (``.to()``, ``assign=True``,
a device move: its object and address), and through ``.data`` (peft's merge and unmerge,
``weight.data.copy_()``, ``.half()``), which keeps neither: a packed layer's weight is made a
``_WatchedWeight``, whose ``data`` drops the copies made from it before handing the storage out.
A write through a tensor that shares the storage and was taken before the packing, or a NumPy
view of it, moves none of these: each call also reads a sampled fingerprint of the weight
(``tuning.fingerprint``). Weights in shared memory are never packed: another process writes them
where nothing in this one can see it. Gradients, another dtype, ``torch.compile`` tracing and
inference tensors (no version counter) always run torch's own linear. ``unpack`` stops a packing
in progress in another thread before it takes the copies back. docs/tuning.md says what is guaranteed.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from whichdevice.core import progress
from whichdevice.core.errors import printable
from whichdevice.measure.cpu_memory import PACKED_DTYPES, packable_dtypes, packing_ops
from whichdevice.tuning.fingerprint import Fingerprint
from whichdevice.tuning.layer_forward import PACKED, LayerForward, attach, detach

__all__ = [
    "HEADROOM",
    "PROBE_MIN_S",
    "PROBE_SHARE",
    "available_memory",
    "install_packed_weights",
    "is_packed",
    "packable_layers",
    "stopping",
    "unpack",
]

# The packed copy may take at most this share of the memory available when it is made.
HEADROOM = 0.5
# The share of the copy, after its first weight (which carries the first call's one-time costs),
# whose rate prices the whole copy; and the least time that rate must have run. Why these values:
# docs/backends/cpu.md, "The packing's clock".
PROBE_SHARE = 0.01
PROBE_MIN_S = 0.05
_ATTRIBUTE = PACKED
# torch's own storage accessor, reached past _WatchedWeight's.
_RAW_DATA: Any = torch.Tensor.data
_PLAIN: Any = torch.nn.Parameter
# A watched weight's attribute holding the packed copies made from it. In the weight's own __dict__,
# not a table of weak references: torch.utils.swap_tensors refuses a tensor that has weak references.
_COPIES = "_whichdevice_copies"
# One packing or unpacking at a time in the process: an unpack waits for a packing to see its stop
# request (at the next layer) and end, so no layer is packed after it. Reentrant: a packing that
# fails unpacks what it did. A forked child gets a new one: a fork may leave it held.
_packing = threading.RLock()
# The models an unpack is waiting to take back (how many blocks ask): a packing of one of them stops
# at its next layer.
_stopping: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_asking = threading.Lock()  # held only to count, never across a call


def _renew_lock_in_child() -> None:
    global _packing, _asking  # the process's locks, renewed where a fork may have left them held
    _packing, _asking = threading.RLock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock_in_child)


class _Packed:
    """One layer's packed weight and the weight it was packed from (the object, its version, its
    address, a sampled fingerprint of its bits)."""

    __slots__ = ("fingerprint", "linear", "pointer", "source", "tensor", "version")

    def __init__(self, tensor: Any, linear: Any, weight: Any) -> None:
        # The weight itself, not a weak reference (swap_tensors refuses those); released with the copy.
        self.tensor, self.linear, self.source = tensor, linear, weight
        self.version = None if weight is None else _version(weight)
        self.pointer: int = -1 if weight is None else weight.data_ptr()
        self.fingerprint = None if weight is None else Fingerprint(weight)

    def holds(self, weight: Any) -> bool:
        """Whether the copy is certain to hold ``weight``'s current values. The fingerprint is read
        last: only once the address is known unchanged is its view of the storage still the weight's."""
        fingerprint = self.fingerprint
        return (
            self.tensor is not None
            and self.source is weight
            and weight.data_ptr() == self.pointer
            and _version(weight) == self.version
            and fingerprint is not None
            and fingerprint.unchanged()
        )

    def drop(self) -> None:
        self.tensor = self.source = self.fingerprint = None

    def __deepcopy__(self, memo: dict[int, Any]) -> _Packed:
        # A copy's weights are other tensors: it runs unpacked rather than share this copy.
        return _Packed(None, None, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Packed, (None, None, None))


class _WatchedWeight(torch.nn.Parameter):
    """A packed layer's weight. ``.data`` hands out its storage without autograd's version counter
    (peft merges through it, ``.to()`` and ``.half()`` convert through it): reached, in either
    direction, it first drops the packed copies made from this weight and becomes a plain Parameter
    again. A copy or a pickle of it is a plain Parameter."""

    @property  # type: ignore[override]
    def data(self) -> Any:
        _drop_copies(self)
        return _RAW_DATA.__get__(self)

    @data.setter
    def data(self, value: Any) -> None:
        _drop_copies(self)
        _RAW_DATA.__set__(self, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if id(self) not in memo:
            raw = _RAW_DATA.__get__(self)
            memo[id(self)] = torch.nn.Parameter(raw.clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, proto: Any) -> Any:
        # Parameter's own, without reaching .data (which would unpack the model being saved).
        utils: Any = torch._utils
        state = {k: v for k, v in (utils._get_obj_state(self) or {}).items() if k != _COPIES} or None
        raw, hooks = _RAW_DATA.__get__(self), OrderedDict[Any, Any]()  # hooks are never serialized (torch's note)
        if not state:
            return (utils._rebuild_parameter, (raw, self.requires_grad, hooks))
        return (utils._rebuild_parameter_with_state, (raw, self.requires_grad, hooks, state))


def _watch(weight: Any, packed: _Packed) -> None:
    if type(weight) is torch.nn.Parameter:
        weight.__class__ = _WatchedWeight
    vars(weight).setdefault(_COPIES, []).append(packed)


def _drop_copies(weight: Any) -> None:
    for packed in vars(weight).pop(_COPIES, ()):
        packed.drop()
    if type(weight) is _WatchedWeight:
        weight.__class__ = _PLAIN


def _version(tensor: Any) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor keeps no version counter (such weights are not packed)
        return None


_PackedForward = LayerForward  # the name a model pickled by an earlier version restores


def packable_layers(model: Any, dtype: str) -> list[Any]:
    """``model``'s plain ``torch.nn.Linear`` layers (not subclasses: quantized layers are those) whose
    weights are plain Parameters on the CPU in ``dtype``, with a version counter (not inference
    tensors), in this process's own memory (not shared: another process may write those)."""
    return [m for m in _linear_layers(model, dtype) if not m.weight.is_shared()]


def _linear_layers(model: Any, dtype: str) -> list[Any]:
    return [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and type(m.weight) in (torch.nn.Parameter, _WatchedWeight)
        and m.weight.device.type == "cpu"
        and str(m.weight.dtype).removeprefix("torch.") == dtype
        and not m.weight.is_inference()
    ]


def is_packed(module: Any) -> bool:
    """Whether ``module`` runs a packed copy now (its weight unchanged since it was packed)."""
    packed = getattr(module, _ATTRIBUTE, None)
    return isinstance(packed, _Packed) and packed.holds(getattr(module, "weight", None))


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the kernel says are available (MemAvailable), or None where it does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable" and value.split() and value.split()[0].isdigit():
                return int(value.split()[0]) * 1024
    except OSError:
        return None
    return None


class _Clock:
    """The packing's price as it runs: the whole copy at the rate of the weights after the first
    (``PROBE_SHARE``, ``PROBE_MIN_S``). The whole copy, not the time so far plus the rest: a weight's
    gain and its packing both scale with its bytes, so the rest of the copy repays if and only if the
    whole would at that rate, whatever the start cost (spent either way)."""

    def __init__(self, size: int) -> None:
        self.size, self.done, self.start = size, 0, time.perf_counter()
        self.first: tuple[float, int] | None = None  # (time, bytes) once the first weight is packed

    def add(self, size: int) -> float | None:
        """Count one weight of ``size`` bytes packed; the whole copy's price in seconds at the rate read
        so far, or None before the rate is read."""
        now = time.perf_counter()
        self.done += size
        if self.first is None:
            self.first = (now, self.done)
            return None
        seconds, packed = now - self.first[0], self.done - self.first[1]
        if packed < PROBE_SHARE * self.size or seconds < PROBE_MIN_S:
            return None
        return self.size * seconds / packed


def _refusal(dtype: str) -> str | None:
    if dtype not in PACKED_DTYPES:
        return f"not packed: {dtype} weights are not packed (only {' and '.join(PACKED_DTYPES)})"
    if packing_ops(torch) is None:
        return "not packed: this torch has no oneDNN packing ops"
    if dtype not in packable_dtypes():
        return (
            f"not packed: oneDNN cannot pack {dtype} weights on this CPU (torch's check asks for AVX-512BW/VL/DQ "
            "or AVX-NE-CONVERT, or Arm BF16)"
        )
    return None


def install_packed_weights(model: Any, dtype: str, batch: int, budget_s: float | None = None) -> tuple[int, str]:
    """Pack ``model``'s ``dtype`` linear weights for ``batch`` rows; (layers packed, what was done).
    ``budget_s``: the seconds the whole packing may take (priced at its own rate once ``PROBE_SHARE``
    of it is done); priced past it, the packing stops, and the layers packed by then stay so."""
    refusal = _refusal(dtype)
    if refusal is not None:
        return 0, refusal
    shared = sum(m.weight.is_shared() for m in _linear_layers(model, dtype))
    # Said wherever it applies: the trace of why a model in shared memory runs unpacked.
    aside = f"; {shared} linear layers in shared memory not packed (another process may write them)" if shared else ""
    # A layer packed already is left; one whose copy was dropped, copied or unpickled packs again.
    layers = [m for m in packable_layers(model, dtype) if not is_packed(m)]
    size = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    available = available_memory()
    if available is not None and size > HEADROOM * available:
        return 0, (
            f"not packed: the packed copy ({size / 1024**3:.2f} GiB) would take more than "
            f"{HEADROOM:.0%} of the {available / 1024**3:.2f} GiB available{aside}"
        )
    with _packing, progress.working("packing the model's weights"), torch.no_grad():
        try:
            count, done = _pack(model, layers, batch, budget_s, _Clock(size))
        except RuntimeError as exc:  # a oneDNN that cannot pack this dtype after all: the model stays as it was
            unpack(model)
            first = (str(exc).splitlines() or [""])[0][:200]
            return 0, f"not packed: oneDNN could not pack {dtype} weights ({printable(first)}){aside}"
    return count, done + aside


def _pack(model: Any, layers: list[Any], batch: int, budget_s: float | None, clock: _Clock) -> tuple[int, str]:
    """Pack ``layers`` (under ``_packing``) until done, priced past ``budget_s``, or an unpack asks to stop."""
    pack, linear = packing_ops(torch)  # type: ignore[misc]
    for count, module in enumerate(layers, start=1):
        if model in _stopping:  # an unpack waits for this packing: it takes back what is done
            return count - 1, f"packing stopped after {count - 1} of {len(layers)} linear layers: unpacked meanwhile"
        weight = module.weight
        packed = _Packed(pack(weight.detach(), batch), linear, weight)
        _watch(weight, packed)
        setattr(module, _ATTRIBUTE, packed)
        attach(module)
        price = clock.add(weight.numel() * weight.element_size())
        if budget_s is not None and price is not None and price > budget_s:
            return count, (
                f"packing stopped after {clock.done / clock.size:.0%} of the copy ({count} of {len(layers)} "
                f"linear layers, kept packed, {time.perf_counter() - clock.start:.2g} s): at the rate it "
                f"ran, the whole copy would take {price:.2g} s, more than the {budget_s:.2g} s the "
                "job's tokens repay, so the rest would cost more than it saves"
            )
    took, size = time.perf_counter() - clock.start, clock.size
    return len(layers), f"{len(layers)} linear layers packed for batch {batch} ({size / 1024**3:.2f} GiB, {took:.2g} s)"


def unpack(model: Any) -> int:
    """Drop every packed copy ``install_packed_weights`` made in ``model``: the layers run torch's own
    linear and their weights are plain Parameters again. The number of layers unpacked. A packing of
    ``model`` in progress in another thread is stopped first, and waited for."""
    with stopping(model), _packing:
        return _unpack(model)


@contextmanager
def stopping(model: Any) -> Iterator[None]:
    """Within the block, a packing of ``model`` stops at its next layer (``unprepare`` holds it while
    it takes the wrappers and the copies back, so no packing in progress outlives it)."""
    with _asking:
        _stopping[model] = _stopping.get(model, 0) + 1
    try:
        yield
    finally:
        with _asking:
            _stopping[model] -= 1
            if not _stopping[model]:
                del _stopping[model]


def _unpack(model: Any) -> int:
    count = 0
    for module in model.modules():
        packed = vars(module).get(_ATTRIBUTE)
        if packed is None:
            continue
        delattr(module, _ATTRIBUTE)
        detach(module)
        weight = getattr(module, "weight", None)
        copies = vars(weight).get(_COPIES) if weight is not None else None
        if copies is not None and packed in copies:
            copies.remove(packed)
            if not copies:
                _drop_copies(weight)
        packed.drop()
        count += 1
    return count
