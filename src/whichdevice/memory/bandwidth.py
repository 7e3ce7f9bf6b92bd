"""The decode speed limit of a device: its memory bandwidth over the bytes one token reads.

Generating one token reads every weight it uses once (for a mixture of experts, the shared weights
and the experts a token is routed to) and the KV cache of the tokens before it. At batch 1 that read
is the limit: tokens/s <= bandwidth / bytes per token. Real runs reach 50-80% of it (kernel
efficiency, the link between devices); the figure says which device can keep up, not a benchmark.

The bandwidths are the vendors' datasheet figures, one row a device with its source; a device no row
matches has no figure (fails closed: "-" and why). The CPU's is the read bandwidth the calibration
measured here, where it ran.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from whichdevice.core.frozen import NamedTuple

__all__ = ["BANDWIDTHS", "Bandwidth", "bandwidth_of", "bytes_per_token"]


class Bandwidth(NamedTuple):
    pattern: str  # searched in the device name the probe reports, case-insensitively
    gb_per_s: float  # memory bandwidth of one device, 10^9 bytes/s
    source: str


# First match wins: the more specific names come first.
BANDWIDTHS: tuple[Bandwidth, ...] = (
    Bandwidth(r"\bT4\b", 320, "NVIDIA T4 datasheet: 320 GB/s GDDR6"),
    Bandwidth(r"\bL4\b", 300, "NVIDIA L4 datasheet: 300 GB/s GDDR6"),
    Bandwidth(r"\bA10G\b", 600, "AWS EC2 G5 / NVIDIA A10 datasheet: 600 GB/s GDDR6"),
    Bandwidth(r"\bRTX 4090\b", 1008, "NVIDIA GeForce RTX 4090 specifications: 1008 GB/s GDDR6X"),
    Bandwidth(r"A100.*40\s*GB", 1555, "NVIDIA A100 datasheet (SXM4 40GB): 1555 GB/s HBM2"),
    Bandwidth(r"\bA100\b", 2039, "NVIDIA A100 datasheet (SXM4 80GB): 2039 GB/s HBM2e"),
    Bandwidth(r"(?<!G)\bH200\b", 4800, "NVIDIA H200 datasheet (SXM): 4.8 TB/s HBM3e"),
    Bandwidth(r"\bH100\b", 3350, "NVIDIA H100 datasheet (SXM5 80GB): 3.35 TB/s HBM3"),
    Bandwidth(r"\bMI300X\b", 5300, "AMD Instinct MI300X datasheet: 5.3 TB/s HBM3"),
    Bandwidth(r"GAUDI\s*2", 2450, "Intel Gaudi 2 datasheet: 2.45 TB/s HBM2e"),
    Bandwidth(r"GAUDI\s*3", 3700, "Intel Gaudi 3 AI accelerator white paper: 3.7 TB/s HBM2e"),
    Bandwidth(r"TPU v5 ?(e|lite)", 819, "Google Cloud TPU v5e documentation: 819 GB/s HBM2 per chip"),
    Bandwidth(r"Trainium\s*2", 2900, "AWS Trainium2 (Trn2 instances): 2.9 TB/s HBM per chip"),
    Bandwidth(r"Trainium\s*1?\b", 820, "AWS Trainium (Trn1 instances): 820 GB/s HBM per chip"),
    Bandwidth(r"\bM3 Max\b", 400, "Apple M3 Max (16-core CPU) specifications: 400 GB/s unified memory"),
    Bandwidth(r"\bM2 Ultra\b", 800, "Apple M2 Ultra specifications: 800 GB/s unified memory"),
    Bandwidth(r"\bM4 Pro\b", 273, "Apple M4 Pro specifications: 273 GB/s unified memory"),
)


def bandwidth_of(name: str | None) -> Bandwidth | None:
    """The row for a device called ``name`` (as its probe reports it), or None: no figure."""
    if not name:
        return None
    return next((row for row in BANDWIDTHS if re.search(row.pattern, name, re.IGNORECASE)), None)


def _routed_share(config: Mapping[str, Any] | None) -> float | None:
    """The share of the experts one token is routed to (top-k / experts), None for a dense model."""
    if config is None:
        return None
    inner = config.get("text_config")
    text: Mapping[str, Any] = inner if isinstance(inner, dict) else config
    experts = next((text.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if text.get(k)), None)
    top_k = text.get("num_experts_per_tok")
    if isinstance(experts, int) and isinstance(top_k, int) and 0 < top_k <= experts:
        return top_k / experts
    return None


def bytes_per_token(
    headers: Sequence[Mapping[str, Mapping[str, Any]]], config: Mapping[str, Any] | None, weights: int
) -> tuple[int, str]:
    """The weight bytes one decode token reads of ``weights`` loaded bytes: all of them, or for a
    mixture of experts the non-expert weights and top-k / experts of the expert weights (the
    tensors named ``.experts.`` in the safetensors headers). With the reason in words."""
    share = _routed_share(config)
    if share is None or not headers:
        return weights, "every weight"
    count = expert = 0
    for header in headers:
        for name, info in header.items():
            n = 1
            for d in info["shape"]:
                n *= d
            count += n
            if ".experts." in name:
                expert += n
    if not count or not expert:
        return weights, "every weight"
    fraction = (count - expert + expert * share) / count
    return int(weights * fraction), f"the shared weights and {share:.0%} of the experts' ({fraction:.0%} of all)"
