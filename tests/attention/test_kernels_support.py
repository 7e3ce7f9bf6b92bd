"""Hub kernels (use_kernels) and FlashAttention from the Hub (attn_implementation="auto-hub").

The installed kernels (0.17.2) is older than the installed transformers accepts, so the real
machine covers the incompatible case; the compatible case simulates the package metadata.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import whichdevice as wd
from kernels_versions import GOOD_KERNELS, at_maximum, below_range, inside_range
from whichdevice.attention import choose as attention
from whichdevice.attention import kernels as kernels_support
from whichdevice.core.packages import package_version, simulated_packages
from whichdevice.testing import simulate


@pytest.fixture
def compatible_kernels() -> Iterator[None]:
    """Pretend the kernels package is one transformers accepts (metadata only; nothing is imported)."""

    with simulated_packages({"kernels": GOOD_KERNELS}):
        yield


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LOCAL_KERNELS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def offline_empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.delenv("KERNELS_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def _kernels_line(res: wd.Resolution) -> str:
    return next(s.message for s in res.trace if s.topic == "kernels")


def _attention_line(res: wd.Resolution) -> str:
    return next(s.message for s in res.trace if s.topic == "attention")


# --------------------------------------------------------------- the version range, for real


def test_range_is_the_one_transformers_checks():
    from transformers.utils import import_utils

    assert kernels_support.transformers_kernels_range() == (
        import_utils.KERNELS_MIN_VERSION,
        import_utils.KERNELS_MAX_VERSION,
    )


def test_installed_kernels_is_too_old_and_the_trace_says_exactly_that():
    from transformers.utils import import_utils

    installed, tf = package_version("kernels"), package_version("transformers")
    low, high = import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION
    if installed is None or import_utils.is_kernels_available():
        pytest.skip("this test is about an installed kernels that transformers rejects")
    ok, why = kernels_support.kernels_compatibility()
    expected = f"kernels {installed} is installed but transformers {tf} wants kernels>={low},<{high}"
    assert not ok and why.startswith(expected) and f"pip install 'kernels>={low},<{high}'" in why
    for spec in ("cuda:1", "cpu"):
        with simulate(spec):
            res = wd.resolve_device(use_kernels="auto")
        assert res.use_kernels is False and expected in _kernels_line(res)
        assert "use_kernels" not in res.model_kwargs()
    with simulate("cuda:1"), pytest.raises(wd.ConfigConflictError, match=re.escape(expected)):
        wd.resolve_device(use_kernels=True)


def test_kernels_not_installed():
    with simulated_packages({"kernels": None}):
        ok, why = kernels_support.kernels_compatibility()
    assert not ok and "kernels package is not installed" in why and "pip install 'kernels>=" in why


@pytest.mark.parametrize(
    ("version", "ok"), [(GOOD_KERNELS, True), (inside_range(), True), (at_maximum(), False), (below_range(), False)]
)
def test_version_edges(version, ok):
    with simulated_packages({"kernels": version}):
        assert kernels_support.kernels_compatibility()[0] is ok


# ------------------------------------------------------------ use_kernels="auto", simulated

# spec -> kernels device key (None: Hub kernels have no key for the backend)
KEYS = [
    ("cuda:1", "cuda"),
    ("cuda:2,variant=rocm", "rocm"),
    ("xpu:1", "xpu"),
    ("npu:1", "npu"),
    ("neuron:2", "neuron"),
    ("tpu:4", "tpu"),
    ("mps", "mps"),
    ("hpu:8", None),
    ("mlu:1", None),
    ("musa:1", None),
    ("cpu", None),
]


@pytest.mark.parametrize(("spec", "key"), KEYS, ids=[k[0] for k in KEYS])
def test_auto_kernels_per_backend_when_compatible(compatible_kernels, online, spec, key):
    with simulate(spec):
        res = wd.resolve_device(use_kernels="auto")
    assert res.kernels_key == key
    data = json.loads(json.dumps(res.to_dict()))
    assert data["use_kernels"] is (key is not None) and data["kernels_key"] == key
    line = _kernels_line(res)
    if key is None:
        assert line.startswith("Hub kernels off") and f"no device key for {res.backend.name}" in line
        assert "use_kernels" not in res.model_kwargs()
        with simulate(spec), pytest.raises(wd.ConfigConflictError, match="no device key"):
            wd.resolve_device(use_kernels=True)
    else:
        assert line.startswith("Hub kernels on") and f"kernel device key {key!r}" in line
        assert f"kernels {GOOD_KERNELS} is within" in line and "download on first use" in line
        assert res.model_kwargs()["use_kernels"] is True


@pytest.mark.parametrize("spec", ["cuda:1", "xpu:1", "mps"])
def test_hub_kernels_are_off_unless_asked_for(compatible_kernels, online, spec):
    """transformers' own default: nothing is downloaded from the Hub and run unless the user opts in."""
    with simulate(spec):
        res = wd.resolve_device()
        asked = wd.resolve_device(use_kernels="auto")
    assert res.use_kernels is False and "use_kernels" not in res.model_kwargs()
    line = _kernels_line(res)
    assert "the default, as in transformers" in line and "use_kernels='auto' turns them on" in line
    assert asked.use_kernels is True and asked.model_kwargs()["use_kernels"] is True


