"""GPU models a simulated ``cuda`` spec can describe: name, compute capability and memory agree.

A real GPU reports all three together (NVML, ``torch.cuda.get_device_properties``). A spec gives
some of them; the rest are filled in from the model they describe ("cuda:1,cc=7.5" is a 16 GiB
Tesla T4), and a spec whose name contradicts its cc or memory ("name=NVIDIA A100-SXM4-80GB,cc=7.5")
is refused: the simulation would show a machine that cannot exist. Names not in this table are
taken as given and get the defaults; without a name, a combination no model has is shown under a
generic name ("NVIDIA GPU (cc 7.5, 48 GiB)").
"""

from __future__ import annotations

import re

from whichdevice.core.frozen import NamedTuple

__all__ = ["GpuModel", "capabilities", "gpu_details", "host_conflict", "known_model", "name_conflict"]

GiB = 1024**3
# NVML reports a little less than the marketed size (a 16 GB T4 shows 15 GiB, an 80 GB H100 79.6).
_BELOW, _ABOVE = 0.85, 1.1


class GpuModel(NamedTuple):
    pattern: str  # searched in a given name, case-insensitively
    name: str  # as NVML / the ROCm runtime reports it
    variant: str  # the torch build that runs it: "cuda" or "rocm"
    capability: tuple[int, int]
    memory_gib: tuple[int, ...]  # the sizes it ships with, the usual one first
    host: str | None = None  # the CPU it is built with ("aarch64": a Grace or Jetson module); None: any
    tegra: bool = False  # a Jetson module: Jetson Linux (L4T) runs its host


