"""simulate() specs are validated like the runtimes they stand in for, and name what they accept (issue 16, class 6)."""

from __future__ import annotations

import re

import pytest

import whichdevice as wd
from whichdevice.hardware.probes.cpu import ONEDNN_ISAS
from whichdevice.hardware.probes.cuda import VARIANTS
from whichdevice.hardware.probes.hpu import GAUDI_GENERATIONS
from whichdevice.hardware.probes.mps import MACOS_RELEASES
from whichdevice.hardware.probes.nvidia import COMPUTE_MODES
from whichdevice.hardware.probes.nvidia_platforms import HOSTS
from whichdevice.testing import parse_spec, simulate
from whichdevice.testing.gpus import MODELS, capabilities
from whichdevice.testing.spec import MAX_COUNT

GiB = 1024**3

# (spec, words the error must contain: what is wrong and what is accepted)
REFUSED = [
    # the count: a number from 0 to MAX_COUNT, never a ValueError from int()
    ("cuda:" + "9" * 5000, ("no machine has that many", f"0 to {MAX_COUNT}")),
    ("cuda:" + "1" * 4301, ("no machine has that many",)),
    (f"cuda:{MAX_COUNT + 1}", ("no machine has that many",)),
    ("hpu:99999999", ("no machine has that many",)),
    ("cuda:", ("must be a number", "cuda:4")),
    ("cuda: ", ("must be a number",)),
    ("cuda:1.5", ("must be a number",)),
    ("cuda:0x4", ("must be a number",)),
    ("cuda:1:2", ("must be a number",)),
    ("cuda:+2", ("must be a number",)),
    ("cuda:\u0663", ("must be a number",)),
    ("cpu:0", ("one CPU device", "write 'cpu'")),
    ("cpu:2", ("one CPU device",)),
    # modes: at most one, each once
    ("npu,broken,missing", ("two modes", "broken", "missing")),
    ("cuda:2,hangs,unavailable", ("two modes",)),
    ("npu,broken,broken", ("given twice",)),
    ("npu,Broken,broken", ("given twice",)),
    ("cuda:1,crashed", ("unknown flag", "broken, hangs, missing, unavailable")),
    # keys: each once, known ones only
    ("cuda:1,cc=8.0,cc=9.0", ("cc is given twice",)),
    ("cuda:1,mem=16GiB,memory=32GiB", ("mem is given twice",)),
    ("cuda:1,gpu=a100", ("unknown key", "cc, ", "variant")),
    ("cuda:1,=3", ("unknown key",)),
    ("cuda:1," + "x" * 5000 + "=1", ("unknown key",)),
    ("cuda:1," + "y" * 5000, ("unknown flag",)),
    ("cuda:1" + ",name=T4" * 400, ("name is given twice",)),
    # memory: a size a device can have
    ("cuda:1,mem=0", ("no memory", "mem=16GiB")),
    ("cuda:1,mem=0GiB", ("no memory",)),
    ("cuda:1,mem=0.0001", ("no memory",)),
    ("npu:1,mem=0B", ("no memory",)),
    ("cuda:1,mem=16", ("16 bytes", "mem=16GiB")),
    ("cuda:1,mem=-16GiB", ("not a size",)),
    ("cuda:1,mem=nan", ("not a size",)),
    ("cuda:1,mem=inf", ("not a size",)),
    ("cuda:1,mem=1e9", ("not a size",)),
    ("cuda:1,mem=16 GiBs", ("not a size",)),
    ("cuda:1,mem=99999TiB", ("more than any device has",)),
    ("cuda:1,mem=" + "9" * 400, ("more than any device has",)),
    # variants, generations, macOS releases, ISAs: the probes' own tables
    ("cuda:2,variant=hip", ("not a build of torch", "variant=cuda or variant=rocm")),
    ("cuda:2,variant=", ("variant=cuda or variant=rocm",)),
    ("cuda:2,variant=nvidia", ("variant=cuda or variant=rocm",)),
    ("cuda:2,variant=rocm6", ("variant=cuda or variant=rocm",)),
    ("hpu:8,gen=gaudi4", ("not a Gaudi generation", "gen=gaudi1 or gen=gaudi2 or gen=gaudi3")),
    ("hpu:8,gen=gaudi0", ("not a Gaudi generation",)),
    ("hpu:8,gen=3", ("not a Gaudi generation",)),
    ("hpu:8,gen=", ("not a Gaudi generation",)),
    ("hpu:8,gen=gaudi 2", ("not a Gaudi generation",)),
    ("hpu:1,name=GAUDI9", ("no Gaudi generation the probe knows", "gaudi3")),
    ("mps,macos=99", ("not a macOS release", "14.5")),
    ("mps,macos=16", ("not a macOS release",)),
    ("mps,macos=10.15", ("not a macOS release",)),
    ("mps,macos=banana", ("not a macOS release",)),
    ("mps,macos=14.x", ("not a macOS release",)),
    ("mps,macos=", ("not a macOS release",)),
    ("mps,macos=14..5", ("not a macOS release",)),
    ("mps,macos=14.5.1.2", ("not a macOS release",)),
    ("mps,macos=-14", ("not a macOS release",)),
    ("cpu,isa=AVX1024", ("not a oneDNN ISA", "AVX512_CORE_BF16")),
    ("cpu,isa=", ("not a oneDNN ISA",)),
    ("cpu,flags=avx512_bf16/rm", ("not a list of CPU flags",)),
    ("cpu,flags=avx-512", ("not a list of CPU flags",)),
    ("cpu,packs=float16", ("not the weight dtypes oneDNN packs", "float32+bfloat16")),
    ("cpu,packs=fp32", ("not the weight dtypes oneDNN packs",)),
    ("npu:1,bf16=maybe", ("yes/no",)),
    ("xpu:1,bf16=", ("yes/no",)),
    # compute capabilities a GPU of that build reports
    ("cuda:1,cc=99.0", ("not a compute capability of a cuda GPU", "8.0, 8.6")),
    ("cuda:1,cc=0.0", ("not a compute capability",)),
    ("cuda:1,cc=8.5", ("not a compute capability",)),
    ("cuda:1,cc=8", ("not a compute capability like 8.0",)),
    ("cuda:1,cc=8.0.1", ("not a compute capability like 8.0",)),
    ("cuda:1,cc=-8.0", ("not a compute capability like 8.0",)),
    ("cuda:1,cc=" + "9" * 5000 + ".0", ("not a compute capability like 8.0",)),
    ("cuda:1,variant=rocm,cc=8.0", ("not a compute capability of a rocm GPU", "9.4")),
    # names
    ("cuda:1,name=", ("not a device name",)),
    ("cuda:1,name=   ", ("not a device name",)),
    ("cuda:1,name=" + "x" * 200, ("not a device name", "96")),
    ("cuda:1,name=A100\x00", ("not a device name",)),
    # a name that contradicts the cc, the memory or the build
    ("cuda:1,cc=7.5,mem=16GiB,name=NVIDIA A100-SXM4-80GB", ("is a cc 8.0 GPU", "cc=7.5", "Tesla T4")),
    ("cuda:1,cc=7.5,name=NVIDIA H100", ("is a cc 9.0 GPU",)),
    ("cuda:1,cc=9.0,name=Tesla T4", ("is a cc 7.5 GPU", "NVIDIA H100")),
    ("cuda:1,mem=16GiB,name=NVIDIA A100-SXM4-80GB", ("has 80 GiB", "mem=80GiB")),
    ("cuda:1,mem=80GiB,name=Tesla T4", ("has 16 GiB",)),
    ("cuda:1,mem=8GiB,name=NVIDIA A100", ("has 80 GiB or 40 GiB",)),
    ("cuda:1,mem=24GiB,name=Some GPU 48GB", ("has 48 GiB",)),
    ("cuda:1,name=AMD Instinct MI300X", ("AMD GPU", "add variant=rocm")),
    ("cuda:1,name=Radeon RX 7900 XTX", ("AMD GPU", "add variant=rocm")),
    ("cuda:1,variant=rocm,name=Tesla T4", ("NVIDIA GPU", "drop variant=rocm")),
    ("cuda:1,variant=rocm,name=NVIDIA H100", ("NVIDIA GPU",)),
    ("cuda:1,variant=rocm,cc=9.4,mem=64GiB,name=AMD Instinct MI300X", ("has 192 GiB",)),
    # compute modes and other processes' memory: NVML's names, one per device, within the memory
    ("cuda:2,compute=shared", ("not a list of NVIDIA compute modes", "exclusive_process", "prohibited")),
    ("cuda:2,compute=default/", ("not a list of NVIDIA compute modes",)),
    ("cuda:2,compute=", ("not a list of NVIDIA compute modes",)),
    ("cuda:2,compute=default/default/default", ("3 values for 2 device(s)",)),
    ("cuda:2,held=5", ("5 bytes", "held=5GiB")),
    ("cuda:2,held=lots", ("not a size",)),
    ("cuda:2,held=-1GiB", ("not a size",)),
    ("cuda:2,held=1GiB/1GiB/1GiB", ("3 values for 2 device(s)",)),
    ("cuda:1,mem=80GiB,held=81GiB", ("held= in", "at most mem=")),
    ("cuda:1,mem=80GiB,free=60GiB,held=30GiB", ("60.00 GiB free", "30.00 GiB held", "at most mem=")),
    ("cuda:1,free=60GiB,held=30GiB", ("more than its 80.00 GiB",)),
    ("cuda:1,variant=rocm,compute=exclusive", ("NVIDIA's driver (NVML)", "variant=rocm takes neither")),
    ("cuda:1,variant=rocm,held=1GiB", ("variant=rocm takes neither",)),
    ("npu:2,held=1GiB", ("held= applies to cuda",)),
    ("xpu:2,compute=default", ("compute= applies to cuda",)),
    # keys the backend's runtime does not report
    ("hpu:8,cc=9.0", ("cc= applies to cuda",)),
    ("tpu:4,variant=rocm", ("variant= applies to cuda",)),
    ("cuda:1,gen=gaudi2", ("gen= applies to hpu",)),
    ("neuron:2,macos=14", ("macos= applies to mps",)),
    # the host: what platform.machine() reports, and one the GPU model can have
    ("cuda:1,host=arm64", ("not a host architecture", "host=x86_64 or host=aarch64 or host=ppc64le")),
    ("cuda:1,host=", ("not a host architecture", "host=aarch64")),
    ("cuda:1,host=amd64", ("not a host architecture",)),
    ("cuda:1,name=NVIDIA GH200 480GB,host=x86_64", ("built with an aarch64 CPU", "give host=aarch64")),
    ("cuda:1,name=Orin,host=x86_64", ("built with an aarch64 CPU",)),
    ("hpu:8,host=aarch64", ("host= applies to cuda",)),
    ("cpu,host=aarch64", ("host= applies to cuda",)),
]


