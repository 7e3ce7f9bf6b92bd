"""A CUDA context tried in a child process: whether an exclusive-process GPU takes one now.

Lightning's ``find_usable_cuda_devices()`` tries each GPU with ``torch.tensor(0, device=...)`` in
the caller's process; that initialises CUDA there (a later ``fork`` then fails) and, on an
exclusive-process GPU that is free, keeps it for the caller. The same try runs here in a fresh
interpreter, with the caller's environment (so ``CUDA_VISIBLE_DEVICES`` numbers the GPUs as the
caller's torch does), within a time limit; its contexts end with it. Only the GPUs in an exclusive
compute mode that this process does not hold are tried (compute_mode.needs_trial), so a machine
in the default mode never pays for the child.

Between the child's exit and the caller's first CUDA call another process may take the GPU, as
Lightning's own docstring warns; the answer is what was true when probed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["TRIAL_LIMIT_S", "try_contexts"]

# Importing torch and making one context per GPU: seconds on a warm disk; past this the child is
# killed and the GPUs it did not answer for are reported as not answered.
TRIAL_LIMIT_S = 60.0

_CHILD = r"""
import json, os, sys
if sys.platform.startswith("linux"):
    try:  # die with the parent (PR_SET_PDEATHSIG = 1)
        import ctypes, signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass
spec = json.loads(sys.stdin.readline())
sys.path[:] = spec["path"]
import torch
for index in spec["indices"]:
    try:
        torch.zeros(1, device=torch.device("cuda", index))  # what Lightning's try does
        said = ""
    except Exception as exc:
        lines = str(exc).strip().splitlines() or [""]
        said = f"{type(exc).__name__}: {lines[0]}"[:300]
    print(json.dumps({"index": index, "said": said}), flush=True)
"""


def try_contexts(indices: Sequence[int], timeout: float = TRIAL_LIMIT_S) -> dict[int, str | None]:
    """Index -> "" where a context was made on that visible GPU, what torch said where it failed, or
    None where the child gave no answer for it (it did not start, or ran past ``timeout``)."""
    if not indices:
        return {}
    # torch's backend plugins stay unloaded in the child: a vendor plugin must not decide a CUDA answer.
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    spec = json.dumps({"path": sys.path, "indices": list(indices)})
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=spec + "\n",
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        out = done.stdout
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out = text
    except OSError:
        return dict.fromkeys(indices)
    answers: dict[int, str | None] = {}
    for line in out.splitlines():
        try:
            found = json.loads(line)
            answers[int(found["index"])] = str(found["said"])
        except (ValueError, KeyError, TypeError):
            continue  # a line torch or a library printed: not the protocol's
    # No answer (the child hung, or died before it got there) is no evidence either way.
    return {index: answers.get(index) for index in indices}
