"""Calibration figures the estimate's tests share: measured on this project's AMD EPYC (avx512_bf16,
2 cores), where bf16 wins everywhere, most when the weights stream from memory, and torch's own GEMV
kernel beats oneDNN's at one row."""

from whichdevice.model.step_weights import StepWeights

MEMORY = "mem.llc:33554432/mem.cache:4194304/mem.stream:33554432/mem.read:30"
FP32 = "fp32.b1:0.0011/fp32.b2:0.0012/fp32.b4:0.0016/fp32.b8:0.002/fp32.prompt:0.00009/fp32.s1:0.0085/fp32.s4:0.025"
EPYC = (
    "bf16.b1:1.3/bf16.b2:3.0/bf16.b4:2.8/bf16.b8:2.4/bf16.prompt:2.5/bf16.s1:1.9/bf16.s4:4.8/bf16.g1:3.5/"
    f"bf16.attention:3.0/{FP32}/{MEMORY}"
)
BILLION = StepWeights(10**9)

# The same AMD EPYC with oneDNN and ATen held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), as
# an AVX2-only CPU runs: bf16 decode steps still win (half the bytes), a prompt-sized bf16 matmul runs at
# 0.28x fp32, and the same computed in fp32 from the bf16 weights copied into a reused buffer at 0.93x
# (the calibration's bf16 figures there, 6 December 2026, torch 2.13; fp32's and the memory's as EPYC's).
AVX2 = (
    "bf16.b1:3.5/bf16.b2:3.9/bf16.b4:1.6/bf16.b8:0.93/bf16.prompt:0.28/bf16.up:0.93/bf16.s1:3.5/bf16.s4:2.3/"
    f"bf16.g1:3.7/{FP32}/{MEMORY}/mem.upcast:32"
)