@pytest.mark.parametrize(("spec", "words"), REFUSED, ids=[s[:48] for s, _ in REFUSED])
def test_refused_specs_say_what_is_wrong_and_what_is_accepted(spec: str, words: tuple[str, ...]) -> None:
    with pytest.raises(wd.DeviceError) as raised:
        simulate(spec)
    for word in words:
        assert word in str(raised.value), f"{word!r} not in {raised.value}"
    assert len(str(raised.value)) < 1200  # a 5000-digit value is not echoed back whole


# (spec, (name, memory in GiB, cc)) of the simulated GPU
GPUS = [
    ("cuda:1", ("NVIDIA A100-SXM4-80GB", 80, (8, 0))),
    ("cuda:1,cc=7.5", ("Tesla T4", 16, (7, 5))),
    ("cuda:1,cc=7.5,mem=16GiB", ("Tesla T4", 16, (7, 5))),
    ("cuda:1,cc=7.5,mem=15GiB", ("Tesla T4", 15, (7, 5))),  # what NVML reports for a T4
    ("cuda:1,cc=7.5,mem=48GiB", ("NVIDIA GPU (cc 7.5, 48 GiB)", 48, (7, 5))),
    ("cuda:1,cc=8.0,mem=40GiB", ("NVIDIA A100-SXM4-40GB", 40, (8, 0))),
    ("cuda:1,cc=8.0,mem=16GiB", ("NVIDIA GPU (cc 8.0, 16 GiB)", 16, (8, 0))),
    ("cuda:1,cc=9.0", ("NVIDIA H100 80GB HBM3", 80, (9, 0))),
    ("cuda:1,cc=9.0,mem=141GiB", ("NVIDIA H200", 141, (9, 0))),
    ("cuda:1,mem=16GiB", ("NVIDIA GPU (cc 8.0, 16 GiB)", 16, (8, 0))),
    ("cuda:1,name=Tesla T4", ("Tesla T4", 16, (7, 5))),
    ("cuda:1,name=Tesla P100", ("Tesla P100", 16, (6, 0))),
    ("cuda:1,name=Tesla V100-SXM2-32GB", ("Tesla V100-SXM2-32GB", 32, (7, 0))),
    ("cuda:1,name=My Lab GPU", ("My Lab GPU", 80, (8, 0))),
    ("cuda:1,name=My Lab GPU 24GB", ("My Lab GPU 24GB", 24, (8, 0))),
    ("cuda:1,cc=9.0,mem=80GiB,name=NVIDIA H100", ("NVIDIA H100", 80, (9, 0))),
    ("cuda:1,variant=rocm", ("AMD Instinct MI300X", 192, (9, 4))),
    ("cuda:1,variant=rocm,cc=9.0", ("AMD Instinct MI250X", 64, (9, 0))),
    ("cuda:1,variant=rocm,name=AMD Instinct MI210", ("AMD Instinct MI210", 64, (9, 0))),
    ("cuda:1,variant=rocm,cc=11.0,mem=12GiB", ("AMD GPU (cc 11.0, 12 GiB)", 12, (11, 0))),
]


