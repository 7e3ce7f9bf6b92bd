"""``whichdevice calibrate``'s text: the CPU calibration's figures as a table, with what each column times."""

from __future__ import annotations

from whichdevice.measure.calibration import Calibration, calibration_enabled

__all__ = ["render_calibration"]


def render_calibration(calib: Calibration) -> str:
    """``whichdevice calibrate``'s text: each dtype's speed over fp32 per shape, and where it went."""
    lines = [f"CPU calibration, {calib.threads} torch threads ({calib.source})", ""]
    for shapes, heads in (
        (
            ["b1", "b2", "b4", "b8", "prompt", "up", "attention", "gqa"],
            ["decode b1", "decode b2", "decode b4", "decode b8", "prompt", "prompt fp32", "attention*", "grouped*"],
        ),
        (
            ["s1", "s4", "g1", "p4", "pp", "sn1", "gn1"],
            ["streamed b1", "streamed b4", "GEMV b1**", "packed b4***", "packed pr***", "narrow b1", "GEMV nb1"],
        ),
    ):
        lines.append(f"{'':6}" + "".join(f"{h:>13}" for h in heads))
        for short in ("bf16", "fp16"):
            cells = [_cell(calib.speeds.get(f"{short}.{s}")) for s in shapes]
            lines.append(f"{short:6}" + "".join(f"{c:>13}" for c in cells))
    lines += [
        "",
        "speed over fp32 at the same shape (above 1.00x: faster); decode bN: one step of a batch of N",
        "with weights in the cache, streamed bN: with weights streamed from memory; prompt: a 128-row",
        "matmul; prompt fp32: the same computed in fp32 from the bf16 weights copied into a reused fp32",
        "buffer each call (what prepare() runs for prompts where bf16 arithmetic is slow); *attention: a",
        "one-token query by plain matmuls over torch's fused kernel (a multi-head model's decode step",
        "when asked for whichdevice_sdpa), grouped: the fused kernel with 32 query",
        "heads as rows of their 4 key/value heads over one row per head (a grouped-query model's);",
        "**GEMV b1: a streamed batch-1 step through torch's own GEMV kernel (oneDNN off);",
        "***packed b4, pr: a streamed batch-4 step, the prompt, with weights packed in oneDNN's layout;",
        "narrow b1, GEMV nb1: streamed b1 and GEMV b1 again on the same memory in 256x768 matrices",
    ]
    packed_fp32, streamed_fp32 = calib.fp32.get("p4"), calib.fp32.get("s4")
    if packed_fp32 and streamed_fp32:
        lines.append(f"fp32 packed b4: {streamed_fp32 / packed_fp32:.2f}x fp32's own streamed b4")
    packed_prompt, prompt = calib.fp32.get("pp"), calib.fp32.get("prompt")
    if packed_prompt and prompt:
        lines.append(f"fp32 packed prompt: {prompt / packed_prompt:.2f}x fp32's own prompt")
    llc, read = calib.memory.get("llc"), calib.memory.get("read")
    if llc is not None and read is not None:
        lines.append(
            f"memory: {read:.1f} GB/s read by {calib.threads} threads, last-level cache {llc / 1024**2:.0f} MiB"
        )
    if calib.memory.get("pack") is not None:
        lines.append(f"packing weights: {calib.memory['pack']:.2f} GB/s")
    if calib.whole_unsteady():
        lines.append(f"not steady: {', '.join(calib.unsteady)}; resolve_device() keeps to the CPU's flags")
    elif calib.unsteady:
        lines.append(
            f"not steady: {', '.join(calib.unsteady)}; not used, and jobs whose estimate needs them keep to the "
            "CPU's flags"
        )
    enabled, off = calibration_enabled()
    if not enabled:
        lines.append(f"{off}: resolve_device() keeps to the CPU's flags")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
