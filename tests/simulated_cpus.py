"""Simulated CPU calibrations shared by tests: figures pinned so an answer does not depend on this CPU."""

from __future__ import annotations

# A CPU whose calibration hands over the single-row hook at batch 1 and packed weights at batch 4
# (about 180 new tokens after an 8-token prompt repay the packing of a tiny model), with a 1 KiB
# cache so that a tiny model's weights stream from memory as a real model's do.
PACKS = (
    "cpu,flags=avx512_bf16,calib=bf16.b1:1.3/bf16.b2:3/bf16.b4:2.8/bf16.b8:2.4/bf16.prompt:2.5/bf16.s1:1.9/"
    "bf16.s4:4.8/bf16.g1:3.5/bf16.p4:7/fp32.b1:0.0011/fp32.b2:0.0012/fp32.b4:0.0016/fp32.b8:0.002/"
    "fp32.prompt:0.00009/fp32.s1:0.0085/fp32.s4:0.025/fp32.p4:0.0076/mem.pack:2/"
    "mem.llc:1024/mem.cache:4194304/mem.stream:33554432"
)

# The same CPU without native bf16 and with only fp32 timed: it hands over packed fp32 weights at batch 4,
# which oneDNN packs on every CPU torch builds it for, so what a test expects of the packing holds on
# every machine (PACKS's bf16 packing happens only where this CPU's oneDNN packs bf16).
PACKS_FP32 = (
    "cpu,flags=,calib=fp32.b1:0.0011/fp32.b2:0.0012/fp32.b4:0.0016/fp32.b8:0.002/fp32.prompt:0.00009/"
    "fp32.s1:0.0085/fp32.s4:0.025/fp32.p4:0.0076/mem.pack:2/mem.llc:1024/mem.cache:4194304/mem.stream:33554432"
)