@pytest.mark.parametrize(("spec", "expected"), GPUS, ids=[s for s, _ in GPUS])
def test_name_cc_and_memory_describe_one_gpu(spec: str, expected: tuple[str, int, tuple[int, int]]) -> None:
    with simulate(spec):
        gpu = wd.probe("cuda").devices[0]
    assert (gpu.name, gpu.total_memory / GiB, gpu.capability) == expected


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_every_model_in_the_table_is_a_spec_that_works(model: object) -> None:
    name, variant, cc, sizes = model.name, model.variant, model.capability, model.memory_gib  # type: ignore[attr-defined]
    assert cc in capabilities(variant)
    with simulate(f"cuda:1,variant={variant},cc={cc[0]}.{cc[1]},mem={sizes[0]}GiB,name={name}"):
        assert wd.probe("cuda").devices[0].name == name


def test_accepted_values_come_from_the_probes_tables() -> None:
    for variant in VARIANTS:
        assert parse_spec(f"cuda:1,variant={variant.upper()}").variant == variant
    for gen in GAUDI_GENERATIONS:
        assert parse_spec(f"hpu:1,gen={gen}").generation == gen
    for major in MACOS_RELEASES:
        assert parse_spec(f"mps,macos={major}.1").macos == f"{major}.1"
    for host in HOSTS:
        assert parse_spec(f"cuda:1,host={host.upper()}").host == host
    for isa in ONEDNN_ISAS:
        assert parse_spec(f"cpu,isa={isa.lower()}").isa == isa
    assert parse_spec(f"cuda:{MAX_COUNT}").count == MAX_COUNT
    assert parse_spec("cuda:0004").count == 4
    assert parse_spec("cpu,flags=AVX512_BF16+amx_bf16").flags == frozenset({"avx512_bf16", "amx_bf16"})
    assert parse_spec("cpu,packs=Float32+bfloat16").packs == frozenset({"float32", "bfloat16"})
    assert parse_spec("cpu,packs=").packs == frozenset()
    assert parse_spec("hpu:1,name=HL-325L").name == "HL-325L"  # a name without a generation is the runtime's
    for mode in COMPUTE_MODES.values():
        assert parse_spec(f"cuda:2,compute={mode.upper()}").compute_modes == (mode,)
    assert parse_spec("cuda:2,compute=Default/exclusive").compute_modes == ("default", "exclusive_process")
    assert parse_spec("cuda:2,held=0/1GiB").held == (0, GiB)


def test_a_mac_before_mps_shows_mps_unavailable() -> None:
    # torch on macOS before 12.3: MPS built in, not available; the simulation shows the same.
    assert parse_spec("mps,macos=12.1").mode == "unavailable"
    assert parse_spec("mps,macos=12.1,broken").mode == "broken"
    with simulate("mps,macos=12.2"):
        result = wd.probe("mps")
    assert not result.available and result.reason is not None and "12.3" in result.reason
    with simulate("mps,macos=12.3"):
        assert wd.probe("mps").available


def test_the_unknown_key_error_lists_every_key() -> None:
    with pytest.raises(wd.DeviceError) as raised:
        parse_spec("cuda:1,colour=green")
    listed = re.search(r"keys are (.*)$", str(raised.value))
    assert listed is not None
    for key in ("name", "mem", "cc", "variant", "gen", "bf16", "macos", "flags", "isa"):
        assert key in listed.group(1)
