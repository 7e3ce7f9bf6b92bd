"""Timing the CPU where real models run: decode steps whose weights stream from memory, and the read bandwidth.

A 0.1-8B model's weights are larger than the last-level cache, so every decode step reads them all
from memory; the cache-resident figures of ``cpu_timing`` say what the arithmetic costs, these what
a step costs when the bytes per weight decide. A dtype's speed over fp32 differs between the two
regimes (a kernel may reorder its weights per call, or be limited by its arithmetic), so both are
timed, on a weight set of ``STREAM_LLCS`` times the last-level cache in the smallest dtype.

bf16 at one row is timed twice: through oneDNN (torch's default for bf16 matmuls on CPUs with
AVX-512) and through torch's own GEMV kernel (oneDNN off). Measured here (AMD EPYC, avx512_bf16,
torch 2.13), oneDNN read bf16 weights at about half the bandwidth and torch's kernel near all of it,
while at four rows and more oneDNN was the faster: the figure decides whether generate() gets the
single-row switch (``whichdevice.tuning.single_row``).

A step's time is not only its bytes: each matmul call costs a fixed overhead too (oneDNN's bf16 path
about 40 us a call here, torch's GEMV kernel 15, fp32 20), and a 0.1-0.4B model makes 7 calls a layer
on matrices as small as its 256-row key and value projections. So at one row the same bytes are
timed again as ``NARROW`` matrices ("sn1", "gn1"): 42 times as many calls. From the two sets the
estimate separates each path's cost per call from its cost per weight, and a model's step is its
calls times the one plus its weights times the other (``whichdevice.measure.estimate``). Measured
here with oneDNN capped below bf16: torch's GEMV kernel over oneDNN read 1.22x on the large set
and 1.75x on a 0.1B Llama's own matrices, which the two-set estimate put at 1.40x.

At four rows fp32 and bf16 are also timed with their weights packed once, ahead of the steps, in
oneDNN's blocked layout (the op torch's inductor uses when it freezes a model's weights): measured
here, 3.6x fp32's default decode at batch 4 for fp32 weights and 1.8x for bf16 on a 1.1B Llama. The
packing's rate ("pack", GB/s of weights) is timed too, since the packing is paid once per load and
counted against the job's length (``whichdevice.tuning.packed_weights``).

The weights are one random tile cloned: a matmul's time does not depend on the values it reads,
and filling hundreds of MB with random numbers would cost more than the timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from whichdevice.core.dtypes import short_name

__all__ = [
    "DEFAULT_LLC",
    "NARROW",
    "PACKED_BATCH",
    "STREAM_BATCHES",
    "STREAM_LLCS",
    "last_level_cache",
    "measure_streamed",
    "packable_dtypes",
    "packing_ops",
]

# The smallest dtype's set is this many times the last-level cache: a cyclic read of twice the
# cache misses nearly always (LRU-like policies evict the line needed next), so no figure is a cache's.
STREAM_LLCS = 2
STREAM_BATCHES = (1, 4)
# The batch the packed weights are timed at ("p4"): at one row torch's own GEMV kernel reads bf16
# near the bandwidth already and fp32 packed measured no faster, so packing is timed where it helps.
PACKED_BATCH = 4
PACKED_DTYPES = ("float32", "bfloat16")
# Ratios of packed over plain the packed gain is the median of (the first call, a warm-up, aside).
PACKED_PAIRS = 15
# A layer-sized matrix (a 1B model's hidden 2048 by 4096 of the MLP), 32 MiB in fp32.
_ROWS, _COLS = 4096, 2048
# The narrow set's matrix: a 0.1B Llama's key or value projection (4 heads of 64 by hidden 768); the
# same memory as the layer-sized set, cut into as many of these as it holds.
NARROW = (256, 768)
# The fp32 set is at most this large, whatever the cache says (a server's 256 MiB L3 would ask 2 GiB).
_MAX_FP32_BYTES = 512 * 1024**2
# Where sysfs has no cache sizes (containers, non-Linux): a common server L3 slice; the figures say so.
DEFAULT_LLC = 32 * 1024**2
_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


def _size(text: str) -> int | None:
    text = text.strip().upper()
    unit = _UNITS.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _UNITS else text
    return int(digits) * unit if digits.isdigit() and 0 < int(digits) < 2**40 else None


def last_level_cache(folder: Path = _CACHE_DIR) -> tuple[int, str]:
    """The largest data or unified cache of cpu0 in bytes, and where that figure came from."""
    best: tuple[int, int] | None = None  # (level, bytes)
    try:
        for index in sorted(folder.glob("index*")):
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text().strip())
            size = _size((index / "size").read_text())
            if kind in ("Data", "Unified") and size is not None and (best is None or (level, size) > best):
                best = (level, size)
    except (OSError, ValueError):
        best = None
    if best is None:
        return DEFAULT_LLC, f"no cache sizes in {folder}: {DEFAULT_LLC // 1024**2} MiB assumed"
    return best[1], f"L{best[0]} {best[1] // 1024} KiB ({folder})"


def stream_matrices(llc: int) -> int:
    """How many layer-sized matrices make a set of ``STREAM_LLCS`` caches in bf16 (at least two)."""
    per = _ROWS * _COLS * 2
    wanted = -(-STREAM_LLCS * llc // per)
    return max(2, min(wanted, _MAX_FP32_BYTES // (2 * per)))


def packing_ops(torch: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """oneDNN's (pack, linear) ops for prepacked linear weights, or None where this torch lacks them
    (a build without oneDNN, or a version that renamed them: then nothing is packed)."""
    if not torch.backends.mkldnn.is_available():
        return None
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        pack, linear = ops._reorder_linear_weight, ops._linear_pointwise  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return None
    return (
        lambda weight, batch: pack(weight, batch),
        lambda x, packed, bias: linear(x, packed, bias, "none", [], ""),
    )


_REAL_PACKABLE: list[frozenset[str]] = []


def packable_dtypes() -> frozenset[str]:
    """The weight dtypes oneDNN packs on this CPU (of ``PACKED_DTYPES``), as torch itself decides.

    A simulated CPU answers from its spec (``packs=``, else its flags: native bf16 flags come with
    AVX-512BW/VL/DQ on every such CPU). The real one is asked once per process: fp32 wherever torch
    has the packing ops, bf16 where torch's own oneDNN check passes (the check the packing op raises
    on: AVX-512BW/VL/DQ or AVX-NE-CONVERT, Arm BF16; it reads the CPU's flags, so
    ``ONEDNN_MAX_CPU_ISA`` does not change it), confirmed by packing one small matrix."""
    from whichdevice.hardware.store import current_store

    simulated: frozenset[str] | None = getattr(current_store(), "packs", None)
    if simulated is not None:
        return simulated
    if not _REAL_PACKABLE:
        import torch

        ops = packing_ops(torch)
        found = set()
        for name in PACKED_DTYPES if ops is not None else ():
            try:
                ops[0](torch.ones(16, 16, dtype=getattr(torch, name)), PACKED_BATCH)  # type: ignore[index]
            except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
                continue
            found.add(name)
        _REAL_PACKABLE.append(frozenset(found))
    return _REAL_PACKABLE[0]


BestOf = Callable[[Mapping[str, Callable[[], Any]], float], tuple[dict[str, float], bool]]


def measure_streamed(
    torch: Any, dtypes: list[str], best_of: BestOf, deadline: float, out_of_time: Callable[[], bool]
) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[str]]:
    """(speeds over fp32 "bf16.s1", "bf16.s4", "bf16.g1", "bf16.p4" ..., fp32 seconds "s1"/"s4"/"p4"
    of the set, memory figures "llc"/"stream"/"read"/"pack"/"upcast", unsteady names); ``best_of`` and
    ``deadline`` are cpu_timing's timer and budget. "g1": one row through torch's own GEMV kernel
    (oneDNN off); "p4": four rows by weights packed ahead (fp32's in seconds, bf16's over fp32's "s4").
    "sn1"/"gn1": the one-row steps again on the same memory cut into ``NARROW`` matrices, timed in
    the same rounds; memory "calls"/"narrow" count each set's matrices, "narrow_stream" its weights."""
    llc, _ = last_level_cache()
    count = stream_matrices(llc)
    memory = {"llc": float(llc), "stream": float(count * _ROWS * _COLS)}
    if out_of_time():
        return {}, {}, memory, [f"s{b} (out of time)" for b in STREAM_BATCHES]
    tile = torch.empty(_ROWS, _COLS).uniform_(-0.03, 0.03)
    base = [tile.clone() for _ in range(count)]
    weights = {name: [w.to(getattr(torch, name)) for w in base] for name in ["float32", *dtypes]}
    del base, tile
    speeds: dict[str, float] = {}
    fp32: dict[str, float] = {}
    unsteady: list[str] = []
    linear = torch.nn.functional.linear
    packed: dict[str, Any] = {}
    for batch in STREAM_BATCHES:
        if batch == PACKED_BATCH and not out_of_time():
            # Packed after the batch-1 step is timed: that figure decides more jobs than this one.
            packed = _packed(torch, weights, memory)
        if out_of_time():
            unsteady.append(f"s{batch} (out of time)")
            continue
        runs: dict[str, Callable[[], Any]] = {}
        for name, ws in weights.items():
            runs[name] = _steps(linear, torch.randn(batch, 1, _COLS, dtype=getattr(torch, name)), ws)
        if batch == 1:
            _add_one_row(torch, runs, weights, memory)
        samples = _add_packed(torch, runs, packed, batch) if batch == PACKED_BATCH else {}
        best, steady = best_of(runs, deadline)
        _more_pairs(runs, samples, out_of_time)
        if not steady:
            unsteady.append(f"s{batch}")
        for prefix, shape in (("", f"s{batch}"), ("narrow ", f"sn{batch}")):
            if f"{prefix}float32" in best:
                fp32[shape] = best[f"{prefix}float32"]
                for name in dtypes:
                    speeds[f"{short_name(name)}.{shape}"] = best[f"{prefix}float32"] / best[f"{prefix}{name}"]
            if f"{prefix}gemv" in best:  # torch's GEMV kernel at one row: "g1", "gn1"
                speeds[f"bf16.g{shape[1:]}"] = best[f"{prefix}float32"] / best[f"{prefix}gemv"]
        if "packed float32" in samples:
            fp32[f"p{batch}"] = best["float32"] / _gain(samples["float32"], samples["packed float32"])
        if "packed bfloat16" in samples:
            gain = _gain(samples["bfloat16"], samples["packed bfloat16"])
            speeds[f"bf16.p{batch}"] = best["float32"] / best["bfloat16"] * gain
    del packed
    if not out_of_time():
        unsteady += _time_memory(torch, weights, memory, best_of, deadline)
    return speeds, fp32, memory, unsteady


def _time_memory(
    torch: Any, weights: dict[str, list[Any]], memory: dict[str, float], best_of: BestOf, deadline: float
) -> list[str]:
    """Set memory "read" (GB/s torch's threads read: a sum reads every byte once, with little
    arithmetic) and "upcast" (GB/s of fp32 written copying the streamed bf16 weights into one fp32
    buffer, as a bf16 prompt computed in fp32 does first: tuning.upcast); the unsteady names."""
    bytes_ = sum(w.numel() * 4 for w in weights["float32"])
    buffer = torch.empty(_ROWS, _COLS)
    runs: dict[str, Callable[[], Any]] = {"read": lambda: [w.sum() for w in weights["float32"]]}
    if "bfloat16" in weights:
        runs["upcast"] = lambda: [buffer.copy_(w) for w in weights["bfloat16"]]
    unsteady = []
    for name, run in runs.items():
        best, steady = best_of({name: run}, deadline)
        memory[name] = bytes_ / best[name] / 1e9
        if not steady:
            unsteady.append("read bandwidth" if name == "read" else name)
    return unsteady


def _add_one_row(
    torch: Any, runs: dict[str, Callable[[], Any]], weights: dict[str, list[Any]], memory: dict[str, float]
) -> None:
    """Add the one-row runs beside the plain steps: bf16 through torch's GEMV kernel ("gemv", where
    oneDNN would otherwise run it), and each dtype's step over its set cut into ``NARROW`` matrices
    ("narrow <dtype>", "narrow gemv": views of the same memory, so nothing more is allocated); sets
    memory "calls", "narrow" and "narrow_stream"."""
    each = _ROWS * _COLS // (NARROW[0] * NARROW[1])
    gemv = "bfloat16" in weights and torch.backends.mkldnn.is_available()
    linear = torch.nn.functional.linear
    if gemv:
        runs["gemv"] = _without_onednn(
            torch, _steps(linear, torch.randn(1, 1, _COLS, dtype=torch.bfloat16), weights["bfloat16"])
        )
    for name, ws in weights.items():
        cut = [m for w in ws for m in w.view(-1)[: each * NARROW[0] * NARROW[1]].view(each, *NARROW).unbind(0)]
        x = torch.randn(1, 1, NARROW[1], dtype=getattr(torch, name))
        runs[f"narrow {name}"] = _steps(linear, x, cut)
        if gemv and name == "bfloat16":
            runs["narrow gemv"] = _without_onednn(torch, _steps(linear, x, cut))
    count = len(next(iter(weights.values()), []))  # every dtype's set has as many matrices
    memory.update(
        calls=float(count), narrow=float(count * each), narrow_stream=float(count * each * NARROW[0] * NARROW[1])
    )


def _packed(torch: Any, weights: dict[str, list[Any]], memory: dict[str, float]) -> dict[str, Any]:
    """fp32's and bf16's sets packed for ``PACKED_BATCH`` rows, by dtype: (linear op, packed set);
    sets "pack" in ``memory`` (GB/s of weights packed, timed on fp32's set). Empty without the ops."""
    ops = packing_ops(torch)
    if ops is None:
        return {}
    pack, linear = ops
    out: dict[str, Any] = {}
    for name in PACKED_DTYPES:
        if name not in weights:
            continue
        start = time.perf_counter()
        try:
            sets = [pack(w, PACKED_BATCH) for w in weights[name]]
        except RuntimeError:  # a oneDNN without this dtype's packing: that dtype is not timed packed
            continue
        if name == "float32":
            seconds = max(time.perf_counter() - start, 1e-9)
            memory["pack"] = sum(w.numel() * 4 for w in weights[name]) / seconds / 1e9
        out[name] = (linear, sets)
    return out


def _add_packed(
    torch: Any, runs: dict[str, Callable[[], Any]], packed: dict[str, Any], batch: int
) -> dict[str, list[float]]:
    """Add each packed set's step to ``runs``; the times of every packed run and of its plain twin,
    round by round, by run name. The packed gain is the median of each round's plain-over-packed
    ratio: the two runs sit side by side in a round, so what else runs moves both, where two
    minimums taken in different rounds moved apart (bf16's gain read 1.2x once and 1.5-2.1x otherwise)."""
    samples: dict[str, list[float]] = {}
    for name, (linear_packed, sets) in packed.items():
        x = torch.randn(batch, 1, _COLS, dtype=getattr(torch, name))
        runs[f"packed {name}"] = _steps(lambda x, w, f=linear_packed: f(x, w, None), x, sets)
        for run in (name, f"packed {name}"):
            samples[run] = []
            runs[run] = _recorded(runs[run], samples[run])
    return samples


def _more_pairs(
    runs: Mapping[str, Callable[[], Any]], samples: dict[str, list[float]], out_of_time: Callable[[], bool]
) -> None:
    """Time the packed runs and their plain twins in further interleaved rounds, up to
    ``PACKED_PAIRS`` ratios each, while time is left. best_of stops at five rounds when the minimums
    are steady, and a median of four ratios moved 1.45-1.9x for bf16 between fresh processes on a
    quiet machine (single rounds read 1.07-2.31x): each pair costs milliseconds, so more are cheap."""
    while samples and min(len(times) for times in samples.values()) <= PACKED_PAIRS and not out_of_time():
        for name in samples:
            runs[name]()


def _recorded(run: Callable[[], Any], times: list[float]) -> Callable[[], Any]:
    def timed() -> Any:
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
        return out

    return timed


def _gain(plain: list[float], packed: list[float]) -> float:
    """The median over rounds of plain's time over packed's (the first call, a warm-up, left out)."""
    import statistics

    ratios = [p / max(q, 1e-12) for p, q in zip(plain[1:], packed[1:], strict=False)]
    return statistics.median(ratios) if ratios else min(plain) / max(min(packed), 1e-12)


def _steps(linear: Callable[..., Any], x: Any, weights: list[Any]) -> Callable[[], Any]:
    return lambda: [linear(x, w) for w in weights]


def _without_onednn(torch: Any, run: Callable[[], Any]) -> Callable[[], Any]:
    def without() -> Any:
        # The flag is torch's global one; restored even when the run raises.
        before = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            return run()
        finally:
            torch.backends.mkldnn.enabled = before

    return without