def test_use_kernels_false_and_bad_values(compatible_kernels):
    with simulate("cuda:1"):
        res = wd.resolve_device(use_kernels=False)
        assert res.use_kernels is False and "use_kernels=False" in _kernels_line(res)
        with pytest.raises(wd.ConfigConflictError, match="'auto', True or False"):
            wd.resolve_device(use_kernels="yes")


def test_offline_without_cached_kernels_is_off(compatible_kernels, offline_empty_cache):
    with simulate("cuda:1"):
        res = wd.resolve_device(use_kernels="auto")
        assert res.use_kernels is False
        assert "HF_HUB_OFFLINE=1 and a kernels-community kernel is not in the cache" in _kernels_line(res)
        with pytest.raises(wd.ConfigConflictError, match="not in the cache"):
            wd.resolve_device(use_kernels=True)


def test_offline_with_cached_kernels_is_on(compatible_kernels, offline_empty_cache):
    (offline_empty_cache / "models--kernels-community--activation").mkdir()
    with simulate("cuda:1"):
        res = wd.resolve_device(use_kernels="auto")
    assert res.use_kernels is True and "in the cache" in _kernels_line(res)


def test_kernels_cache_and_transformers_offline(compatible_kernels, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "kc"))
    assert kernels_support.hub_offline()
    assert kernels_support.kernels_cache_dir() == tmp_path / "kc"
    assert not kernels_support.hub_access()[0]
    (tmp_path / "kc" / "models--kernels-community--flash-attn2").mkdir(parents=True)
    assert kernels_support.hub_access()[0]
    assert kernels_support.hub_access("kernels-community/flash-attn2")[0]
    assert not kernels_support.hub_access("kernels-community/aiter-flash-attn")[0]


def test_local_kernels(compatible_kernels, offline_empty_cache, monkeypatch):
    monkeypatch.setenv("LOCAL_KERNELS", "kernels-community/flash-attn2=/opt/k/fa2:kernels-community/x=/opt/k/x")
    assert kernels_support.local_kernels() == {
        "kernels-community/flash-attn2": "/opt/k/fa2",
        "kernels-community/x": "/opt/k/x",
    }
    with simulate("cuda:1"):
        res = wd.resolve_device(use_kernels="auto")
    assert res.use_kernels is True and "LOCAL_KERNELS" in _kernels_line(res)
    ok, why = kernels_support.hub_access("kernels-community/flash-attn2")
    assert ok and "/opt/k/fa2" in why
    assert not kernels_support.hub_access("kernels-community/aiter-flash-attn")[0]  # offline, not local