# The first model of each build is the default of a bare "cuda:N" (or "cuda:N,variant=rocm").
MODELS = (
    GpuModel(r"A100\b.*80\s*GB|A100-80", "NVIDIA A100-SXM4-80GB", "cuda", (8, 0), (80,)),
    GpuModel(r"A100\b.*40\s*GB|A100-40", "NVIDIA A100-SXM4-40GB", "cuda", (8, 0), (40,)),
    GpuModel(r"\bA100\b", "NVIDIA A100-SXM4-80GB", "cuda", (8, 0), (80, 40)),
    GpuModel(r"\bA30\b", "NVIDIA A30", "cuda", (8, 0), (24,)),
    GpuModel(r"\bH100\b", "NVIDIA H100 80GB HBM3", "cuda", (9, 0), (80, 94, 96)),
    GpuModel(r"(?<!G)\bH200\b", "NVIDIA H200", "cuda", (9, 0), (141,)),
    GpuModel(r"\bGH200\b", "NVIDIA GH200 480GB", "cuda", (9, 0), (96, 144), host="aarch64"),
    # DGX Spark: torch reports "NVIDIA GB10" (pypi.org/project/dgx-spark-vllm), capability 12.1
    # (FastVideo's DGX Spark guide: "GB10 -> (12, 1)"), 128 GB shared with the Grace CPU.
    GpuModel(r"\bGB10\b", "NVIDIA GB10", "cuda", (12, 1), (128,), host="aarch64"),
    # Jetson AGX Orin (64/32 GB) and Orin NX / Nano (16/8/4 GB): the driver names it "Orin" (a device
    # query on an AGX Orin 64GB, tmcdonell/cuda#77), compute capability 8.7 (cupy/cupy#6876, quoting NVIDIA).
    GpuModel(r"\bOrin\b", "Orin", "cuda", (8, 7), (64, 32, 16, 8, 4), host="aarch64", tegra=True),
    GpuModel(r"\bB200\b", "NVIDIA B200", "cuda", (10, 0), (180, 192)),
    GpuModel(r"\bT4\b", "Tesla T4", "cuda", (7, 5), (16,)),
    GpuModel(r"\bV100\b", "Tesla V100-SXM2-16GB", "cuda", (7, 0), (16, 32)),
    GpuModel(r"\bP100\b", "Tesla P100-PCIE-16GB", "cuda", (6, 0), (16, 12)),
    GpuModel(r"\bP40\b", "Tesla P40", "cuda", (6, 1), (24,)),
    GpuModel(r"\bGTX 1080\b", "NVIDIA GeForce GTX 1080", "cuda", (6, 1), (8, 11)),
    GpuModel(r"\bGTX 980\b", "NVIDIA GeForce GTX 980", "cuda", (5, 2), (4,)),
    GpuModel(r"\bK80\b", "Tesla K80", "cuda", (3, 7), (12,)),
    GpuModel(r"\bA10G\b", "NVIDIA A10G", "cuda", (8, 6), (24,)),
    GpuModel(r"\bA10\b", "NVIDIA A10", "cuda", (8, 6), (24,)),
    GpuModel(r"\bRTX 3090\b", "NVIDIA GeForce RTX 3090", "cuda", (8, 6), (24,)),
    GpuModel(r"\bA6000\b", "NVIDIA RTX A6000", "cuda", (8, 6), (48,)),
    GpuModel(r"\bL4\b", "NVIDIA L4", "cuda", (8, 9), (24,)),
    GpuModel(r"\bL40S?\b", "NVIDIA L40S", "cuda", (8, 9), (48,)),
    GpuModel(r"\bRTX 4090\b", "NVIDIA GeForce RTX 4090", "cuda", (8, 9), (24,)),
    GpuModel(r"\bRTX 5090\b", "NVIDIA GeForce RTX 5090", "cuda", (12, 0), (32,)),
    GpuModel(r"\bMI300X\b", "AMD Instinct MI300X", "rocm", (9, 4), (192,)),
    GpuModel(r"\bMI325X\b", "AMD Instinct MI325X", "rocm", (9, 4), (256,)),
    GpuModel(r"\bMI300A\b", "AMD Instinct MI300A", "rocm", (9, 4), (128,)),
    GpuModel(r"\bMI35\dX\b", "AMD Instinct MI355X", "rocm", (9, 5), (288,)),
    GpuModel(r"\bMI250X?\b", "AMD Instinct MI250X", "rocm", (9, 0), (64, 128)),
    GpuModel(r"\bMI210\b", "AMD Instinct MI210", "rocm", (9, 0), (64,)),
    GpuModel(r"\bMI100\b", "AMD Instinct MI100", "rocm", (9, 0), (32,)),
    GpuModel(r"\bRX 7900\b", "AMD Radeon RX 7900 XTX", "rocm", (11, 0), (24,)),
    GpuModel(r"\bW7900\b", "AMD Radeon PRO W7900", "rocm", (11, 0), (48,)),
)

# Compute capabilities a GPU of each build reports (NVIDIA's CUDA GPUs list; on ROCm torch reports
# the gfx architecture's major.minor: gfx90a 9.0, gfx942 9.4, gfx950 9.5, gfx1030 10.3, gfx1100 11.0).
_CAPABILITIES = {
    "cuda": (
        *((3, m) for m in (0, 2, 5, 7)),
        *((5, m) for m in (0, 2, 3)),
        *((6, m) for m in (0, 1, 2)),
        *((7, m) for m in (0, 2, 5)),
        *((8, m) for m in (0, 6, 7, 8, 9)),
        (9, 0),
        *((10, m) for m in (0, 1, 3)),
        (11, 0),
        *((12, m) for m in (0, 1)),
    ),
    "rocm": ((9, 0), (9, 4), (9, 5), (10, 1), (10, 3), (11, 0), (11, 5), (12, 0)),
}
_VENDORS = {
    "cuda": ("NVIDIA", r"nvidia|geforce|tesla|quadro|\brtx\b|\bgtx\b"),
    "rocm": ("AMD", r"\bamd\b|radeon|instinct|\bmi\d{3}"),
}


def known_model(name: str | None, variant: str) -> GpuModel | None:
    """The table's model a GPU name describes (None: not in the table, or no name)."""
    models = [m for m in _models(name) if m.variant == variant] if name else []
    return models[0] if models else None


