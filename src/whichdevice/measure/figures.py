"""The calibration's figures: the record, the plausible range of each figure, and the spec a simulation writes.

Every figure read back (the cache file, ``simulate("cpu,calib=...")``, a replayed report) passes
:func:`check_figure`: a known name and a finite number in its range, or a ValueError naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field, replace
from typing import Any

from whichdevice.core.dtypes import NAMES, short_name
from whichdevice.core.frozen import frozen_record

__all__ = ["DEFAULT_FP32", "MEMORY_RANGES", "PROMPT_ROWS", "SHAPES", "Calibration", "check_figure", "parse_figures"]

# The rows of the prompt-sized matmul the calibration times ("prompt", "pp", "up"; cpu_timing).
PROMPT_ROWS = 128


# The figures an unsteady name covers where they are not its own shape: the figures timed in the same
# rounds (torch's GEMV beside "s1", the packed step beside "s4", the packed prompt beside the
# prompt), an attention ratio, and the read bandwidth. Any other name ("b4", "prompt") is the shape itself.
_COVERS = {
    "s1": ("s1", "g1", "sn1", "gn1"),
    "s4": ("s4", "p4"),
    "prompt": ("prompt", "pp", "up"),
    "bf16 attention": ("bf16.attention",),
    "fp16 attention": ("fp16.attention",),
    "bf16 gqa attention": ("bf16.gqa",),
    "fp16 gqa attention": ("fp16.gqa",),
    "read bandwidth": ("mem.read",),
    "upcast": ("mem.upcast",),
}


@frozen_record
class Calibration:
    """``speeds``: "bf16.b1" (a decode step at batch 1), "bf16.b2", "bf16.b4", "bf16.b8",
    "bf16.prompt" (a prompt-sized matmul), each bf16's speed over fp32's (above 1: faster), the
    same for fp16, and "bf16.attention"/"fp16.attention": a one-token attention by plain matmuls
    over torch's fused kernel, "bf16.gqa"/"fp16.gqa": a grouped-query one through the fused kernel
    with the query heads grouped by key/value head over one row per head. Those run from the cache;
    "bf16.s1" and "bf16.s4" are decode steps of batch 1 and 4 whose weights stream from memory,
    "bf16.g1" the batch-1 step through torch's own GEMV kernel (oneDNN off), "bf16.p4" the batch-4
    step with weights packed ahead in oneDNN's layout, "bf16.pp" the prompt-sized matmul with them
    packed (over fp32's plain prompt), "bf16.up" the prompt-sized matmul computed in fp32 from the bf16
    weights copied into a reused fp32 buffer per call (``tuning.upcast``), "bf16.sn1"/"bf16.gn1" the
    batch-1 steps over the same memory cut into small matrices (many more calls). ``fp32``: seconds of
    an fp32 decode step per batch ("b1".."b8", "s1"/"s4" for the streamed set, "sn1" its narrow cut,
    "p4" packed) and of one prompt row ("prompt", "pp" packed).
    ``memory``: "llc" (the last-level cache's bytes), "cache", "stream" and "narrow_stream"
    (parameters of the cache-resident, the streamed and the narrow weight sets), "calls" and
    "narrow" (the streamed and narrow sets' matrices), "read" (GB/s torch's threads read),
    "pack" (GB/s of weights packed) and "upcast" (GB/s of fp32 written copying bf16 weights that stream
    from memory into one fp32 buffer)."""

    speeds: Mapping[str, float]
    fp32: Mapping[str, float] = field(default_factory=dict)
    memory: Mapping[str, float] = field(default_factory=dict)
    threads: int | None = None
    seconds: float | None = None  # what measuring took
    source: str = "measured"
    unsteady: tuple[str, ...] = ()  # figures other work on the machine kept moving: not to be relied on
    measured_at: float | None = None  # time.time() of the measurement
    load: float | None = None  # the 1-minute load average when it was measured

    def lost(self, shape: str) -> bool:
        """Whether ``shape``'s figures were timed but dropped as unsteady (see :meth:`steady_part`):
        a job whose estimate needs them follows the CPU's flags, unlike a shape never timed."""
        return any(shape in _COVERS.get(name, (name,)) for name in self.unsteady)

    def whole_unsteady(self) -> bool:
        """Whether nothing of it is to be used: every core was busy, or a part ran out of time."""
        return any(name.startswith("all ") or name.endswith("(out of time)") for name in self.unsteady)

    def steady_part(self) -> Calibration:
        """These figures less those other work kept moving: each name in ``unsteady`` drops the
        figures it covers ("s4": the streamed batch-4 step, plain and packed; "bf16 attention": that
        ratio), the names are kept, so :meth:`lost` says which a job cannot use."""
        gone = {shape for name in self.unsteady for shape in _COVERS.get(name, (name,))}
        speeds = {k: v for k, v in self.speeds.items() if k.partition(".")[2] not in gone and k not in gone}
        fp32 = {k: v for k, v in self.fp32.items() if k not in gone}
        memory = {k: v for k, v in self.memory.items() if f"mem.{k}" not in gone}
        return replace(self, speeds=speeds, fp32=fp32, memory=memory)

    def speed(self, dtype: str, shape: str) -> float | None:
        """``dtype``'s speed over fp32 at ``shape`` ("b1".."b8", "prompt", "attention"); None: not measured."""
        return self.speeds.get(f"{(short_name(dtype) if dtype in NAMES else dtype)}.{shape}")

    def summary(self) -> str:
        """One line: each half precision's figures, e.g. "bf16 decode 1.15x/1.02x/0.72x/0.55x (batch 1/2/4/8) ..."."""
        parts = []
        for short in ("bf16", "fp16"):
            decode = [self.speeds.get(f"{short}.b{b}") for b in (1, 2, 4, 8)]
            if all(v is None for v in decode):
                continue
            text = f"{short} decode {'/'.join(_times(v) for v in decode)} (batch 1/2/4/8)"
            prompt = self.speeds.get(f"{short}.prompt")
            if prompt is not None:
                text += f", prompt {prompt:.2f}x"
            attention = self.speeds.get(f"{short}.attention")
            if attention is not None:
                text += f", one-token attention by matmuls {attention:.2f}x fused sdpa"
            grouped = self.speeds.get(f"{short}.gqa")
            if grouped is not None:
                text += f", grouped-query heads as rows {grouped:.2f}x"
            streamed = [self.speeds.get(f"{short}.s{b}") for b in (1, 4)]
            if any(v is not None for v in streamed):
                text += f", weights streamed from memory {'/'.join(_times(v) for v in streamed)} (batch 1/4)"
            gemv = self.speeds.get(f"{short}.g1")
            if gemv is not None:
                text += f", batch 1 by torch's GEMV kernel {gemv:.2f}x"
            packed = self.speeds.get(f"{short}.p4")
            if packed is not None:
                text += f", batch 4 with packed weights {packed:.2f}x"
            upcast = self.speeds.get(f"{short}.up")
            if upcast is not None:
                text += f", prompt in fp32 from {short} weights {upcast:.2f}x"
            parts.append(text)
        if not parts:
            return "no figures"
        packed_fp32, streamed_fp32 = self.fp32.get("p4"), self.fp32.get("s4")
        if packed_fp32 and streamed_fp32:
            parts.append(f"fp32 batch 4 with packed weights {streamed_fp32 / packed_fp32:.2f}x")
        packed_prompt, prompt = self.fp32.get("pp"), self.fp32.get("prompt")
        if packed_prompt and prompt:
            parts.append(f"fp32 prompt with packed weights {prompt / packed_prompt:.2f}x")
        return "; ".join(parts) + " of fp32"

    def spec(self) -> str:
        """The figures as ``simulate("cpu,calib=...")`` takes them, so a report replays them; the
        shapes dropped as unsteady that decide a job (:meth:`lost`) as "lost:s4+prompt"."""
        entries = [f"{k}:{v:.4g}" for k, v in sorted(self.speeds.items())]
        entries += [f"fp32.{k}:{v:.4g}" for k, v in sorted(self.fp32.items())]
        entries += [f"mem.{k}:{v:.10g}" for k, v in sorted(self.memory.items())]
        lost = [shape for shape in LOSABLE if self.lost(shape)]
        return "/".join(entries + ([f"lost:{'+'.join(lost)}"] if lost else []))

    def to_dict(self) -> dict[str, Any]:
        return {
            "speeds": {k: round(v, 4) for k, v in sorted(self.speeds.items())},
            "fp32_seconds": {k: v for k, v in sorted(self.fp32.items())},
            "memory": {k: v for k, v in sorted(self.memory.items())},
            "threads": self.threads,
            "seconds": self.seconds,
            "source": self.source,
            "unsteady": list(self.unsteady),
            "load": self.load,
        }


def _times(speed: float | None) -> str:
    # A figure dropped as unsteady (Calibration.steady_part) shows as "-".
    return "-" if speed is None else f"{speed:.2f}x"


# fp32 step times used when a simulation gives speeds only: the shape of this machine's figures
# (2 cores, width 1024), relative to a batch-1 step. They only weigh prompt rows against steps.
DEFAULT_FP32 = {"b1": 1.0, "b2": 1.4, "b4": 1.6, "b8": 2.0, "prompt": 0.08}


# Plausible ranges of a figure read back (a cache file, a simulate() spec, a replayed report); a
# figure outside is damage or a typo, never a machine. A speed is a half precision's step time
# over fp32's: halving the bytes at most doubles a memory-bound step, and AMX or tensor-core matmuls
# run up to ~16x fp32, while bf16 emulated in software measures down to ~0.05x; 1/1000 to 1000 leaves
# two orders of magnitude beyond both. fp32 seconds of one step or prompt row are microseconds to
# seconds when measured, and relative (about 1) in a simulation: 1 ns to an hour.
SPEED_RANGE = (1e-3, 1e3)
SECONDS_RANGE = (1e-9, 3600.0)
SHAPES = frozenset(
    {"b1", "b2", "b4", "b8", "prompt", "pp", "up", "attention", "gqa", "s1", "s4", "g1", "p4", "sn1", "gn1"}
)
# The shapes a job's estimate is read from: one dropped as unsteady sends the job to the flags.
LOSABLE = ("b1", "b2", "b4", "b8", "prompt", "s1", "s4")
# Memory figures: bytes of a cache (1 KiB to 64 GiB), parameters of a timed set (one to 2**40), its
# matrices (one to 2**20), and GB/s read or packed (1 MB/s to 100 TB/s, beyond any memory).
MEMORY_RANGES = {
    "llc": (1024.0, 64.0 * 1024**3),
    "cache": (1.0, 2.0**40),
    "stream": (1.0, 2.0**40),
    "narrow_stream": (1.0, 2.0**40),
    "calls": (1.0, 2.0**20),
    "narrow": (1.0, 2.0**20),
    "read": (1e-3, 1e5),
    "pack": (1e-3, 1e5),
    "upcast": (1e-3, 1e5),
}


def check_figure(name: str, value: Any) -> float:
    """``value`` as the figure ``name`` ("bf16.b1", "fp32.prompt"), checked: a known name and a
    finite number within its plausible range. Raises ValueError naming the bad entry and the range.
    The one check for every figure read back: the cache, simulate()'s spec and a replayed report."""
    dtype, _, shape = name.partition(".")
    if dtype == "mem" and shape in MEMORY_RANGES:
        (low, high), what = MEMORY_RANGES[shape], "a memory figure"
    elif dtype not in ("bf16", "fp16", "fp32") or shape not in SHAPES:
        raise ValueError(
            f"{name!r}: a figure is dtype.shape with dtype bf16, fp16 or fp32 and shape one of "
            f"{', '.join(sorted(SHAPES))}, or mem.{'/mem.'.join(MEMORY_RANGES)}"
        )
    else:
        low, high = SECONDS_RANGE if dtype == "fp32" else SPEED_RANGE
        what = "seconds" if dtype == "fp32" else "a speed over fp32"
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is None or not low <= number <= high:  # NaN fails every comparison, so it lands here
        raise ValueError(f"{name}:{value!r} is not {what} from {low:g} to {high:g}")
    return float(number)


def parse_figures(text: str) -> Calibration:
    """A simulation's figures: "bf16.b1:1.15/bf16.b4:0.7/bf16.prompt:0.3" (speeds over fp32);
    "fp32.b1:..." entries give fp32 seconds; "lost:s4+prompt" shapes dropped as unsteady (a
    replayed report's). Raises ValueError naming the bad entry."""
    speeds: dict[str, float] = {}
    fp32 = dict(DEFAULT_FP32)
    memory: dict[str, float] = {}
    lost: tuple[str, ...] = ()
    form = "write dtype.shape:number, e.g. bf16.b1:1.15/bf16.prompt:0.3"
    for item in text.split("/"):
        name, sep, value = item.strip().partition(":")
        name = name.strip().lower()
        if name == "lost":
            lost = tuple(shape.strip() for shape in value.split("+"))
            if not set(lost) <= set(LOSABLE):
                raise ValueError(f"{item!r}: lost:shape+shape with shapes among {', '.join(LOSABLE)}")
            continue
        try:
            number = float(value) if sep else None
        except ValueError:
            number = None
        if number is None:
            raise ValueError(f"{item!r}: {form}, with dtype bf16, fp16 or fp32 and a positive number")
        try:
            number = check_figure(name, number)
        except ValueError as error:
            raise ValueError(f"{error}; {form}") from None
        if name.startswith("fp32."):
            fp32[name.removeprefix("fp32.")] = number
        elif name.startswith("mem."):
            memory[name.removeprefix("mem.")] = number
        else:
            speeds[name] = number
    for shape in lost:  # a lost shape's figures stay out, as they were when it was recorded
        fp32.pop(shape, None)
    return Calibration(speeds, fp32, memory, source="simulated", unsteady=lost)