def test_deciding_never_touches_the_network(compatible_kernels, online, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("whichdevice opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub", use_kernels="auto", model=llama_config())
    assert res.use_kernels is True and res.attn_implementation == "kernels-community/flash-attn2"


# ------------------------------------------------------------------ attention from the Hub

# spec -> what attn_implementation="auto-hub" resolves to with a compatible kernels, online
HUB_ATTENTION = [
    ("cuda:1,cc=8.0", "kernels-community/flash-attn2", None),
    ("cuda:1,cc=9.0", "kernels-community/flash-attn2", None),
    ("cuda:2,variant=rocm", "kernels-community/aiter-flash-attn", None),
    ("xpu:1", "kernels-community/flash-attn2", None),
    ("cuda:1,cc=7.5", None, "compute capability 8.0 or newer; this GPU has 7.5"),
    # npu: torch_npu serves FlashAttention-2 itself (tests/attention/test_attention_support.py), no Hub kernel
    ("mps", None, "no flash_attention_2 Hub kernel is built for mps"),
    ("neuron:2", None, "no flash_attention_2 Hub kernel is built for neuron"),
    ("hpu:8", None, "no flash_attention_2 Hub kernel is built for hpu"),
    ("cpu", None, "no flash_attention_2 Hub kernel is built for cpu"),
]


def llama_config():
    """A config whose classes (Llama*) support sdpa and FlashAttention on the installed transformers."""
    from tiny_models import tiny_config

    return tiny_config()


@pytest.mark.parametrize(("spec", "impl", "why"), HUB_ATTENTION, ids=[h[0] for h in HUB_ATTENTION])
def test_auto_hub_attention(compatible_kernels, online, spec, impl, why):
    # fp32 on the CPU: in half precision it gets its decode attention (tests/attention/test_decode_attention.py)
    dtype = "float32" if spec == "cpu" else "auto"
    with simulate(spec):
        res = wd.resolve_device(attn_implementation="auto-hub", model=llama_config(), dtype=dtype)
        plain = wd.resolve_device(model=llama_config(), dtype=dtype)
    line = _attention_line(res)
    if impl is not None:
        assert res.attn_implementation == impl and res.model_kwargs()["attn_implementation"] == impl
        assert "auto-hub' opts in" in line and "download on first use" in line
        assert "supported by LlamaForCausalLM" in line
    else:
        # transformers' own choice for Llama, not passed
        assert res.attn_implementation == "sdpa" and "attn_implementation" not in res.model_kwargs()
        assert why in line and "found no Hub kernel" in line
    # never by surprise: plain "auto" leaves sdpa to transformers even where a Hub kernel would serve
    assert plain.attn_implementation == "sdpa" and "attn_implementation" not in plain.model_kwargs()


def test_auto_hub_without_a_model_is_not_passed(compatible_kernels, online):
    """Without model= the architecture's FlashAttention support cannot be read: nothing is passed."""
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub")
    assert res.attn_implementation is None and "attn_implementation" not in res.model_kwargs()
    assert "kernels-community/flash-attn2 would fit" in _attention_line(res)
    assert "pass model= to get it" in _attention_line(res)


def test_auto_hub_for_a_model_without_flash_attention_support(compatible_kernels, online):
    from transformers import BloomConfig

    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub", model=BloomConfig(n_layer=2, hidden_size=64))
    assert res.attn_implementation == "eager" and "attn_implementation" not in res.model_kwargs()
    assert "kernels-community/flash-attn2 not passed: BloomForCausalLM" in _attention_line(res)
    assert "_supports_flash_attn=False" in _attention_line(res)


def test_auto_hub_needs_half_precision(compatible_kernels, online):
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub", dtype="float32", model=llama_config())
    assert res.attn_implementation == "sdpa" and "needs fp16 or bf16" in _attention_line(res)


def test_auto_hub_offline_uses_only_a_cached_kernel(compatible_kernels, offline_empty_cache):
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub", model=llama_config())
    assert res.attn_implementation == "sdpa"
    assert "kernels-community/flash-attn2 is not in the cache" in _attention_line(res)
    (offline_empty_cache / "models--kernels-community--flash-attn2").mkdir()
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub", model=llama_config())
    assert res.attn_implementation == "kernels-community/flash-attn2"


def test_auto_hub_with_the_installed_kernels_falls_back_to_sdpa(online):
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        pytest.skip("the installed kernels is compatible here")
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub", model=llama_config())
    assert res.attn_implementation == "sdpa"
    installed = package_version("kernels")
    if installed is None:
        assert "the kernels package is not installed" in _attention_line(res)
    else:
        assert f"kernels {installed} is installed but transformers" in _attention_line(res)


def test_auto_hub_prefers_an_installed_flash_attn(compatible_kernels, online):
    with simulated_packages({"flash-attn": "2.8.3"}), simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="auto-hub", model=llama_config())
    assert res.attn_implementation == "flash_attention_2"


def test_explicit_flash_attention_without_the_package(compatible_kernels, online):
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="flash_attention_2")
    assert res.attn_implementation == "flash_attention_2"
    assert "transformers loads the Hub kernel kernels-community/flash-attn2" in _attention_line(res)
    with simulate("npu:1"):
        res = wd.resolve_device(attn_implementation="flash_attention_2")
    assert "torch_npu's own FlashAttention" in _attention_line(res)


def test_explicit_flash_attention_that_will_fail_says_so(online):
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        pytest.skip("the installed kernels is compatible here")
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="flash_attention_2")
    line = _attention_line(res)
    assert "cannot use a Hub kernel instead" in line and "pip install flash-attn" in line


