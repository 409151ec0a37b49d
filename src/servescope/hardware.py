"""The GPU catalog: every figure the roofline needs, each with its source.

Why a hand-kept table and not a query of the local GPU: the roofline must answer for
GPUs the user does not have (what would an H200 do?), and NVML does not report peak
tensor throughput at all. So figures come from vendor datasheets and whitepapers, the
CUDA programming guide and CUTLASS, collected with their sources in
``shared/reference/hardware.md``. Rules the table keeps:

- every tensor figure is DENSE; vendors quote sparse (2:4) figures first and those are
  never stored here (a sparse-only figure becomes None plus a note);
- an unknown figure is ``None``, never a guess; a figure the reference marks "?" is
  kept but listed in ``GpuSpec.unverified`` so reports can say so;
- "GB" and "TB/s" in datasheets are decimal (10^9, 10^12); memory sizes here are the
  datasheet's, not the slightly larger number the driver reports.

Lookup accepts the catalog key, common aliases and the exact names NVML reports
(``nvmlDeviceGetName``), so a name read from telemetry finds its spec.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from servescope.errors import UnknownNameError

#: The dtypes a GPU's ``dense_tflops`` mapping is keyed by.
DTYPES = ("nvfp4", "mxfp4", "fp6", "fp8", "bf16", "fp16", "tf32")

#: Other spellings of those dtypes: what a user types, or what a weight format computes in.
#: ``fp8_block128`` / ``mxfp8`` compute on the FP8 tensor-core path; ``fp4`` means NVFP4.
_DTYPE_ALIASES = {
    "fp4": "nvfp4",
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",
    "fp6": "fp6",
    "mxfp6": "fp6",
    "fp8": "fp8",
    "e4m3": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_block128": "fp8",
    "mxfp8": "fp8",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "tf32": "tf32",
}


def normalize_dtype(dtype: str) -> str:
    """Map a dtype spelling to one of ``DTYPES``; unknown spellings raise ``UnknownNameError``."""
    key = dtype.strip().lower().replace("-", "_")
    if key not in _DTYPE_ALIASES:
        raise UnknownNameError("dtype", dtype, difflib.get_close_matches(key, list(_DTYPE_ALIASES), n=3))
    return _DTYPE_ALIASES[key]


# --------------------------------------------------------------------------- sources
# Keys used in ``sources`` strings. Full references are in shared/reference/hardware.md
# and docs/roofline.md.
_HW = "shared/reference/hardware.md GPU table"
_CUDA_CC = "CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability'"
_CUT_ARCH = "NVIDIA/cutlass include/cutlass/arch/arch.h (smem capacity per arch)"
_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (SXM; sparse figures halved)"
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (SXM; sparse figures halved)"
_H100_WP = "NVIDIA H100 Tensor Core GPU Architecture whitepaper"
_B200_DS = "NVIDIA DGX/HGX B200 datasheet, per GPU (sparse figures halved)"
_GB200_DS = "NVIDIA GB200 NVL72 datasheet, per GPU (rack figures / 72, sparse halved)"
_B300_DS = "NVIDIA HGX B300 / Blackwell Ultra figures per GPU"
_RTXPRO_DS = "NVIDIA RTX PRO 6000 Blackwell datasheet"
_RTX_BW_WP = "NVIDIA RTX Blackwell GPU architecture whitepaper"
_L40S_DS = "NVIDIA L40S datasheet (sparse figures halved)"
_A100_DS = "NVIDIA A100 datasheet / A100 architecture whitepaper"
_MI300X_DS = "AMD Instinct MI300X datasheet"
_MI355X_DS = "AMD Instinct MI355X product page"


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """Shared-memory capacity of one GPU architecture, as kernels see it.

    ``smem_per_block_bytes`` is the largest dynamic shared memory one thread block may opt
    in to (``cudaFuncAttributeMaxDynamicSharedMemorySize``); it is what decides whether a
    CUTLASS tile with N pipeline stages fits, and is 1 KiB below the per-SM figure on
    NVIDIA parts because the driver reserves 1 KiB per block.
    """

    name: str
    smem_per_sm_bytes: int
    smem_per_block_bytes: int
    source: str
    vendor: str = "NVIDIA"
    compute_capability: str | None = None


_ARCHS: tuple[ArchSpec, ...] = (
    ArchSpec("sm_80", 167_936, 166_912, f"{_CUDA_CC}: CC 8.0, 164 KB per SM, 163 KB per block", "NVIDIA", "8.0"),
    ArchSpec("sm_86", 102_400, 101_376, f"{_CUDA_CC}: CC 8.6, 100 KB per SM, 99 KB per block", "NVIDIA", "8.6"),
    ArchSpec("sm_89", 102_400, 101_376, f"{_CUDA_CC}: CC 8.9, 100 KB per SM, 99 KB per block", "NVIDIA", "8.9"),
    ArchSpec(
        "sm_90", 233_472, 232_448, f"{_CUDA_CC}: CC 9.0, 228 KB per SM, 227 KB per block; {_CUT_ARCH}", "NVIDIA", "9.0"
    ),
    ArchSpec(
        "sm_100",
        233_472,
        232_448,
        f"{_CUDA_CC}: CC 10.0, 228 KB per SM, 227 KB per block; {_CUT_ARCH}",
        "NVIDIA",
        "10.0",
    ),
    ArchSpec(
        "sm_103",
        233_472,
        232_448,
        f"{_CUDA_CC}: CC 10.3, 228 KB per SM, 227 KB per block; {_CUT_ARCH}",
        "NVIDIA",
        "10.3",
    ),
    ArchSpec(
        "sm_120",
        102_400,
        101_376,
        f"{_CUDA_CC}: CC 12.0, 100 KB per SM, 99 KB per block; {_CUT_ARCH}",
        "NVIDIA",
        "12.0",
    ),
    ArchSpec(
        "sm_121",
        102_400,
        101_376,
        f"{_CUDA_CC}: CC 12.1, 100 KB per SM, 99 KB per block; {_CUT_ARCH}",
        "NVIDIA",
        "12.1",
    ),
    # AMD: LDS (the shared-memory equivalent) per compute unit; a workgroup may use all of it.
    ArchSpec("gfx942", 65_536, 65_536, "AMD CDNA3 ISA reference: 64 KiB LDS per CU", "AMD", None),
    ArchSpec("gfx950", 163_840, 163_840, "AMD CDNA4 architecture whitepaper: 160 KiB LDS per CU", "AMD", None),
)


def list_archs() -> list[ArchSpec]:
    """Every architecture the catalog knows."""
    return list(_ARCHS)


def get_arch(name: str) -> ArchSpec:
    """Look up an architecture: "sm120", "sm_120", "sm_120a", "120", "12.0", "sm_90a", "gfx942".

    The "a"/"f" suffixes (arch-specific / family feature sets in nvcc) do not change
    shared-memory capacity, so they are accepted and dropped.
    """
    raw = name.strip().lower()
    key = raw
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d{2,3})[af]?", raw)
    if m:
        key = f"sm_{m.group(1)}"
    else:
        m = re.fullmatch(r"(\d{1,2})\.(\d)", raw)
        if m:
            key = f"sm_{m.group(1)}{m.group(2)}"
    for arch in _ARCHS:
        if arch.name == key:
            return arch
    names = [a.name for a in _ARCHS]
    raise UnknownNameError("architecture", name, difflib.get_close_matches(key, names, n=3, cutoff=0.5))


# --------------------------------------------------------------------------- GPUs
@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model's published figures (per GPU, not per board or rack).

    ``dense_tflops`` maps each of ``DTYPES`` to a DENSE tensor-core figure in TFLOP/s or
    None (unsupported or unknown; ``sources['dense_tflops.<dtype>']`` says which).
    ``link_bandwidth_bytes_s`` is the per-direction GPU-to-GPU bandwidth of the usual
    interconnect (NVLink, or PCIe where the card has no NVLink), the default for
    collective costs in the roofline. ``unverified`` names fields the reference marks "?".
    """

    key: str
    name: str
    vendor: str
    arch: str
    compute_capability: str | None
    sm_count: int | None
    boost_clock_mhz: int | None
    dense_tflops: Mapping[str, float | None]
    memory_bytes: int | None
    memory_type: str | None
    memory_bandwidth_bytes_s: float | None
    l2_bytes: int | None
    smem_per_sm_bytes: int | None
    smem_per_block_bytes: int | None
    tdp_w: float | None
    sources: Mapping[str, str]
    aliases: tuple[str, ...] = ()
    link_bandwidth_bytes_s: float | None = None
    link_name: str | None = None
    unverified: frozenset[str] = field(default_factory=frozenset)
    notes: tuple[str, ...] = ()

    def peak_flops(self, dtype: str) -> float | None:
        """Dense tensor-core peak in FLOP/s for ``dtype``, or None when unknown/unsupported."""
        tflops = self.dense_tflops.get(normalize_dtype(dtype))
        return None if tflops is None else tflops * 1e12

    def ridge_flops_per_byte(self, dtype: str) -> float | None:
        """Ridge point: the arithmetic intensity (FLOP/B of DRAM traffic) where compute takes over."""
        peak = self.peak_flops(dtype)
        if peak is None or not self.memory_bandwidth_bytes_s:
            return None
        return peak / self.memory_bandwidth_bytes_s

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (for ``servescope gpus --json`` and run directories)."""
        return {
            "key": self.key,
            "name": self.name,
            "vendor": self.vendor,
            "arch": self.arch,
            "compute_capability": self.compute_capability,
            "sm_count": self.sm_count,
            "boost_clock_mhz": self.boost_clock_mhz,
            "dense_tflops": dict(self.dense_tflops),
            "memory_bytes": self.memory_bytes,
            "memory_type": self.memory_type,
            "memory_bandwidth_bytes_s": self.memory_bandwidth_bytes_s,
            "l2_bytes": self.l2_bytes,
            "smem_per_sm_bytes": self.smem_per_sm_bytes,
            "smem_per_block_bytes": self.smem_per_block_bytes,
            "tdp_w": self.tdp_w,
            "link_bandwidth_bytes_s": self.link_bandwidth_bytes_s,
            "link_name": self.link_name,
            "ridge_flops_per_byte": {d: self.ridge_flops_per_byte(d) for d in DTYPES},
            "aliases": list(self.aliases),
            "unverified": sorted(self.unverified),
            "notes": list(self.notes),
            "sources": dict(self.sources),
        }


def _tflops(**figures: float | None) -> Mapping[str, float | None]:
    unknown = set(figures) - set(DTYPES)
    if unknown:  # a typo in the table below is a bug, caught at import by the tests
        raise ValueError(f"unknown dtype keys {sorted(unknown)}")
    return MappingProxyType({d: figures.get(d) for d in DTYPES})


def _gpu(
    *,
    key: str,
    name: str,
    arch: str,
    sources: dict[str, str],
    dense_tflops: Mapping[str, float | None],
    vendor: str = "NVIDIA",
    unverified: tuple[str, ...] = (),
    notes: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
    **figures: object,
) -> GpuSpec:
    spec = get_arch(arch)
    smem_src = spec.source
    merged = {"smem_per_sm_bytes": smem_src, "smem_per_block_bytes": smem_src, **sources}
    return GpuSpec(
        key=key,
        name=name,
        vendor=vendor,
        arch=arch,
        compute_capability=spec.compute_capability,
        dense_tflops=dense_tflops,
        smem_per_sm_bytes=spec.smem_per_sm_bytes,
        smem_per_block_bytes=spec.smem_per_block_bytes,
        sources=MappingProxyType(merged),
        aliases=aliases,
        unverified=frozenset(unverified),
        notes=notes,
        **figures,  # type: ignore[arg-type]
    )


_GB = 10**9
_MB = 10**6
_MIB = 2**20
_TB_S = 1e12
_GB_S = 1e9

# PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b -> ~63 GB/s per direction (PCI-SIG PCIe 5.0 spec).
_PCIE5_X16 = 63 * _GB_S
_PCIE4_X16 = 31.5 * _GB_S

_GPUS: tuple[GpuSpec, ...] = (
    _gpu(
        key="h100-sxm",
        name="NVIDIA H100 SXM5 80GB",
        arch="sm_90",
        sm_count=132,
        boost_clock_mhz=1980,
        dense_tflops=_tflops(fp8=1979.0, bf16=989.0, fp16=989.0, tf32=494.5),
        memory_bytes=80 * _GB,
        memory_type="HBM3",
        memory_bandwidth_bytes_s=3.35 * _TB_S,
        l2_bytes=50 * _MB,
        tdp_w=700.0,
        link_bandwidth_bytes_s=450 * _GB_S,
        link_name="NVLink 4 (900 GB/s bidirectional)",
        sources={
            "sm_count": f"{_H100_WP}; {_HW}",
            "boost_clock_mhz": "NVML max SM clock of GH100 SXM parts (1980 MHz, as measured on the H200 in "
            "shared/reference/h200-measurements.md)",
            "dense_tflops": f"{_H100_DS}; {_HW}",
            "dense_tflops.nvfp4": "no FP4 tensor cores on sm_90",
            "dense_tflops.mxfp4": "no FP4 tensor cores on sm_90",
            "dense_tflops.fp6": "no FP6 tensor cores on sm_90",
            "memory_bytes": _H100_DS,
            "memory_bandwidth_bytes_s": f"{_H100_DS}; {_HW}",
            "l2_bytes": f"{_H100_WP}; {_HW}",
            "tdp_w": f"{_H100_DS}; {_HW}",
            "link_bandwidth_bytes_s": _H100_DS,
        },
        aliases=("h100", "h100-sxm5", "NVIDIA H100 80GB HBM3", "NVIDIA H100"),
    ),
    _gpu(
        key="h200-sxm",
        name="NVIDIA H200 SXM 141GB",
        arch="sm_90",
        sm_count=132,
        boost_clock_mhz=1980,
        dense_tflops=_tflops(fp8=1979.0, bf16=989.0, fp16=989.0, tf32=494.5),
        memory_bytes=141 * _GB,
        memory_type="HBM3e",
        memory_bandwidth_bytes_s=4.8 * _TB_S,
        l2_bytes=60 * _MIB,
        tdp_w=700.0,
        link_bandwidth_bytes_s=450 * _GB_S,
        link_name="NVLink 4 (900 GB/s bidirectional)",
        sources={
            "sm_count": _HW,
            "boost_clock_mhz": "NVML max SM clock 1980 MHz on an H200 (shared/reference/h200-measurements.md)",
            "dense_tflops": f"{_H200_DS}; {_HW}",
            "dense_tflops.nvfp4": "no FP4 tensor cores on sm_90",
            "dense_tflops.mxfp4": "no FP4 tensor cores on sm_90",
            "dense_tflops.fp6": "no FP6 tensor cores on sm_90",
            "memory_bytes": _H200_DS,
            "memory_bandwidth_bytes_s": f"{_H200_DS}; {_HW}",
            "l2_bytes": f"{_HW}: 60 MB as seen by torch.cuda.get_device_properties (not in the datasheet)",
            "tdp_w": f"{_H200_DS}; power limit 700 W read by NVML (shared/reference/h200-measurements.md)",
            "link_bandwidth_bytes_s": _H200_DS,
        },
        unverified=("l2_bytes",),
        aliases=("h200", "h200-sxm5", "NVIDIA H200", "NVIDIA H200 141GB HBM3e"),
    ),
    _gpu(
        key="b200",
        name="NVIDIA B200",
        arch="sm_100",
        sm_count=148,
        boost_clock_mhz=None,
        dense_tflops=_tflops(nvfp4=9000.0, mxfp4=9000.0, fp6=4500.0, fp8=4500.0, bf16=2250.0, fp16=2250.0, tf32=1100.0),
        memory_bytes=180 * _GB,
        memory_type="HBM3e",
        memory_bandwidth_bytes_s=7.7 * _TB_S,
        l2_bytes=None,
        tdp_w=1000.0,
        link_bandwidth_bytes_s=900 * _GB_S,
        link_name="NVLink 5 (1.8 TB/s bidirectional)",
        sources={
            "sm_count": _HW,
            "dense_tflops": f"{_B200_DS}; {_HW}",
            "dense_tflops.fp6": "FP6 runs at the FP8 rate on sm_100 (tcgen05 kind::mxf8f6f4; shared/reference/"
            "hardware.md 'Formats')",
            "dense_tflops.mxfp4": "same tcgen05 kind::mxf4nvf4 path as NVFP4 (CUTLASS blackwell_functionality.md)",
            "memory_bytes": "NVIDIA DGX B200 datasheet: 1,440 GB for 8 GPUs",
            "memory_bandwidth_bytes_s": _HW,
            "tdp_w": _HW,
            "link_bandwidth_bytes_s": _B200_DS,
        },
        aliases=("b200-sxm", "NVIDIA B200", "hgx-b200", "dgx-b200"),
    ),
    _gpu(
        key="gb200",
        name="NVIDIA GB200 (one Blackwell GPU of the superchip)",
        arch="sm_100",
        sm_count=148,
        boost_clock_mhz=None,
        dense_tflops=_tflops(nvfp4=10000.0, mxfp4=10000.0, fp8=5000.0, bf16=2500.0, fp16=2500.0, tf32=1250.0),
        memory_bytes=186 * _GB,
        memory_type="HBM3e",
        memory_bandwidth_bytes_s=8.0 * _TB_S,
        l2_bytes=None,
        tdp_w=1200.0,
        link_bandwidth_bytes_s=900 * _GB_S,
        link_name="NVLink 5 (1.8 TB/s bidirectional)",
        sources={
            "sm_count": f"{_HW} (marked '?')",
            "dense_tflops": f"{_GB200_DS}; {_HW}",
            "dense_tflops.mxfp4": "same tcgen05 kind::mxf4nvf4 path as NVFP4",
            "dense_tflops.fp6": "not published for GB200",
            "memory_bytes": "NVIDIA GB200 NVL72 datasheet: 13.4 TB HBM3e for 72 GPUs",
            "memory_bandwidth_bytes_s": f"{_GB200_DS}; {_HW}",
            "tdp_w": _HW,
            "link_bandwidth_bytes_s": _GB200_DS,
        },
        unverified=("sm_count", "memory_bytes"),
        aliases=("gb200-nvl72", "NVIDIA GB200"),
    ),
    _gpu(
        key="b300",
        name="NVIDIA B300 (Blackwell Ultra)",
        arch="sm_103",
        sm_count=160,
        boost_clock_mhz=None,
        dense_tflops=_tflops(nvfp4=14000.0, mxfp4=14000.0, fp8=4500.0, bf16=2250.0, fp16=2250.0),
        memory_bytes=288 * _GB,
        memory_type="HBM3e",
        memory_bandwidth_bytes_s=7.75 * _TB_S,
        l2_bytes=None,
        tdp_w=1100.0,
        link_bandwidth_bytes_s=900 * _GB_S,
        link_name="NVLink 5 (1.8 TB/s bidirectional)",
        sources={
            "sm_count": _HW,
            "dense_tflops": f"{_B300_DS}; {_HW} (GB300 quoted at 15,000 FP4)",
            "dense_tflops.mxfp4": "assumed same kind::mxf4nvf4 path as NVFP4",
            "dense_tflops.tf32": "not published for B300",
            "dense_tflops.fp6": "not published for B300",
            "memory_bytes": "NVIDIA Blackwell Ultra announcement (GTC 2025): 288 GB HBM3e",
            "memory_bandwidth_bytes_s": _HW,
            "tdp_w": _HW,
            "link_bandwidth_bytes_s": _B300_DS,
        },
        unverified=("memory_bytes", "dense_tflops.mxfp4"),
        aliases=("b300-sxm", "NVIDIA B300", "hgx-b300", "blackwell-ultra"),
    ),
    _gpu(
        key="rtx-pro-6000-server",
        name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
        arch="sm_120",
        sm_count=188,
        boost_clock_mhz=2430,
        # 188 SMs x 4,096 dense FP4 FLOP/clk/SM x 2,430 MHz = 1,871.3 TFLOPS; FP8 and FP6 (kind::f8f6f4,
        # MMA K=32 vs K=64 for FP4) at half that, BF16/FP16 at a quarter.
        dense_tflops=_tflops(nvfp4=1871.0, mxfp4=1871.0, fp6=936.0, fp8=936.0, bf16=468.0, fp16=468.0),
        memory_bytes=96 * _GB,
        memory_type="GDDR7",
        memory_bandwidth_bytes_s=1.792 * _TB_S,
        l2_bytes=128 * _MB,
        tdp_w=600.0,
        link_bandwidth_bytes_s=_PCIE5_X16,
        link_name="PCIe 5.0 x16 (no NVLink)",
        sources={
            "sm_count": f"{_RTXPRO_DS}: 24,064 CUDA cores = 188 SMs x 128; {_HW}",
            "boost_clock_mhz": _HW,
            "dense_tflops": f"{_HW}: 1,871 dense FP4 @ 2,430 MHz (the seed quotes 3,700 sparse / 1,850 dense)",
            "dense_tflops.fp6": "FP6 shares the kind::f8f6f4 MMA with FP8 (cute/arch/mma_sm120.hpp, K=32 vs 64 "
            "for FP4): assumed FP8 rate",
            "dense_tflops.tf32": "not published for the RTX PRO 6000",
            "memory_bytes": _RTXPRO_DS,
            "memory_bandwidth_bytes_s": f"{_RTXPRO_DS}: 512-bit GDDR7 at 28 Gbps = 1,792 GB/s (one user measured "
            f"1.597 TB/s; {_HW})",
            "l2_bytes": _HW,
            "tdp_w": _HW,
            "link_bandwidth_bytes_s": "PCIe 5.0 x16, ~63 GB/s per direction (PCI-SIG)",
        },
        unverified=("dense_tflops.fp6",),
        notes=("bf16 measured at 417 TFLOPS by one user (hardware.md) vs 468 computed",),
        aliases=(
            "rtx-pro-6000",
            "rtx-pro-6000-blackwell-server",
            "rtx pro 6000 server",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        ),
    ),
    _gpu(
        key="rtx-pro-6000-workstation",
        name="NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
        arch="sm_120",
        sm_count=188,
        boost_clock_mhz=2617,
        # Same per-SM rates as the Server Edition (4,096 FP4 FLOP/clk/SM dense) at a 2,617 MHz boost:
        # 188 x 4,096 x 2,617 MHz = 2,015 TFLOPS dense, matching the datasheet's 4,000 "AI TOPS" (sparse) / 2.
        dense_tflops=_tflops(nvfp4=2015.0, mxfp4=2015.0, fp6=1008.0, fp8=1008.0, bf16=504.0, fp16=504.0),
        memory_bytes=96 * _GB,
        memory_type="GDDR7",
        memory_bandwidth_bytes_s=1.792 * _TB_S,
        l2_bytes=128 * _MB,
        tdp_w=600.0,
        link_bandwidth_bytes_s=_PCIE5_X16,
        link_name="PCIe 5.0 x16 (no NVLink)",
        sources={
            "sm_count": _RTXPRO_DS,
            "boost_clock_mhz": _RTXPRO_DS,
            "dense_tflops": f"{_RTXPRO_DS}: 4,000 FP4 AI TOPS (sparse) -> 2,000 dense; per-SM rate x clock = 2,015",
            "dense_tflops.tf32": "not published",
            "memory_bytes": _RTXPRO_DS,
            "memory_bandwidth_bytes_s": _RTXPRO_DS,
            "l2_bytes": "same GB202 configuration as the Server Edition (hardware.md)",
            "tdp_w": _RTXPRO_DS,
            "link_bandwidth_bytes_s": "PCIe 5.0 x16, ~63 GB/s per direction (PCI-SIG)",
        },
        unverified=("boost_clock_mhz", "dense_tflops", "l2_bytes", "dense_tflops.fp6"),
        aliases=(
            "rtx-pro-6000-ws",
            "rtx pro 6000 workstation",
            "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
        ),
    ),
    _gpu(
        key="rtx-pro-6000-maxq",
        name="NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
        arch="sm_120",
        sm_count=188,
        boost_clock_mhz=2280,
        # 188 x 4,096 x 2,280 MHz = 1,756 TFLOPS dense = the datasheet's 3,511 AI TOPS (sparse) / 2.
        dense_tflops=_tflops(nvfp4=1756.0, mxfp4=1756.0, fp6=878.0, fp8=878.0, bf16=439.0, fp16=439.0),
        memory_bytes=96 * _GB,
        memory_type="GDDR7",
        memory_bandwidth_bytes_s=1.792 * _TB_S,
        l2_bytes=128 * _MB,
        tdp_w=300.0,
        link_bandwidth_bytes_s=_PCIE5_X16,
        link_name="PCIe 5.0 x16 (no NVLink)",
        sources={
            "sm_count": _RTXPRO_DS,
            "boost_clock_mhz": _RTXPRO_DS,
            "dense_tflops": f"{_RTXPRO_DS}: 3,511 FP4 AI TOPS (sparse) -> 1,756 dense",
            "dense_tflops.tf32": "not published",
            "memory_bytes": _RTXPRO_DS,
            "memory_bandwidth_bytes_s": _RTXPRO_DS,
            "l2_bytes": "same GB202 configuration as the Server Edition (hardware.md)",
            "tdp_w": _RTXPRO_DS,
            "link_bandwidth_bytes_s": "PCIe 5.0 x16, ~63 GB/s per direction (PCI-SIG)",
        },
        unverified=("boost_clock_mhz", "dense_tflops", "l2_bytes", "dense_tflops.fp6"),
        aliases=(
            "rtx-pro-6000-max-q",
            "rtx pro 6000 max-q",
            "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
        ),
    ),
    _gpu(
        key="rtx-5090",
        name="NVIDIA GeForce RTX 5090",
        arch="sm_120",
        sm_count=170,
        boost_clock_mhz=2407,
        dense_tflops=_tflops(nvfp4=1676.0, mxfp4=1676.0, fp8=838.0, bf16=419.0, fp16=419.0),
        memory_bytes=32 * _GB,
        memory_type="GDDR7",
        memory_bandwidth_bytes_s=1.792 * _TB_S,
        l2_bytes=96 * _MB,
        tdp_w=575.0,
        link_bandwidth_bytes_s=_PCIE5_X16,
        link_name="PCIe 5.0 x16 (no NVLink)",
        sources={
            "sm_count": f"{_RTX_BW_WP}; {_HW}",
            "boost_clock_mhz": _RTX_BW_WP,
            "dense_tflops": f"{_HW}: FP4 1,676 dense; FP8 ~838 and BF16 ~419 (marked '~'; GeForce parts may halve "
            f"the FP32-accumulate rate, {_RTX_BW_WP})",
            "dense_tflops.fp6": "not published",
            "dense_tflops.tf32": "not published",
            "memory_bytes": _RTX_BW_WP,
            "memory_bandwidth_bytes_s": _HW,
            "l2_bytes": _HW,
            "tdp_w": _HW,
            "link_bandwidth_bytes_s": "PCIe 5.0 x16, ~63 GB/s per direction (PCI-SIG)",
        },
        unverified=("dense_tflops.fp8", "dense_tflops.bf16", "dense_tflops.fp16", "boost_clock_mhz"),
        aliases=("5090", "rtx5090", "geforce-rtx-5090", "NVIDIA GeForce RTX 5090"),
    ),
    _gpu(
        key="l40s",
        name="NVIDIA L40S",
        arch="sm_89",
        sm_count=142,
        boost_clock_mhz=2520,
        dense_tflops=_tflops(fp8=733.0, bf16=362.0, fp16=362.0, tf32=183.0),
        memory_bytes=48 * _GB,
        memory_type="GDDR6",
        memory_bandwidth_bytes_s=864 * _GB_S,
        l2_bytes=None,
        tdp_w=350.0,
        link_bandwidth_bytes_s=_PCIE4_X16,
        link_name="PCIe 4.0 x16 (no NVLink)",
        sources={
            "sm_count": f"{_L40S_DS}; {_HW}",
            "boost_clock_mhz": _L40S_DS,
            "dense_tflops": f"{_L40S_DS}: FP8 1,466 / BF16 733 / TF32 366 sparse; {_HW}",
            "dense_tflops.nvfp4": "no FP4 tensor cores on sm_89",
            "dense_tflops.mxfp4": "no FP4 tensor cores on sm_89",
            "dense_tflops.fp6": "no FP6 tensor cores on sm_89",
            "memory_bytes": _L40S_DS,
            "memory_bandwidth_bytes_s": _L40S_DS,
            "tdp_w": _L40S_DS,
            "link_bandwidth_bytes_s": "PCIe 4.0 x16, ~31.5 GB/s per direction (PCI-SIG)",
        },
        unverified=("boost_clock_mhz",),
        aliases=("NVIDIA L40S", "l40-s"),
    ),
    _gpu(
        key="a100-sxm-80gb",
        name="NVIDIA A100 SXM4 80GB",
        arch="sm_80",
        sm_count=108,
        boost_clock_mhz=1410,
        dense_tflops=_tflops(bf16=312.0, fp16=312.0, tf32=156.0),
        memory_bytes=80 * _GB,
        memory_type="HBM2e",
        memory_bandwidth_bytes_s=2.039 * _TB_S,
        l2_bytes=40 * _MB,
        tdp_w=400.0,
        link_bandwidth_bytes_s=300 * _GB_S,
        link_name="NVLink 3 (600 GB/s bidirectional)",
        sources={
            "sm_count": f"{_A100_DS}; {_HW}",
            "boost_clock_mhz": _A100_DS,
            "dense_tflops": f"{_A100_DS}; {_HW}",
            "dense_tflops.fp8": "no FP8 tensor cores on sm_80",
            "dense_tflops.nvfp4": "no FP4 tensor cores on sm_80",
            "dense_tflops.mxfp4": "no FP4 tensor cores on sm_80",
            "dense_tflops.fp6": "no FP6 tensor cores on sm_80",
            "memory_bytes": _A100_DS,
            "memory_bandwidth_bytes_s": f"{_A100_DS}; {_HW}",
            "l2_bytes": f"{_A100_DS}; {_HW}",
            "tdp_w": f"{_A100_DS}; {_HW}",
            "link_bandwidth_bytes_s": _A100_DS,
        },
        aliases=("a100", "a100-80gb", "a100-sxm", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB"),
    ),
    _gpu(
        key="mi300x",
        name="AMD Instinct MI300X",
        vendor="AMD",
        arch="gfx942",
        sm_count=304,
        boost_clock_mhz=2100,
        dense_tflops=_tflops(fp8=2614.9, bf16=1307.4, fp16=1307.4, tf32=653.7),
        memory_bytes=192 * _GB,
        memory_type="HBM3",
        memory_bandwidth_bytes_s=5.3 * _TB_S,
        l2_bytes=None,
        tdp_w=750.0,
        link_bandwidth_bytes_s=None,
        sources={
            "sm_count": f"{_MI300X_DS}: 304 compute units (stored as sm_count); {_HW}",
            "boost_clock_mhz": _MI300X_DS,
            "dense_tflops": f"{_MI300X_DS}: BF16 1,307.4 dense (hardware.md); FP8 2,614.9 and TF32 653.7 dense",
            "dense_tflops.nvfp4": "no FP4 matrix cores on CDNA3",
            "dense_tflops.mxfp4": "no FP4 matrix cores on CDNA3",
            "memory_bytes": _MI300X_DS,
            "memory_bandwidth_bytes_s": f"{_MI300X_DS}; {_HW}",
            "l2_bytes": "the 256 MB Infinity Cache is a memory-side cache, not an L2 (hardware.md); per-XCD L2 "
            "not stored",
            "tdp_w": _HW,
            "link_bandwidth_bytes_s": "Infinity Fabric figures not in the reference",
        },
        unverified=("dense_tflops.fp8", "dense_tflops.tf32"),
        aliases=("mi300", "AMD Instinct MI300X", "AMD Instinct MI300X OAM"),
    ),
    _gpu(
        key="mi355x",
        name="AMD Instinct MI355X",
        vendor="AMD",
        arch="gfx950",
        sm_count=256,
        boost_clock_mhz=None,
        dense_tflops=_tflops(fp8=5000.0),
        memory_bytes=288 * _GB,
        memory_type="HBM3e",
        memory_bandwidth_bytes_s=8.0 * _TB_S,
        l2_bytes=None,
        tdp_w=1400.0,
        link_bandwidth_bytes_s=None,
        sources={
            "sm_count": f"{_MI355X_DS}: 256 compute units; {_HW}",
            "dense_tflops": f"{_HW}: FP8 5 PF",
            "dense_tflops.nvfp4": "AMD quotes a 20.1 PF FP4 'max' without saying dense or sparse: not stored",
            "dense_tflops.mxfp4": "AMD quotes a 20.1 PF FP4 'max' without saying dense or sparse: not stored",
            "dense_tflops.bf16": "marked '?' in hardware.md: not stored",
            "memory_bytes": _MI355X_DS,
            "memory_bandwidth_bytes_s": f"{_MI355X_DS}; {_HW}",
            "tdp_w": _HW,
            "link_bandwidth_bytes_s": "Infinity Fabric figures not in the reference",
        },
        unverified=("dense_tflops.fp8", "memory_bytes"),
        aliases=("mi355", "AMD Instinct MI355X"),
    ),
)


def _norm(name: str) -> str:
    """Loose key for lookups: lower case, runs of spaces/underscores/dashes -> one dash."""
    return re.sub(r"[\s_\-]+", "-", name.strip().lower())


def list_gpus() -> list[GpuSpec]:
    """Every GPU in the catalog, in table order."""
    return list(_GPUS)


def get_gpu(name: str) -> GpuSpec:
    """Find a GPU by key, alias, or the exact name NVML reports; close matches on failure."""
    key = _norm(name)
    for gpu in _GPUS:
        if key == _norm(gpu.key) or key == _norm(gpu.name) or any(key == _norm(a) for a in gpu.aliases):
            return gpu
    candidates: dict[str, str] = {}
    for gpu in _GPUS:
        for label in (gpu.key, gpu.name, *gpu.aliases):
            candidates.setdefault(_norm(label), gpu.key)
    close = difflib.get_close_matches(key, list(candidates), n=6, cutoff=0.5)
    suggestions = list(dict.fromkeys(candidates[c] for c in close))[:3]
    raise UnknownNameError("GPU", name, suggestions)
