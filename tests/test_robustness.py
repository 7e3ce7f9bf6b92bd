"""Broken packages, forks, threads and the environment: whichdevice contains failures and changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import whichdevice as wd
from whichdevice.hardware import probing


def _stub_package(tmp_path, monkeypatch, name: str, body: str) -> None:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_real_package_that_fails_to_import(tmp_path, monkeypatch):
    _stub_package(tmp_path, monkeypatch, "torch_npu", "raise ImportError('libhccl.so: cannot open shared object file')")
    result = wd.probe("npu")
    assert result.installed and not result.available
    assert "libhccl.so" in result.reason and "pip install torch-npu" in result.reason
    res = wd.resolve_device()
    assert res.device == "cpu"
    assert "libhccl.so" in res.explain()
    with pytest.raises(wd.DeviceUnavailableError, match=r"libhccl\.so"):
        wd.resolve_device("npu")


def test_real_package_that_prints_and_exits(tmp_path, monkeypatch, capsys):
    _stub_package(tmp_path, monkeypatch, "torch_mlu", "print('MLU driver not found, exiting')\nimport sys\nsys.exit(3)")
    result = wd.probe("mlu")
    assert not result.available and "sys.exit(3)" in result.reason
    assert wd.resolve_device().device == "cpu"


def test_real_package_that_hangs_on_import(tmp_path, monkeypatch):
    _stub_package(tmp_path, monkeypatch, "torch_musa", "import time\ntime.sleep(2)")
    probing.set_probe_timeout(0.5)
    res = wd.resolve_device()
    assert res.device == "cpu"
    assert "did not finish within 0.5 s" in res.explain()
    # The abandoned import finishes in its own thread; wait for it so later tests see no stub.
    for thread in threading.enumerate():
        if thread.name == "whichdevice-probe-musa":
            thread.join(10)
    sys.modules.pop("torch_musa", None)


_FORK_SCRIPT = """
import multiprocessing, os, sys
import torch
import whichdevice as wd

def child(queue):
    import torch as child_torch
    import whichdevice as child_wd
    res = child_wd.resolve_device()
    layer = child_torch.nn.Linear(8, 8).to(res.device, res.dtype)
    out = layer(child_torch.ones(2, 8, device=res.device, dtype=res.dtype))
    queue.put((res.device, str(out.dtype), tuple(out.shape)))

if __name__ == "__main__":
    wd.resolve_device()
    assert not torch.cuda.is_initialized()
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
    print(queue.get(timeout=5), torch.cuda.is_initialized())
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method needs POSIX")
# Only the kinds that reach a child process (a simulation stays in this one).
@pytest.mark.parametrize("cpu_kind", ["this", "no-native-bf16"], indirect=True)
def test_fork_after_resolving(tmp_path, cpu_kind):
    # A fresh parent process: the test runner's own process has used torch's OpenMP pool in
    # earlier tests, and forking after that hangs any child that computes (a torch/OpenMP rule,
    # nothing whichdevice does), so the proof runs where only whichdevice touched torch.
    script = tmp_path / "fork_check.py"
    script.write_text(_FORK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"('cpu', 'torch.{cpu_kind.dtype}', (2, 8)) False"


def test_nvml_switch_keeps_the_users_value(monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    wd.resolve_device(refresh=True)
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


def test_32_threads_resolve_identically():
    barrier = threading.Barrier(32)
    results: list = [None] * 32

    def work(i: int) -> None:
        barrier.wait()
        results[i] = wd.resolve_device()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results)
    assert len({(r.device, r.dtype_name, r.attn_implementation, r.device_map) for r in results}) == 1
    assert len({id(r.probe) for r in results}) == 1
    assert all(count == 1 for count in probing.probe_counts().values())


def test_resolving_leaves_the_environment_byte_identical():
    before = dict(os.environ)
    for task in ("inference", "training"):
        wd.resolve_device(task=task, refresh=True).explain()
    wd.probe_all(refresh=True)
    assert dict(os.environ) == before


def test_hooks_never_overwrite_user_values(monkeypatch):
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "0")
    monkeypatch.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "0")
    with wd.testing.simulate("hpu:8", "mps"):
        wd.resolve_device()
        wd.resolve_device("mps")
    assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "0"
    assert os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] == "0"
