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
