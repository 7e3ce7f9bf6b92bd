"""whichdevice plan: the real resolver under each simulated machine, for a Hub model read from its metadata."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import whichdevice as wd
from hub_fixtures import large_repos
from hub_server import serving
from whichdevice.core.errors import printable
from whichdevice.memory.bandwidth import BANDWIDTHS, bandwidth_of
from whichdevice.report.plan import DEFAULT_MACHINES, plan_hardware
from whichdevice.testing import simulate

H100 = "cuda:1,name=NVIDIA H100 80GB HBM3"
L4 = "cuda:1,name=NVIDIA L4"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    with serving(monkeypatch, tmp_path) as server:
        for name, files in large_repos().items():
            server.add(name, files)
        yield server


def test_each_row_is_the_resolvers_own_answer_for_that_machine(hub):
    plan = plan_hardware("meta-llama/Llama-3.1-8B", machines=[H100, L4], max_length=4096)
    for row in plan.rows:
        with simulate(row.spec):
            res = wd.resolve_device(model="meta-llama/Llama-3.1-8B", batch_size=1, max_length=4096)
        assert row.fits and row.dtype == res.dtype_name and row.devices == 1
        assert row.keywords["device_map"] == repr(res.device_map)
        assert (row.longest, row.largest_batch) == (res.fit_limits.longest, res.fit_limits.largest_batch)
    h100 = plan.rows[0]
    # 3.35 TB/s over the bf16 weights plus the KV cache of 4096 tokens.
    read = 8.03e9 * 2 + 2 * 32 * 8 * 128 * 4096 * 2
    assert h100.tokens_per_s == pytest.approx(3350e9 / read, rel=0.01) and "H100 datasheet" in h100.bandwidth_source
    assert plan.fetched is not None and "no weights" in plan.fetched


def test_a_model_too_large_for_one_device_is_tried_on_more_and_tensor_parallel_is_compared(hub):
    plan = plan_hardware("meta-llama/Llama-3.1-70B", machines=["cuda:1,name=NVIDIA H200"])
    one, two = plan.rows
    assert one.devices == 1 and one.quantization == "bitsandbytes-nf4"  # quantize="auto" on one device
    assert two.devices == 2 and two.quantization is None and two.strategy == "tensor parallel over 2"
    assert two.keywords.get("distributed_config") == "DistributedConfig(tp_plan='auto')" or two.keywords.get(
        "tp_plan"
    ) == repr("auto")
    assert two.launch is not None and "--nproc-per-node=2" in two.launch
    assert two.tokens_per_s == pytest.approx(2 * 4800e9 / (70.55e9 * 2 + 2 * 80 * 8 * 128 * 4096 * 2), rel=0.01)


def test_a_split_is_kept_where_tensor_parallel_does_not_fit(hub):
    row = plan_hardware("meta-llama/Llama-3.1-70B", machines=["cuda:4,name=NVIDIA A100-SXM4-40GB"]).rows[0]
    assert (
        row.fits
        and row.strategy.startswith("device_map split over 4")
        and "tensor parallel: does not fit" in row.strategy
    )


def test_a_mixture_of_experts_reads_only_its_routed_experts_per_token(hub):
    row = plan_hardware("mistralai/Mixtral-8x7B-v0.1", machines=["hpu:1,gen=gaudi3,name=GAUDI3,mem=128GiB"]).rows[0]
    dense = 3700e9 / (46.7e9 * 2)
    assert row.fits and row.tokens_per_s > 2.5 * dense  # 2 of 8 experts: about 13B of 47B read per token


def test_the_default_machines_all_parse_and_each_bandwidth_row_cites_a_source():
    for name, spec in DEFAULT_MACHINES:
        if spec:
            with simulate(spec):
                device = wd.probe(spec.split(":")[0].split(",")[0]).devices[0].name
            assert bandwidth_of(device) is not None, name
    assert all(row.source and row.gb_per_s > 0 for row in BANDWIDTHS)
    assert bandwidth_of("Some Unknown Accelerator") is None


def test_bad_input_names_the_fix(hub):
    with pytest.raises(wd.DeviceError, match="batch_size=0"):
        plan_hardware("meta-llama/Llama-3.1-8B", batch_size=0)
    with pytest.raises(wd.DeviceError, match="unknown key"):
        plan_hardware("meta-llama/Llama-3.1-8B", machines=["cuda:1,colour=red"])


def test_the_command_prints_the_table_and_json_against_the_hub(hub, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    command = [sys.executable, "-m", "whichdevice", "plan", "meta-llama/Llama-3.1-8B", "--machine", H100]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "| NVIDIA H100 80GB HBM3 | 1 | yes | bfloat16 | one device |" in done.stdout
    assert "no weights" in done.stdout
    done = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=300, check=False)
    data = json.loads(done.stdout)
    assert data["kind"] == "plan" and data["rows"][0]["fits"] is True
    bad = subprocess.run([*command[:4], "acme/missing"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "check the id" in bad.stderr and "Traceback" not in bad.stderr


def test_one_process_on_several_gpus_hears_of_tensor_parallelism_where_it_fits(hub):
    with simulate("cuda:2,name=NVIDIA H200"):
        res = wd.resolve_device(model="meta-llama/Llama-3.1-70B", max_length=4096, quantize=None)
    said = res.explain()
    assert res.device_map in ("auto", "balanced_low_0")  # what one process can run, handed over as before
    assert "faster: tensor parallel over 2 devices" in said and "--nproc-per-node=2" in said
    assert "DistributedConfig(tp_plan='auto')" in said or "tp_plan='auto'" in said
    with simulate("cuda:4,name=NVIDIA A100-SXM4-40GB"):
        res = wd.resolve_device(model="meta-llama/Llama-3.1-70B", max_length=4096, quantize=None)
    assert "the split, since tensor parallel over 4 devices" in res.explain() and "does not fit" in res.explain()


# Plans whose rows cover every case over the default machines: one device and several, quantized and not, fitting
# and not, for inference and training (a 70B needs 4-bit on two L4s; an 8B trains QLoRA on two T4s).
ONE_ANSWER = [
    ("meta-llama/Llama-3.1-70B", "inference"),
    ("mistralai/Mixtral-8x7B-v0.1", "inference"),
    ("meta-llama/Llama-3.1-8B", "training"),
]


def _resolved(model: str, task: str, spec: str) -> wd.Resolution | str:
    """resolve_device's own answer on that machine (as a user would call it), or the error it raised."""
    try:
        with simulate(spec) if spec else contextlib.nullcontext():
            return wd.resolve_device(model=model, task=task, batch_size=1, max_length=4096)
    except wd.DeviceError as error:
        return str(error)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "task"), ONE_ANSWER)
