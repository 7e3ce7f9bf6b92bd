"""Whether torch.compile can build CUDA code on this machine: the triton package, the GPUs' compute
capability and ``TORCH_COMPILE_DISABLE``, each as torch itself decides it.

The static cache's hand-over (``tuning.static_cache``) asks here before passing a setting that makes
transformers' generate compile: where the compile cannot run, the first ``generate`` call would
raise inside it (or, with the compile turned off, run the static cache uncompiled and slower).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from whichdevice.core.packages import package_version, pip_install

if TYPE_CHECKING:
    from whichdevice.core.records import ProbeResult

__all__ = ["COMPILE_OFF_VARIABLE", "ENV_VARIABLES", "cannot_compile_here"]

# torch/_dynamo/config.py: `disable = os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"` turns
# torch.compile into a no-op, leaving generate a static cache uncompiled: slower than its own.
COMPILE_OFF_VARIABLE = "TORCH_COMPILE_DISABLE"
ENV_VARIABLES = (COMPILE_OFF_VARIABLE,)
# torch/utils/_triton.py, has_triton(): inductor generates CUDA code with the triton package, on
# devices of compute capability 7.0 or more (cuda_extra_check, `major >= 7`); without either the
# first compiled decode step raises inside the user's generate call.
_TRITON_CAPABILITY = (7, 0)


def cannot_compile_here(result: ProbeResult) -> str | None:
    """Why torch.compile cannot build generate's decode step on these GPUs, or None: handing the
    static cache over would then crash the job (no triton, too old a GPU) or slow it (compile off)."""
    if os.environ.get(COMPILE_OFF_VARIABLE, "0") == "1":
        return (
            f"{COMPILE_OFF_VARIABLE}=1 turns torch.compile off, and a static cache uncompiled decoded "
            "0.53-0.84x generate's own cache"
        )
    if package_version("triton") is None:
        return (
            "torch.compile builds CUDA kernels with triton, which is not installed "
            f"({pip_install('triton')}, at the version your torch build requires)"
        )
    capability = result.min_capability
    if capability is None or capability < _TRITON_CAPABILITY:
        have = (
            "an unknown compute capability"
            if capability is None
            else f"compute capability {capability[0]}.{capability[1]}"
        )
        need = f"{_TRITON_CAPABILITY[0]}.{_TRITON_CAPABILITY[1]}"
        return f"torch.compile's triton needs compute capability {need} or more, and a GPU here has {have}"
    return None