def test_a_hub_kernel_repo_is_accepted_as_attn_implementation(compatible_kernels, online):
    with simulate("cuda:1"):
        res = wd.resolve_device(attn_implementation="kernels-community/flash-attn2")
    assert res.attn_implementation == "kernels-community/flash-attn2"
    assert "a Hub kernel, as you asked" in _attention_line(res)
    assert attention.is_hub_kernel("kernels-community/flash-attn2@v2:flash_attn")
    assert not attention.is_hub_kernel("flash_attention_2")
    with pytest.raises(wd.DeviceError, match="auto-hub"):
        wd.resolve_device(attn_implementation="flash")


# spec, request -> what the error must name as working instead
FLASH_ERRORS = [
    ("cuda:1,cc=8.0", "flash_attention_3", "9.0 or newer; this GPU has 8.0; use 'flash_attention_2' or 'sdpa'"),
    ("cuda:1,cc=8.6", "flash_attention_4", "9.0 or newer; this GPU has 8.6; use 'flash_attention_2' or 'sdpa'"),
    ("cuda:1,cc=7.5", "flash_attention_2", "8.0 or newer; this GPU has 7.5; use 'sdpa'"),
    ("cuda:1,cc=10.0", "flash_attention_3", "Hopper (compute capability 9.x); use 'flash_attention_4', 'flash_attent"),
    ("xpu:1", "flash_attention_4", "does not run on xpu (CUDA GPUs only); use 'flash_attention_2' or 'sdpa'"),
    ("npu:1", "flash_attention_3", "does not run on npu (CUDA GPUs only); use 'flash_attention_2' or 'sdpa'"),
    ("hpu:8", "flash_attention_3", "does not run on hpu (CUDA GPUs only); use 'sdpa'"),
    ("mps", "flash_attention_2", "does not run on mps"),
    ("cpu", "flash_attention_2", "does not run on cpu"),
    ("cuda:2,variant=rocm", "flash_attention_4", "NVIDIA CUDA GPUs only; use 'flash_attention_2' or 'sdpa'"),
]


@pytest.mark.parametrize(("spec", "impl", "says"), FLASH_ERRORS, ids=[f"{f[0]}-{f[1]}" for f in FLASH_ERRORS])
def test_flash_attention_requests_that_cannot_work_name_what_would(spec, impl, says):
    with simulate(spec), pytest.raises(wd.ConfigConflictError) as err:
        wd.resolve_device(attn_implementation=impl)
    assert says in str(err.value)


def test_fa3_and_fa4_are_accepted_where_they_run(online):
    with simulate("cuda:1,cc=9.0"):
        assert wd.resolve_device(attn_implementation="flash_attention_3").attn_implementation == "flash_attention_3"
    with simulate("cuda:1,cc=10.0"):
        assert wd.resolve_device(attn_implementation="flash_attention_4").attn_implementation == "flash_attention_4"


# ------------------------------------------------------- the static copies match transformers


def test_hub_flash_tables_match_transformers():
    from transformers import modeling_flash_attention_utils as fa

    for repo, keys in kernels_support.HUB_FLASH_KERNEL_DEVICES.items():
        assert fa.FLASH_ATTN_KERNEL_DEVICES[repo] == keys, repo
    # FLASH_ATTN_KERNEL_FALLBACK was built for this (non-ROCm) machine: the "*" entries
    assert not fa.is_rocm_platform()
    for impl, choices in kernels_support.HUB_FLASH_ATTENTION.items():
        assert fa.FLASH_ATTN_KERNEL_FALLBACK[impl] == choices["*"], impl
    assert set(kernels_support.HUB_FLASH_ATTENTION) == set(fa.FLASH_ATTN_KERNEL_FALLBACK)
    # and the ROCm branch, read from the source
    source = Path(fa.__file__).read_text(encoding="utf-8")
    for impl, choices in kernels_support.HUB_FLASH_ATTENTION.items():
        if "rocm" in choices:
            assert re.search(rf'"{impl}": \(\s*"{re.escape(choices["rocm"])}" if is_rocm_platform\(\)', source), impl


def test_kernel_device_keys_match_kernelconfig():
    """The registry's kernels keys are KernelConfig's device keys (and ROCm's "rocm")."""
    from whichdevice.hardware.registry import backends

    keys = {b.kernels_key for b in backends() if b.kernels_key} | {"rocm"}
    assert keys == {"cuda", "rocm", "xpu", "npu", "neuron", "tpu", "mps"}
    from transformers.utils.kernel_config import KERNELS_SUPPORTED_DEVICE_TYPES

    assert keys == set(KERNELS_SUPPORTED_DEVICE_TYPES)