def test_every_row_over_the_default_machines_is_resolve_device_on_that_machine(hub, model, task):
    plan = plan_hardware(model, task=task, max_length=4096)
    counts = {"several": 0, "quantized": 0, "refused": 0}
    for row in plan.rows:
        res = _resolved(model, task, row.spec)
        where = f"{row.machine} x{row.devices}"
        if isinstance(res, str):
            assert not row.fits and row.note and row.note in printable(res).replace("\n", " "), where
            # The row says what resolve_device said, and suggests no option plan lacks.
            assert "quantize=" not in row.note, where
            counts["refused"] += 1
            continue
        assert row.fits and row.dtype == (res.dtype_name or "float32"), where
        assert row.quantization == (res.quantization.method if res.quantization else None), where
        handed = row.keywords.get("device_map")
        assert handed == repr(res.device_map) or row.strategy.startswith("tensor parallel"), where
        # A quantized row hands over what resolve_device does: its quantization_config, with its device_map.
        assert not row.quantization or ("quantization_config" in row.keywords and handed == repr(res.device_map))
        counts["several"] += row.devices > 1
        counts["quantized"] += row.quantization is not None
    if model.endswith("70B"):
        # Four T4s: resolve_device loads the 70B in 4-bit over all four; the plan said it fits no count of T4s.
        t4 = next(r for r in plan.rows if r.machine == "T4" and r.devices == 4)
        assert t4.fits and t4.quantization == "bitsandbytes-nf4" and "in 4-bit" in t4.strategy
    assert all(counts.values()) or (model.startswith("mistralai") and counts["several"] and counts["refused"])
