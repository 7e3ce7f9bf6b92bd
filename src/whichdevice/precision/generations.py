"""Which half precision each GPU generation computes fast, from the vendors' published figures.

Typed, because no installed package states it; each row cites its source and anything not in a row
falls back to the capability rules in precision/hardware.py (fail closed: no row, no claim).

NVIDIA: CUDA C++ Programming Guide, "Arithmetic Instructions", throughput table (results per clock
cycle per multiprocessor): 16-bit floating-point add/multiply/multiply-add is N/A on 5.0 and 5.2,
256 on 5.3, 128 on 6.0, 2 on 6.1 and 256 on 6.2, against 32-bit floating-point at 128, 64, 128 and
128. AMD: the CDNA (MI100) white paper, "AMD CDNA Architecture" (2020): peak FP16 matrix 184.6
TFLOPS against bf16 92.3 TFLOPS; the RDNA 2 ISA reference (2020) has packed fp16 dot products and no
bf16 arithmetic or matrix instructions (bf16 WMMA arrives with RDNA 3).
"""

from __future__ import annotations

from whichdevice.core.frozen import NamedTuple

__all__ = ["NVIDIA_FP16_RATE", "amd_half_precision", "nvidia_fp16"]

_GUIDE = "CUDA C++ Programming Guide, arithmetic instruction throughput"

# compute capability -> fp16 throughput relative to fp32 (None: no fp16 arithmetic)
NVIDIA_FP16_RATE: dict[tuple[int, int], float | None] = {
    (5, 0): None,
    (5, 2): None,
    (5, 3): 256 / 128,
    (6, 0): 128 / 64,
    (6, 1): 2 / 128,
    (6, 2): 256 / 128,
}


class Fp16Rate(NamedTuple):
    fast: bool
    why: str


def nvidia_fp16(cc: tuple[int, int]) -> Fp16Rate | None:
    """fp16's speed on an NVIDIA GPU without tensor cores (None: not in the table)."""
    if cc not in NVIDIA_FP16_RATE:
        return None
    rate = NVIDIA_FP16_RATE[cc]
    text = f"{cc[0]}.{cc[1]}"
    if rate is None:
        return Fp16Rate(
            False,
            f"compute capability {text} has no fp16 arithmetic ({_GUIDE}: N/A): fp16 mixed precision runs "
            "with every fp16 operation converted to fp32, slower than fp32 alone",
        )
    if rate < 1:
        return Fp16Rate(
            False, f"fp16 arithmetic runs at 1/{round(1 / rate)} of fp32 on compute capability {text} ({_GUIDE})"
        )
    return Fp16Rate(True, f"fp16 arithmetic runs at {rate:g}x fp32 on compute capability {text} ({_GUIDE})")


def amd_half_precision(name: str | None, cc: tuple[int, int] | None) -> tuple[str, str] | None:
    """("float16", why) where an AMD GPU computes fp16 faster than bf16 (None: bf16 is as fast)."""
    if name and "MI100" in name.upper():
        return (
            "float16",
            "the MI100 computes bf16 natively, at half its fp16 rate (AMD CDNA white paper: peak fp16 matrix "
            "184.6 TFLOPS, bf16 92.3)",
        )
    if cc is not None and cc[0] == 10:
        return "float16", (
            f"gfx10 (RDNA 1/2, compute capability {cc[0]}.{cc[1]}): the RDNA 2 ISA has no bf16 arithmetic or matrix "
            "instructions, so bf16 is emulated; fp16 has packed dot products"
        )
    return None
