"""Whether this process can use a GPU, from its compute mode and who holds it: pure rules on readings.

Free memory is not enough. An NVIDIA GPU in exclusive-process compute mode takes one process's
context at a time: while another process holds it, it still reports free memory and fails only at
this process's first CUDA call ("CUDA-capable device(s) is/are busy or unavailable"). A GPU in the
prohibited mode takes no context at all. The readers (nvidia.py, cuda.py) read the mode from NVML,
nvidia-smi or, after the user's own CUDA init, the driver; an exclusive-process GPU that this process
does not hold is also tried in a child process (cuda_trial.py), as Lightning's
``find_usable_cuda_devices()`` tries each GPU, because NVML's list of processes is empty in a
container that does not share the host's process namespace.
"""

from __future__ import annotations

from whichdevice.hardware.probes.readings import DeviceReading

__all__ = ["EXCLUSIVE_MODES", "needs_trial", "unusable_reason"]

# The modes in which one process's context keeps every other process out (exclusive_thread is
# NVIDIA's legacy variant of exclusive_process; current drivers no longer offer it).
EXCLUSIVE_MODES = ("exclusive_process", "exclusive_thread")


def needs_trial(reading: DeviceReading) -> bool:
    """Whether a context must be tried in a child process to know if this process can use the GPU."""
    return reading.compute_mode in EXCLUSIVE_MODES and not reading.own_context and reading.trial is None


def unusable_reason(reading: DeviceReading) -> str | None:
    """Why this process cannot make a context on the GPU ``reading`` describes (None: it can, as far as known)."""
    mode = reading.compute_mode
    if mode == "prohibited":
        return (
            "its compute mode is Prohibited: no process may use it (an administrator's `nvidia-smi -i <gpu> "
            "-c DEFAULT` allows it again)"
        )
    if mode not in EXCLUSIVE_MODES or reading.own_context:
        return None
    if reading.trial == "":
        return None  # the child made its context: no process holds the GPU now
    held = reading.other_processes
    who = f"{held} other process{'es' if held != 1 else ''}" if held else "another process"
    if reading.trial:
        return (
            f"exclusive-process compute mode and {who} holds it: a context tried in a child process "
            f"failed ({reading.trial})"
        )
    if held:
        return f"exclusive-process compute mode and {who} holds it (NVML lists {held})"
    return None