def host_conflict(name: str | None, variant: str, host: str | None) -> str | None:
    """Why a GPU named ``name`` cannot sit in a ``host`` machine (None: it can)."""
    model = known_model(name, variant)
    if host is None or model is None or model.host in (None, host):
        return None
    return (
        f"name={name!r} is built with an {model.host} CPU, but host={host}: give host={model.host}, or "
        "leave host= out and it follows the GPU"
    )


def capabilities(variant: str) -> tuple[tuple[int, int], ...]:
    """The compute capabilities a GPU of the ``variant`` build ("cuda", "rocm") can report."""
    return _CAPABILITIES[variant]


def _models(name: str) -> list[GpuModel]:
    return [m for m in MODELS if re.search(m.pattern, name, re.IGNORECASE)]


def _stated_gib(name: str) -> int | None:
    """The memory a name states ("A100-SXM4-80GB" -> 80), if it does."""
    match = re.search(r"(\d{1,4})\s*G(?:i)?B\b", name, re.IGNORECASE)
    return int(match.group(1)) if match else None


def _fits(memory: int, gib: int) -> bool:
    return _BELOW * gib * GiB <= memory <= _ABOVE * gib * GiB


def _sizes(name: str, models: list[GpuModel]) -> tuple[int, ...]:
    """The memory sizes a GPU called ``name`` can have (none: the name does not say)."""
    known = tuple(dict.fromkeys(g for m in models for g in m.memory_gib))
    stated = _stated_gib(name)
    if stated is not None and (not known or stated in known):
        return (stated,)
    return known


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def name_conflict(name: str | None, variant: str, capability: tuple[int, int] | None, memory: int | None) -> str | None:
    """Why a GPU named ``name`` cannot have this build, cc and memory (None: it can)."""
    if name is None:
        return None
    for build, (vendor, brand) in _VENDORS.items():
        if build != variant and re.search(brand, name, re.IGNORECASE):
            fix = "add variant=rocm" if build == "rocm" else "drop variant=rocm (ROCm builds run AMD GPUs)"
            return f"name={name!r} is an {vendor} GPU, which the {variant} build of torch does not run: {fix}"
    models = [m for m in _models(name) if m.variant == variant]
    if capability is not None and models and capability not in {m.capability for m in models}:
        others = [m.name for m in MODELS if m.capability == capability and m.variant == variant]
        example = f" (e.g. name={others[0]!r})" if others else ""
        return (
            f"name={name!r} is a cc {_cc(models[0].capability)} GPU, but cc={_cc(capability)}: give the "
            f"name of a cc {_cc(capability)} GPU{example}, or leave name= out and one is derived"
        )
    sizes = _sizes(name, models)
    if memory is not None and sizes and not any(_fits(memory, g) for g in sizes):
        shown = " or ".join(f"{g} GiB" for g in sizes)
        return (
            f"name={name!r} has {shown}, but mem={memory / GiB:.4g}GiB: give mem={sizes[0]}GiB, or leave "
            "name= out and a name that matches the memory is derived"
        )
    return None


def gpu_details(
    name: str | None, variant: str, capability: tuple[int, int] | None, memory: int | None
) -> tuple[str, int, tuple[int, int]]:
    """Name, memory (bytes) and cc of the GPU a spec describes, each filled in where not given."""
    default = next(m for m in MODELS if m.variant == variant)
    if name is not None:
        models = [m for m in _models(name) if m.variant == variant]
        sizes = _sizes(name, models) or default.memory_gib
        cc = capability or (models[0] if models else default).capability
        return name, memory or sizes[0] * GiB, cc
    cc = capability or default.capability
    matching = [m for m in MODELS if m.variant == variant and m.capability == cc]
    if memory is None:
        memory = (matching[0].memory_gib[0] if matching else default.memory_gib[0]) * GiB
    for model in matching:
        for gib in model.memory_gib:
            if _fits(memory, gib):
                return model.name, memory, cc
    vendor = _VENDORS[variant][0]
    return f"{vendor} GPU (cc {_cc(cc)}, {memory / GiB:.4g} GiB)", memory, cc
