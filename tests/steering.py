"""Shared by the command and report tests: the variables that steer device choice, and colour codes."""

from __future__ import annotations

import re

from whichdevice.hardware.registry import backends

# Cleared so each test starts from a known environment.
STEERING = {
    *(var for b in backends() for var in b.visible_devices_env),
    "CUDA_DEVICE_ORDER",
    "WHICHDEVICE_DEVICE",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_TORCH_DEVICE",
    "PT_ENABLE_INT64_SUPPORT",
    "PYTORCH_ENABLE_MPS_FALLBACK",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NO_COLOR",
}
ANSI = re.compile(r"\033\[[0-9;]*m")
