"""Shared-memory and pipeline-stage feasibility of CUTLASS-style GEMM tiles, and the small-M cost of a tile.

Why this exists: "the 128x256 NVFP4 tile fails on SM120, so the GPU cannot run it" is only sometimes true. Whether a
CUTLASS 3.x/4.x warp-specialized GEMM fits in shared memory depends on the operand formats (and how CUTLASS stores
them in shared memory), the K tile, the scale-factor layout, the epilogue, dense vs grouped (ptr-array) kernels and
alignment padding that CUTLASS's own stage formula leaves out. This module mirrors, struct by struct, what the
collective builders of the ``nvidia-cutlass`` 4.2.0.0 package (CUTLASS 4.2.0) compute:

1. the mainloop: per stage the A tile, the B tile, the scale-factor tiles (block-scaled formats) and the pipeline
   barrier, and the stage count ``StageCountAutoCarveout<sizeof(epilogue SharedStorage)>`` picks;
2. the epilogue's shared storage (smem C/D sub-tiles, fusion scratch, C-load pipeline, tensor maps);
3. the kernel's own extras (tile-scheduler pipeline and responses, barriers, TMA descriptors for grouped kernels);
4. C++ struct layout: every member at its ``alignas`` boundary, every struct rounded to its alignment. The stage
   formula ignores this; it is how a tile that "fits by the formula" asks for more than the GPU has.

``docs/tiles.md`` maps every term to the CUTLASS source it mirrors; ``docs/cutlass-probe/`` holds the probe that
compiles the real builders and the table (``results.json``) the tests compare this model against, combination by
combination. The model is pure arithmetic: no CUDA, no GPU.

Scope: SM120/SM121 block-scaled (NVFP4, MXFP4, MXFP6, MXFP8, and MXFP8 x MXFP4), SM100 block-scaled (1-SM and 2-SM
UMMA), SM90 plain BF16/FP16/FP8; row-major output, TN operands, cluster 1x1 (2x1 for SM100 2-SM). SM80/SM86/SM89 get a
plain multistage estimate (A+B per stage, epilogue reusing mainloop memory) that is not verified against CUTLASS.
SM103 uses the SM100 model (CUTLASS has separate SM103 builders; not probed).

Small-M cost (``small_m_cost``): with M tokens routed to an expert, a tile of M_tile rows does ceil(M/M_tile) * M_tile
rows of MMA work; the rest is padding. Together with the number of CTAs against SMs (waves) this bounds the fraction
of tensor-core peak the GEMM can reach.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from servescope.errors import ConfigError, UnknownNameError
from servescope.hardware import ArchSpec, get_arch

#: CUTLASS release whose builders this module mirrors (PyPI ``nvidia-cutlass`` 4.2.0.0 ships its headers).
CUTLASS_VERSION = "4.2.0"

# --------------------------------------------------------------------------------------------- formats

_SF_UE4M3 = "ue4m3"
_SF_UE8M0 = "ue8m0"


@dataclass(frozen=True, slots=True)
class OperandFormat:
    """A GEMM operand format: element width and, for block-scaled formats, its scale-factor block.

    ``bits`` is the element width in global memory; how many bits the element takes in *shared* memory depends on the
    MMA instruction CUTLASS picks (``smem_bits`` in ``_sm1xx_instr``). ``sf_vector`` is the number of elements sharing
    one 8-bit scale factor (0 for plain formats).
    """

    name: str
    bits: int
    sf_vector: int = 0
    sf_type: str = ""
    description: str = ""

    @property
    def block_scaled(self) -> bool:
        return self.sf_vector > 0


#: Operand formats. Block sizes and scale types: OCP MX spec v1.0 (MXFP4/6/8: 32 elements per UE8M0 scale) and
#: NVIDIA NVFP4 (16 elements per UE4M3 scale); CUTLASS types nv_float4_t / mx_float{4,6,8}_t in float_subbyte.h.
FORMATS: dict[str, OperandFormat] = {
    "nvfp4": OperandFormat("nvfp4", 4, 16, _SF_UE4M3, "E2M1, 16 per UE4M3 scale"),
    "mxfp4": OperandFormat("mxfp4", 4, 32, _SF_UE8M0, "E2M1, 32 per UE8M0 scale"),
    "mxfp6": OperandFormat("mxfp6", 6, 32, _SF_UE8M0, "E3M2, 32 per UE8M0 scale"),
    "mxfp8": OperandFormat("mxfp8", 8, 32, _SF_UE8M0, "E4M3, 32 per UE8M0 scale"),
    "fp8": OperandFormat("fp8", 8, 0, "", "E4M3, per-tensor scale"),
    "bf16": OperandFormat("bf16", 16),
    "fp16": OperandFormat("fp16", 16),
}

_FORMAT_ALIASES = {"fp4": "nvfp4", "e4m3": "fp8", "fp8_e4m3": "fp8", "bfloat16": "bf16", "half": "fp16",
                   "float16": "fp16"}


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """The GEMM output D (and, with ``source``, the C it reads): element width and block-scale generation."""

    name: str
    bits: int
    sf_vector: int = 0


#: Outputs the epilogue model covers. ``nvfp4`` = E2M1 D plus one generated UE4M3 scale per 16 outputs
#: (LinCombBlockScaleFactor, CUTLASS examples 72b/79b/79d); its C, when read, is bf16.
OUTPUTS: dict[str, OutputFormat] = {
    "bf16": OutputFormat("bf16", 16),
    "fp16": OutputFormat("fp16", 16),
    "fp32": OutputFormat("fp32", 32),
    "nvfp4": OutputFormat("nvfp4", 4, 16),
}

#: Architecture families by compute capability; the model that applies to each.
_FAMILY = {"sm_80": "sm80", "sm_86": "sm80", "sm_89": "sm80", "sm_90": "sm90", "sm_100": "sm100",
           "sm_103": "sm100", "sm_120": "sm120", "sm_121": "sm120"}

#: Families whose numbers were compared against CUTLASS itself (docs/cutlass-probe/results.json).
VERIFIED_FAMILIES = ("sm90", "sm100", "sm120")

SCHEDULES = {
    "sm120": ("cooperative", "pingpong"),
    "sm100": ("1sm", "2sm"),
    "sm90": ("cooperative", "pingpong"),
    "sm80": ("multistage",),
}


def get_format(name: str) -> OperandFormat:
    """Look up an operand format ("nvfp4", "mxfp8", "bf16", ...); unknown names raise ``UnknownNameError``."""
    key = name.strip().lower().replace("-", "_")
    key = _FORMAT_ALIASES.get(key, key)
    if key not in FORMATS:
        raise UnknownNameError("operand format", name, _close(key, FORMATS))
    return FORMATS[key]


def get_output(name: str) -> OutputFormat:
    """Look up an output format ("bf16", "fp16", "fp32", "nvfp4")."""
    key = name.strip().lower()
    key = _FORMAT_ALIASES.get(key, key)
    if key not in OUTPUTS:
        raise UnknownNameError("output format", name, _close(key, OUTPUTS))
    return OUTPUTS[key]


def _close(key: str, names: dict[str, Any]) -> list[str]:
    import difflib

    return difflib.get_close_matches(key, list(names), n=3, cutoff=0.5)


# --------------------------------------------------------------------------------------------- tiles


@dataclass(frozen=True, slots=True, order=True)
class Tile:
    """A CTA (for SM100 2-SM: MMA) tile: M rows of A/D, N columns of B/D, K depth per mainloop step."""

    m: int
    n: int
    k: int

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


_TILE_RE = re.compile(r"^\s*(\d+)\s*[xX,]\s*(\d+)\s*[xX,]\s*(\d+)\s*$")


def parse_tile(text: str) -> Tile:
    """Parse "128x256x128" (M x N x K); anything else raises ``ConfigError``."""
    m = _TILE_RE.match(text)
    if not m:
        raise ConfigError(f"bad tile {text!r}: expected MxNxK, e.g. 128x256x128")
    tile = Tile(*(int(g) for g in m.groups()))
    for dim, value in zip("MNK", (tile.m, tile.n, tile.k), strict=True):
        if value <= 0 or value % 8:
            raise ConfigError(f"bad tile {text!r}: {dim}={value} must be a positive multiple of 8")
        if value > 1024:
            raise ConfigError(f"bad tile {text!r}: {dim}={value} is larger than any CUTLASS tile (max 1024)")
    return tile


def default_tiles(arch: str, a: str, b: str | None = None) -> tuple[Tile, ...]:
    """The commonly used tiles for an architecture and operand formats (what ``servescope tiles`` shows by default).

    SM120: the block-scaled tiles of CUTLASS examples 79a-d and the FlashInfer/TensorRT-LLM SM120 MoE tactics
    (K 128 or 256, 64 for NVFP4; 128x64 shows why N < 128 does not build in CUTLASS 4.2); SM100: 1-SM and 2-SM
    UMMA tiles of examples 72/75 (K 256 for 4-bit, 128 for 8-bit); SM90: cooperative 128-row and ping-pong 64-row
    tiles of examples 48/54 (K = 128 bytes).
    """
    family = _family(get_arch(arch))
    fa = get_format(a)
    fb = get_format(b) if b else fa
    narrow = max(fa.bits, fb.bits) <= 4
    if family == "sm120":
        names = ["128x128x128", "128x128x256", "128x256x128", "256x128x128", "256x256x128", "128x64x128"]
        if fa.sf_vector == fb.sf_vector == 16:
            names += ["128x128x64", "128x256x64"]  # K 64 holds whole scale-factor blocks only for NVFP4
    elif family == "sm100":
        k = 256 if narrow else 128
        names = [f"128x64x{k}", f"128x128x{k}", f"128x192x{k}", f"128x256x{k}", f"256x128x{k}", f"256x256x{k}"]
    elif family == "sm90":
        k = 128 * 8 // max(fa.bits, fb.bits)
        names = [f"128x128x{k}", f"128x256x{k}", f"256x128x{k}", f"128x64x{k}", f"64x128x{k}", f"64x256x{k}"]
    else:
        k = 64 * 8 // max(fa.bits, fb.bits) // 2
        names = [f"128x128x{k}", f"128x256x{k}", f"256x128x{k}", f"64x64x{k}"]
    return tuple(parse_tile(n) for n in names)


def default_schedule(arch: str, tile: Tile) -> str:
    """The schedule a tile normally runs with: SM100 2-SM for M=256; SM90 ping-pong below 128 rows; else cooperative."""
    family = _family(get_arch(arch))
    if family == "sm100":
        return "2sm" if tile.m == 256 else "1sm"
    if family == "sm90":
        return "pingpong" if tile.m < 128 else "cooperative"
    if family == "sm80":
        return "multistage"
    return "cooperative"


def _family(spec: ArchSpec) -> str:
    if spec.name not in _FAMILY:
        raise ConfigError(f"architecture {spec.name} has no CUTLASS GEMM tile model; try sm_80, sm_89, sm_90, sm_100 "
                          f"or sm_120")
    return _FAMILY[spec.name]


# --------------------------------------------------------------------------------------------- C++ struct layout


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class _Blob:
    """sizeof and alignof of one C++ object."""

    size: int
    align: int = 1


def _struct(*members: _Blob, align: int = 1) -> _Blob:
    """Layout of a C++ struct: each member at its alignment, the whole rounded to the largest (an empty struct is 1)."""
    offset = 0
    for m in members:
        offset = _round_up(offset, m.align) + m.size
        align = max(align, m.align)
    return _Blob(_round_up(max(offset, 1), align), align)


def _union(*members: _Blob, align: int = 1) -> _Blob:
    align = max([align, *(m.align for m in members)])
    return _Blob(_round_up(max([1, *(m.size for m in members)]), align), align)


def _aligned(blob: _Blob, align: int) -> _Blob:
    """``alignas(align)`` on a member."""
    return _Blob(_round_up(blob.size, max(align, blob.align)), max(align, blob.align))


#: One mbarrier: cutlass::arch::ClusterBarrier / ClusterTransactionBarrier hold a uint64_t (cutlass/arch/barrier.h).
_MBARRIER = _Blob(8, 8)
#: cute::TmaDescriptor is a 128-byte, 64-byte-aligned CUtensorMap (cute/arch/copy_sm90_desc.hpp).
_TMA_DESCRIPTOR = _Blob(128, 64)
#: An empty class (PipelineEmpty::SharedStorage, PersistentTileSchedulerSm90::SharedStorage): sizeof 1.
_EMPTY = _Blob(1, 1)


def _pipeline(stages: int) -> _Blob:
    """PipelineTmaAsync / PipelineTransactionAsync / PipelineAsync / PipelineTmaUmmaAsync / PipelineUmmaAsync /
    PipelineCLCFetchAsync ``SharedStorage``: a full and an empty barrier per stage (cutlass/pipeline/sm90_pipeline.hpp,
    sm100_pipeline.hpp)."""
    return _struct(_Blob(8 * stages, 8), _Blob(8 * stages, 8))


def _ordered_barrier(depth: int, length: int) -> _Blob:
    """OrderedSequenceBarrier<depth, length>::SharedStorage: depth x length barriers (sm90_pipeline.hpp)."""
    return _Blob(8 * depth * length, 8)


def _array_aligned(nbytes: int) -> _Blob:
    """cute::array_aligned<T, N> (alignas 16); N = 0 is an empty cute::array (1 byte) padded to 16."""
    return _Blob(_round_up(max(nbytes, 1), 16), 16)


def _array_engine(nbytes: int, element_bits: int) -> _Blob:
    """cute::ArrayEngine<T, N>: array_aligned (16) for byte-sized T, array_subbyte (uint8_t storage) below 8 bits."""
    if element_bits % 8 == 0:
        return _array_aligned(nbytes)
    return _Blob(max(nbytes, 1), 1)


def _swizzle_alignment(contiguous_elems: int, bits: int) -> int:
    """Alignment (bytes) of the smem layout atom ``ss_smem_selector`` picks for a K-major (row-major) tile whose
    contiguous extent is ``contiguous_elems``: the widest of SW128/SW64/SW32/INTER (1024/512/256/128 bits of K per
    row) that divides it; ``alignment_for_swizzle(Swizzle<B,M,S>) = 2^(B+M+S)`` = 1024/512/256/128 bytes
    (cutlass/gemm/collective/builders/sm90_common.inl, cutlass/detail/layout.hpp)."""
    for atom_bits, align in ((1024, 1024), (512, 512), (256, 256), (128, 128)):
        if contiguous_elems % (atom_bits // bits) == 0:
            return align
    raise _Reject(f"epilogue tile N={contiguous_elems} is not a multiple of {128 // bits} elements (no smem atom)")


class _Reject(Exception):
    """Internal: CUTLASS would refuse this combination at compile time (a static_assert); carries the reason."""


#: Suffix of rejections that come from a static_assert in the kernel body: only a complete kernel build (device code)
#: reaches them, not the host-side instantiation of the builders (docs/cutlass-probe "full build").
KERNEL_BODY = "(kernel body)"
KERNEL_BODY_COOPERATIVE_M = ("Cooperative kernel requires Tile Size to be greater than or equal to 128 along the "
                             f"M-dimension. {KERNEL_BODY}")

# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class StageFormula:
    """What the builder's stage formula sees: bytes per stage and the capacity it divides."""

    a_bytes: int
    b_bytes: int
    sfa_bytes: int
    sfb_bytes: int
    barrier_bytes: int
    capacity_bytes: int
    carveout_bytes: int

    @property
    def stage_bytes(self) -> int:
        return self.a_bytes + self.b_bytes + self.sfa_bytes + self.sfb_bytes + self.barrier_bytes

    @property
    def stages(self) -> int:
        """``(capacity - carveout) / bytes per stage``, as ``StageCountAutoCarveout`` computes it."""
        return (self.capacity_bytes - self.carveout_bytes) // self.stage_bytes

    def bytes_for(self, stages: int) -> int:
        """Shared memory the formula believes ``stages`` stages take, epilogue carve-out included."""
        return stages * self.stage_bytes + self.carveout_bytes


@dataclass(frozen=True, slots=True)
class TileReport:
    """Feasibility of one tile for one kernel configuration. All sizes are bytes of shared memory per CTA.

    ``total_bytes`` is ``sizeof(GemmKernel::SharedStorage)``, what the launch requests; ``fits`` compares it with the
    architecture's per-block opt-in maximum. ``formula_bytes`` is what the stage formula accounted for; the difference
    is alignment padding plus kernel storage the formula does not count (``padding_bytes`` / ``extras_bytes``).
    ``fits_by_formula_only`` flags tiles the builder accepts but whose launch asks for more than the GPU has.
    """

    arch: str
    family: str
    a: str
    b: str
    out: str
    source: bool
    grouped: bool
    schedule: str
    tile: Tile
    compiles: bool
    fits: bool
    reason: str
    stages: int
    formula: StageFormula | None
    formula_bytes: int
    mainloop_bytes: int
    epilogue_bytes: int
    extras_bytes: int
    padding_bytes: int
    total_bytes: int
    capacity_bytes: int
    fits_by_formula_only: bool
    verified: bool
    rejections: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    detail: dict[str, int] = field(default_factory=dict, hash=False, compare=False)

    @property
    def kernel(self) -> str:
        return "grouped" if self.grouped else "dense"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the CLI's ``--json``)."""
        formula = None
        if self.formula is not None:
            f = self.formula
            formula = {"a_bytes": f.a_bytes, "b_bytes": f.b_bytes, "sfa_bytes": f.sfa_bytes, "sfb_bytes": f.sfb_bytes,
                       "barrier_bytes": f.barrier_bytes, "stage_bytes": f.stage_bytes,
                       "capacity_bytes": f.capacity_bytes, "carveout_bytes": f.carveout_bytes,
                       "formula_stages": f.stages}
        return {
            "arch": self.arch, "family": self.family, "a": self.a, "b": self.b, "out": self.out,
            "source": self.source, "kernel": self.kernel, "schedule": self.schedule, "tile": str(self.tile),
            "compiles": self.compiles, "fits": self.fits, "reason": self.reason, "stages": self.stages,
            "stage_formula": formula, "formula_bytes": self.formula_bytes, "mainloop_bytes": self.mainloop_bytes,
            "epilogue_bytes": self.epilogue_bytes, "extras_bytes": self.extras_bytes,
            "padding_bytes": self.padding_bytes, "total_bytes": self.total_bytes,
            "capacity_bytes": self.capacity_bytes, "fits_by_formula_only": self.fits_by_formula_only,
            "verified_against_cutlass": self.verified, "rejections": list(self.rejections),
            "notes": list(self.notes), "detail": dict(self.detail),
        }


# --------------------------------------------------------------------------------------------- epilogue


@dataclass(frozen=True, slots=True)
class _Epilogue:
    tensor: _Blob  # CollectiveEpilogue::TensorStorage
    pipeline: _Blob  # CollectiveEpilogue::PipelineStorage (C-load pipeline)
    tensormaps: _Blob | None  # CollectiveEpilogue::TensorMapStorage (ptr-array only)
    shared: _Blob  # CollectiveEpilogue::SharedStorage: the stage formula's carve-out
    stages_c: int
    tile_mn: tuple[int, int]


def _epilogue_storage(*, epi_m: int, epi_n: int, out: OutputFormat, source: bool,
                      stages_c: int, stages_d: int, reuse_smem_c: bool, fusion: _Blob, tensormaps: _Blob | None
                      ) -> _Epilogue:
    """sizeof the TMA warp-specialized epilogue's SharedStorage (sm90_epilogue_tma_warpspecialized.hpp,
    sm90_epilogue_array_tma_warpspecialized.hpp, sm100_epilogue_tma_warpspecialized.hpp; same struct shape):
    smem C (StagesC sub-tiles, only when C is read) and smem D (StagesD sub-tiles, or StagesC when C's buffer is
    reused), each at its swizzle alignment; the fusion's scratch; the C-load pipeline; tensor maps for ptr-array."""
    c_bits = 16 if out.name == "nvfp4" else out.bits  # nvfp4 output reads a bf16 C (examples 79b/79d)
    d_bits = out.bits
    align_d = _swizzle_alignment(epi_n, d_bits)
    align_c = _swizzle_alignment(epi_n, c_bits)
    sub_d = epi_m * epi_n * d_bits // 8
    sub_c = epi_m * epi_n * c_bits // 8
    if not source:
        collective = _union(_aligned(_Blob(sub_d * stages_d), align_d))  # CollectiveStorageWithoutC
    elif reuse_smem_c:
        biggest = max(align_c, align_d)  # CollectiveStorageReuseC: D lives in C's StagesC buffers
        collective = _union(_aligned(_Blob(sub_c * stages_c), biggest), _aligned(_Blob(sub_d * stages_c), biggest))
    else:  # CollectiveStorageWithC
        collective = _struct(_aligned(_Blob(sub_c * stages_c), align_c), _aligned(_Blob(sub_d * stages_d), align_d))
    tensor = _struct(collective, fusion)
    pipeline = _pipeline(stages_c)
    members = [tensor] + ([tensormaps] if tensormaps is not None else []) + [pipeline]
    return _Epilogue(tensor, pipeline, tensormaps, _struct(*members), stages_c, (epi_m, epi_n))


def _epilogue_sm90_family(family: str, tile: Tile, out: OutputFormat, source: bool, grouped: bool,
                          schedule: str) -> _Epilogue:
    """Epilogue of SM90 kernels and of SM120 (whose builder re-uses the SM90 collective, epilogue/collective/builders/
    sm120_builder.inl). Sub-tile: SM120 64x32 (sm120_compute_tile_shape_or_override); SM90 cooperative
    min(128, M) x gcd(min(32, N), N), ping-pong min(64, M) x 32 (64 for 8-bit D) (sm90_compute_tile_shape_or_override).
    Stages (sm90/sm120_get_tma_dispatch_policy): StagesD = min(sub-tiles, 2); C's buffer is reused for D when C and D
    have the same width above 8 bits, and then StagesC = max(min(sub-tiles, cap), StagesD + 1), cap 2 on SM120 and 4
    on SM90; otherwise StagesC = StagesD on SM120 and min(sub-tiles, 4) on SM90."""
    if family == "sm120":
        epi_m, epi_n = 64, 32
        cap = 2
    elif schedule == "cooperative":
        epi_m, epi_n = min(128, tile.m), math.gcd(min(32, tile.n), tile.n)
        cap = 4
    else:
        n_perf = 64 if out.bits == 8 and tile.n % 64 == 0 else 32
        epi_m, epi_n = min(64, tile.m), math.gcd(min(n_perf, tile.n), tile.n)
        cap = 4
    if tile.m % epi_m or tile.n % epi_n:
        raise _Reject(f"epilogue sub-tile {epi_m}x{epi_n} does not divide the tile")
    sub_tiles = (tile.m // epi_m) * (tile.n // epi_n)
    c_bits = (16 if out.name == "nvfp4" else out.bits) if source else 0  # sizeof_bits<void> = 0
    reuse = c_bits == out.bits and out.bits > 8
    stages_d = min(sub_tiles, 2)
    if reuse:
        stages_c = max(min(sub_tiles, cap), stages_d + 1)
    elif family == "sm120":
        stages_c = stages_d
    else:
        stages_c = min(sub_tiles, 4)
    # Fusion scratch: LinearCombination's visitor tree holds nothing (an empty struct, 1 byte); SM120's
    # Sm120BlockScaleFactorRowStore keeps one float per quad of the 8 MMA warps = 64 floats
    # (epilogue/fusion/sm120_visitor_store_tma_warpspecialized.hpp).
    if out.sf_vector and family == "sm120":
        fusion = _array_aligned(8 * 8 * 4)
    elif out.sf_vector:
        raise _Reject("NVFP4 output (block-scale-factor epilogue) is modelled on SM100/SM120 only")
    else:
        fusion = _EMPTY
    tensormaps = None
    if grouped:
        # C plus one D descriptor per epilogue warp group (NumEpilogueWarpGroups = 2), aligned_struct<128>.
        tensormaps = _struct(_TMA_DESCRIPTOR, _TMA_DESCRIPTOR, _TMA_DESCRIPTOR, align=128)
    return _epilogue_storage(epi_m=epi_m, epi_n=epi_n, out=out, source=source,
                             stages_c=stages_c, stages_d=stages_d, reuse_smem_c=reuse, fusion=fusion,
                             tensormaps=tensormaps)


def _epilogue_sm100(cta_m: int, cta_n: int, out: OutputFormat, source: bool, grouped: bool) -> _Epilogue:
    """SM100 TMA epilogue (epilogue/collective/builders/sm100_builder.inl): for block-scaled kernels with N = 256 the
    sub-tile is min(M, 128) x 128; otherwise M = min(CTA M, 128) rows and N = the tested size for the widths
    (8192/M for 4-bit D without C, 4096/M for wider D without C; with C: 16 or 32 for 32-bit, 32 or 64 for 16-bit,
    64 for 8-bit), at least the TMA minimum, at most the CTA's N. StagesD = min(sub-tiles, 2); StagesC =
    min(sub-tiles, 4), raised to StagesD + 1 when C is wider than 8 bits (whose buffer D then reuses)."""
    c_bits = (16 if out.name == "nvfp4" else out.bits) if source else 0
    if cta_n == 256:
        epi_m, epi_n = min(cta_m, 128), 128
    else:
        epi_m = min(cta_m, 128)
        max_bits = max(c_bits if source else out.bits, out.bits)
        if not source:
            n_perf = (8192 if max_bits == 4 else 4096) // epi_m
        elif max_bits == 32:
            n_perf = 16 if (cta_m > 64 and cta_n <= 128) else 32
        elif max_bits == 16:
            n_perf = 32 if cta_n <= 128 else 64
        else:
            n_perf = 64
        n_min_c = 8 if not source else 128 // c_bits
        n_min_d = 128 // out.bits
        epi_n = min(cta_n, max(n_perf, n_min_c, n_min_d))
        if cta_n < n_min_c or cta_n < n_min_d:
            raise _Reject("CTA tile too small")
    sub_tiles = (cta_m // epi_m) * (cta_n // epi_n)
    reuse = c_bits > 8
    stages_d = min(sub_tiles, 2)
    stages_c = max(min(sub_tiles, 4), stages_d + 1) if reuse else min(sub_tiles, 4)
    tensormaps = _struct(_TMA_DESCRIPTOR, _TMA_DESCRIPTOR, align=128) if grouped else None
    return _epilogue_storage(epi_m=epi_m, epi_n=epi_n, out=out, source=source,
                             stages_c=stages_c, stages_d=stages_d, reuse_smem_c=reuse, fusion=_EMPTY,
                             tensormaps=tensormaps)


# --------------------------------------------------------------------------------------------- mainloops


@dataclass(frozen=True, slots=True)
class _Instr:
    """The block-scaled MMA CUTLASS picks (gemm/collective/builders/sm1xx_common.inl ``select_instr``)."""

    name: str  # "mxf4nvf4" (both operands 4-bit) or "mxf8f6f4"
    a_smem_bits: int
    b_smem_bits: int
    sf_vector: int


def _sm1xx_instr(fa: OperandFormat, fb: OperandFormat) -> _Instr:
    if not (fa.block_scaled and fb.block_scaled):
        raise ConfigError(f"{fa.name} x {fb.name}: SM100/SM120 block-scaled kernels need block-scaled operands "
                          f"(nvfp4, mxfp4, mxfp6, mxfp8); for plain bf16/fp8 use --arch sm90")
    if fa.sf_type != fb.sf_type or fa.sf_vector != fb.sf_vector:
        # sm120_blockscaled_mma_builder.inl / sm1xx_common.inl: "Scale factor types for A and B must be the same."
        raise _Reject("Scale factor types for A and B must be the same. "
                      f"({fa.name} uses {fa.sf_type}/{fa.sf_vector}, {fb.name} {fb.sf_type}/{fb.sf_vector})")
    if fa.bits == 4 and fb.bits == 4:
        return _Instr("mxf4nvf4", 4, 4, fa.sf_vector)
    # MXF8F6F4: every operand, 4- and 6-bit included, occupies one byte per element in shared memory
    # (SmemAllocType = uint8_t when UseMxf8f6f4).
    return _Instr("mxf8f6f4", 8, 8, fa.sf_vector)


def _sf_stage_elems(rows: int, k: int, sf_vector: int) -> int:
    """Scale factors per stage for one operand tile, as ``size(filter_zeros(SmemLayoutAtomSF))``: whole 128-row by
    4-scale blocks (Sm1xxBlockScaledConfig: Blk_MN = 128, Blk_SF = 4), i.e. floor(rows/128)*128 rows times
    floor(K/sf_vector/4)*4 scales. Callers pass rows already padded where the builder pads (SM100 SFB)."""
    return (rows // 128) * 128 * ((k // sf_vector // 4) * 4)


@dataclass(frozen=True, slots=True)
class _Mainloop:
    formula: StageFormula
    stages: int
    tensor: _Blob  # CollectiveMainloop::TensorStorage
    pipeline: _Blob  # CollectiveMainloop::PipelineStorage
    tensormaps: _Blob | None
    min_stages: int
    parts: dict[str, int]


def _sm120_mainloop(fa: OperandFormat, fb: OperandFormat, tile: Tile, carveout: int, capacity: int,
                    grouped: bool, schedule: str, rejections: list[str]) -> _Mainloop:
    """SM120 block-scaled mainloop (gemm/collective/builders/sm120_blockscaled_mma_builder.inl,
    gemm/collective/sm120_blockscaled_mma_tma.hpp, sm120_blockscaled_mma_array_tma.hpp)."""
    instr = _sm1xx_instr(fa, fb)
    if tile.n < 32:
        rejections.append('Invalid tile shape N. (static_assert: N >= 32)')
    both_6_to_8 = 6 <= fa.bits <= 8 and 6 <= fb.bits <= 8
    if grouped and schedule == "pingpong" and both_6_to_8:
        # select_instr's static_assert lists the dense ping-pong tag but not KernelPtrArrayTmaWarpSpecializedPingpong.
        rejections.append('Incorrect SfVectorSize for MX_F4F6F8 is deduced. (grouped ping-pong with 6/8-bit operands)')
    atom_k = 64 if instr.name == "mxf4nvf4" else 32
    perm_m = min(tile.m, 128)
    if tile.m % perm_m or tile.m % 64 or tile.n % 32 or tile.k % atom_k:
        rejections.append(f"tile {tile} is not a multiple of the SM120 MMA permutation "
                          f"({perm_m} x 32 x {atom_k}; M a multiple of 64)")
    # stage formula: sm100_compute_stage_count_or_override_blockscaled (sm100_blockscaled_umma_builder.inl)
    sfa = _sf_stage_elems(tile.m, tile.k, instr.sf_vector)
    sfb = _sf_stage_elems(tile.n, tile.k, instr.sf_vector)
    sf_k = 4 * instr.sf_vector
    # The SM120 builder sizes the scale-factor smem in whole 128-row x 4-scale blocks, rounding DOWN
    # (size<0>(TileShape) / Blk_MN). Below one block the scale-factor TMA box is smaller than the tile and
    # make_tma_copy refuses it when the kernel's Params are built (cute/atom/copy_traits_sm90_tma.hpp); above one
    # block but not a multiple of it, a layout division fails first (cute/layout.hpp). Both seen in the probe.
    why = (f"(SM120 scale-factor tiles need M and N multiples of 128 and K a multiple of {sf_k}; {tile} gets "
           f"{sfa} + {sfb} B of scale factors per stage)")
    if tile.m < 128 or tile.n < 128 or tile.k < sf_k:
        rejections.append(f"TMA requires CTA_Tile and SLayout top-level size equivalence. {why}")
    elif tile.m % 128 or tile.n % 128:
        rejections.append(f"Shape Divisibility Condition {why}")
    elif tile.k % sf_k:
        rejections.append(f"Shape Divisibility Condition {why} (K case not probed)")
    formula = StageFormula(
        a_bytes=tile.m * tile.k * instr.a_smem_bits // 8,
        b_bytes=tile.n * tile.k * instr.b_smem_bits // 8,
        sfa_bytes=sfa, sfb_bytes=sfb,
        barrier_bytes=_pipeline(1).size,  # sizeof(PipelineTmaUmmaAsync<1>::SharedStorage)
        capacity_bytes=capacity, carveout_bytes=carveout)
    stages = max(formula.stages, 0)
    if stages < 2:
        rejections.append("Specialization requires Stages set to value 2 or more. "
                          f"(2 stages need {formula.bytes_for(2):,} B > {capacity:,} B)")
    s = max(stages, 1)
    a_bits, b_bits = instr.a_smem_bits, instr.b_smem_bits
    tensor = _struct(
        _aligned(_array_engine(formula.a_bytes * s, a_bits), 1024),  # alignas(1024) smem_A
        _aligned(_array_engine(formula.b_bytes * s, b_bits), 1024),  # alignas(1024) smem_B
        _array_aligned(sfa * s), _array_aligned(sfb * s), align=128)
    pipeline = _pipeline(s)  # PipelineTmaAsync<Stages>
    tensormaps = _struct(*(_TMA_DESCRIPTOR,) * 4, align=128) if grouped else None  # A, B, SFA, SFB
    parts = {"smem_a_bytes": _array_engine(formula.a_bytes * s, a_bits).size,
             "smem_b_bytes": _array_engine(formula.b_bytes * s, b_bits).size,
             "smem_sfa_bytes": _array_aligned(sfa * s).size, "smem_sfb_bytes": _array_aligned(sfb * s).size}
    return _Mainloop(formula, stages, tensor, pipeline, tensormaps, 2, parts)


def _sm100_mainloop(fa: OperandFormat, fb: OperandFormat, tile: Tile, schedule: str, carveout: int,
                    capacity: int, kernel_carveout: int, rejections: list[str]) -> _Mainloop:
    """SM100 block-scaled UMMA mainloop (gemm/collective/builders/sm100_blockscaled_umma_builder.inl,
    gemm/collective/sm100_blockscaled_mma_{,array_}warpspecialized.hpp). A 2-SM MMA splits M and N across the CTA
    pair: each CTA stages M/2 rows of A and N/2 columns of B, but scale factors for the whole MMA N."""
    instr = _sm1xx_instr(fa, fb)
    two_sm = schedule == "2sm"
    if two_sm and tile.m not in (128, 256):
        rejections.append(f"2-SM UMMA needs M of 128 or 256, not {tile.m}")
    if not two_sm and tile.m not in (64, 128):
        rejections.append(f"1-SM UMMA needs M of 64 or 128, not {tile.m} (use the 2sm schedule for 256)")
    if tile.n % 16 or tile.n > 256:
        rejections.append(f"UMMA needs N a multiple of 16 up to 256, not {tile.n}")
    cta_a_rows = tile.m // 2 if two_sm else tile.m
    cta_b_cols = tile.n // 2 if two_sm else tile.n
    sf_n = _round_up(tile.n, 128)  # MMA_N_SFB = ceil_div(N, 128) * 128 (Sm1xxBlockScaledConfig::deduce_smem_layoutSFB)
    sfa = _sf_stage_elems(cta_a_rows, tile.k, instr.sf_vector)
    sfb = _sf_stage_elems(sf_n, tile.k, instr.sf_vector)
    formula = StageFormula(
        a_bytes=cta_a_rows * tile.k * instr.a_smem_bits // 8,
        b_bytes=cta_b_cols * tile.k * instr.b_smem_bits // 8,
        sfa_bytes=sfa, sfb_bytes=sfb, barrier_bytes=_pipeline(1).size,
        capacity_bytes=capacity - kernel_carveout, carveout_bytes=carveout)
    stages = max(formula.stages, 0)
    if stages < 1:
        rejections.append("Smem usage is too high. Can't create any SMEM buffers for A, B, SFA, and SFB. "
                          f"(1 stage needs {formula.bytes_for(1) + kernel_carveout:,} B > {capacity:,} B)")
    s = max(stages, 1)
    tensor = _struct(_array_engine(formula.a_bytes * s, instr.a_smem_bits),
                     _array_engine(formula.b_bytes * s, instr.b_smem_bits),
                     _array_aligned(sfa * s), _array_aligned(sfb * s), align=128)
    parts = {"smem_a_bytes": _array_engine(formula.a_bytes * s, instr.a_smem_bits).size,
             "smem_b_bytes": _array_engine(formula.b_bytes * s, instr.b_smem_bits).size,
             "smem_sfa_bytes": _array_aligned(sfa * s).size, "smem_sfb_bytes": _array_aligned(sfb * s).size}
    return _Mainloop(formula, stages, tensor, _pipeline(s), None, 1, parts)


def _sm90_mainloop(fa: OperandFormat, fb: OperandFormat, tile: Tile, carveout: int, capacity: int,
                   grouped: bool, rejections: list[str]) -> _Mainloop:
    """SM90 TMA + GMMA warp-specialized mainloop (gemm/collective/builders/sm90_gmma_builder.inl,
    gemm/collective/sm90_mma_{,array_}tma_gmma_ss_warpspecialized{,_fp8}.hpp). Its stage formula rounds A+B up to
    128 B, the carve-out up to 128 B and the capacity down to 128 B; grouped kernels first subtract two TMA
    descriptors and an 8-stage scheduler pipeline."""
    if fa.block_scaled or fb.block_scaled:
        raise ConfigError(f"{fa.name} x {fb.name}: sm_90 has no block-scaled (MX/NVFP4) tensor cores; use "
                          f"bf16/fp16/fp8 operands or --arch sm100 / sm120")
    if fa.bits != fb.bits:
        raise ConfigError(f"{fa.name} x {fb.name}: mixed-width SM90 GEMMs use CUTLASS's mixed-input mainloop, which "
                          f"this model does not cover")
    if tile.m % 64 or tile.n % 8 or tile.n > 256 or (tile.k * fa.bits) % 256:
        rejections.append(f"tile {tile} does not match a GMMA shape (M multiple of 64, N multiple of 8 up to 256, "
                          f"K a multiple of 32 bytes)")
    raw = tile.m * tile.k * fa.bits // 8 + tile.n * tile.k * fb.bits // 8
    formula = StageFormula(
        a_bytes=tile.m * tile.k * fa.bits // 8, b_bytes=tile.n * tile.k * fb.bits // 8, sfa_bytes=0, sfb_bytes=0,
        barrier_bytes=_round_up(raw, 128) - raw + _pipeline(1).size,
        capacity_bytes=capacity // 128 * 128, carveout_bytes=_round_up(carveout, 128))
    stages = max(formula.stages, 0)
    if stages < 2:
        rejections.append("Specialization requires Stages set to value 2 or more. "
                          f"(2 stages need {formula.bytes_for(2):,} B > {formula.capacity_bytes:,} B)")
    s = max(stages, 1)
    tensor = _struct(_array_aligned(formula.a_bytes * s), _array_aligned(formula.b_bytes * s), align=128)
    tensormaps = _struct(_TMA_DESCRIPTOR, _TMA_DESCRIPTOR, align=128) if grouped else None
    parts = {"smem_a_bytes": formula.a_bytes * s, "smem_b_bytes": formula.b_bytes * s}
    return _Mainloop(formula, stages, tensor, _pipeline(s), tensormaps, 2, parts)


# --------------------------------------------------------------------------------------------- kernels


@dataclass(frozen=True, slots=True)
class _Kernel:
    total: _Blob
    extras: int  # raw bytes of kernel-level members that are neither mainloop nor epilogue
    parts: dict[str, int]


def _kernel_sm90_family(family: str, ml: _Mainloop, epi: _Epilogue, grouped: bool, schedule: str) -> _Kernel:
    """GemmUniversal's SharedStorage for SM90 and SM120 kernels (gemm/kernel/sm90_gemm_tma_warpspecialized_
    {cooperative,pingpong}.hpp, sm90_gemm_array_tma_warpspecialized_{cooperative,pingpong}.hpp)."""
    load_order = _aligned(_ordered_barrier(1, 2), 16)
    math_order = [_aligned(_ordered_barrier(2, 2), 16)] if schedule == "pingpong" else []
    mainloop_pipe = _aligned(ml.pipeline, 16)
    epi_pipe = _aligned(epi.pipeline, 16)
    if not grouped:
        pipelines = _struct(mainloop_pipe, epi_pipe, *math_order, load_order, align=16)
        if family == "sm120":
            # TileSchedulerSelector<void, Sm120> = PersistentTileSchedulerSm100<Cluster, 3> (CLC): CLC pipeline,
            # throttle pipeline and 3 16-byte responses (gemm/kernel/tile_scheduler.hpp, sm100_tile_scheduler.hpp).
            scheduler = _struct(_aligned(_pipeline(3), 16), _aligned(_pipeline(3), 16), _Blob(16 * 3, 16))
        else:
            scheduler = _EMPTY  # PersistentTileSchedulerSm90::SharedStorage is an empty class
        tensors = _struct(epi.tensor, ml.tensor, align=128)
        total = _struct(pipelines, _aligned(scheduler, 16), tensors)
        extras = load_order.size + sum(b.size for b in math_order) + scheduler.size
        return _Kernel(total, extras, {"kernel_pipelines_bytes": pipelines.size, "scheduler_bytes": scheduler.size})
    # Ptr-array kernels: PersistentTileSchedulerSm90Group with TileSchedulerStages = 8: an 8-stage PipelineAsync and
    # eight 16-byte WorkTileInfo responses; tensor maps of mainloop and epilogue, each alignas(128).
    sched_pipe = _aligned(_pipeline(8), 16)
    if schedule == "pingpong":
        pipelines = _struct(sched_pipe, mainloop_pipe, epi_pipe, load_order, *math_order, align=16)
    else:
        pipelines = _struct(sched_pipe, mainloop_pipe, epi_pipe, load_order, align=16)
    responses = _Blob(16 * 8, 16)
    assert ml.tensormaps is not None and epi.tensormaps is not None
    tensormaps = _struct(_aligned(ml.tensormaps, 128), _aligned(epi.tensormaps, 128), align=128)
    tensors = _struct(ml.tensor, epi.tensor, align=128)
    total = _struct(tensors, pipelines, responses, tensormaps)
    extras = (sched_pipe.size + load_order.size + sum(b.size for b in math_order) + responses.size
              + ml.tensormaps.size + epi.tensormaps.size)
    return _Kernel(total, extras, {"kernel_pipelines_bytes": pipelines.size, "scheduler_bytes": sched_pipe.size
                                   + responses.size, "kernel_tensormaps_bytes": tensormaps.size})


def _sm100_kernel_carveout(grouped: bool, acc_stages: int) -> int:
    """Sm100DenseGemmTmaUmmaCarveout<...>::KernelSmemCarveout (gemm/collective/builders/sm100_pipeline_carveout.inl):
    what the SM100 builder subtracts from 232,448 B before dividing by the stage size. Scheduler stages: 8 for
    grouped, 2 for dense (sm100_blockscaled_umma_builder.inl); 4 tensor maps for ptr-array."""
    sched = 8 if grouped else 2
    return (_pipeline(acc_stages).size + _pipeline(sched).size + _ordered_barrier(1, 2).size + _MBARRIER.size
            + _pipeline(sched).size + 16 * sched + 4 * sched + (4 * _TMA_DESCRIPTOR.size if grouped else 0))


def _kernel_sm100(ml: _Mainloop, epi: _Epilogue, grouped: bool, acc_stages: int) -> _Kernel:
    """GemmUniversal's SharedStorage for SM100 (gemm/kernel/sm100_gemm_tma_warpspecialized.hpp,
    sm100_gemm_array_tma_warpspecialized.hpp): pipelines (mainloop, C load, load order, CLC or group scheduler,
    accumulator, CLC throttle, TMEM dealloc barrier), scheduler responses, the TMEM base pointer, tensor maps
    (ptr-array) and the tensors."""
    sched = 8 if grouped else 2
    a16 = [_aligned(b, 16) for b in (
        ml.pipeline, epi.pipeline, _ordered_barrier(1, 2),
        _pipeline(sched),  # CLC pipeline (dense) / PersistentTileSchedulerSm100Group's PipelineAsync<8> (grouped)
        _pipeline(acc_stages),
        _EMPTY if grouped else _pipeline(sched),  # CLC throttle: PipelineEmpty for the group scheduler
        _MBARRIER)]  # tmem_dealloc
    pipelines = _struct(*a16, align=16)
    responses = _Blob(16 * sched, 16)
    tmem_ptr = _Blob(4, 4)
    tensors = _struct(epi.tensor, ml.tensor, align=128)
    extras_members = [a16[2], a16[3], a16[4], a16[5], a16[6], responses, tmem_ptr]
    if grouped:
        ml_tms = _struct(*(_TMA_DESCRIPTOR,) * 4, align=128)
        assert epi.tensormaps is not None
        tensormaps = _struct(_aligned(epi.tensormaps, 128), _aligned(ml_tms, 128), align=128)
        total = _struct(pipelines, responses, tmem_ptr, tensormaps, tensors)
        extras_members += [ml_tms, epi.tensormaps]
    else:
        total = _struct(pipelines, responses, tmem_ptr, tensors)
    extras = sum(b.size for b in extras_members)
    return _Kernel(total, extras, {"kernel_pipelines_bytes": pipelines.size})


# --------------------------------------------------------------------------------------------- public API


def analyze_tile(arch: str, a: str, b: str | None, out: str, tile: Tile | str, *, grouped: bool = False,
                 schedule: str | None = None, source: bool = False) -> TileReport:
    """Shared memory, stage count and fit of one tile, as CUTLASS 4.2's collective builders would compute them.

    ``arch``: "sm120", "sm_100a", "sm90", ... (looked up in the GPU catalog for its per-block capacity);
    ``a``/``b``: operand formats (``b`` defaults to ``a``); ``out``: "bf16" | "fp16" | "fp32" | "nvfp4";
    ``grouped``: ptr-array grouped GEMM (MoE) instead of a dense GEMM; ``schedule``: "cooperative" | "pingpong"
    (SM90/SM120), "1sm" | "2sm" (SM100), default per tile (``default_schedule``); ``source``: the epilogue reads C.
    """
    spec = get_arch(arch)
    family = _family(spec)
    fa = get_format(a)
    fb = get_format(b) if b else fa
    fo = get_output(out)
    t = parse_tile(tile) if isinstance(tile, str) else tile
    sched = (schedule or default_schedule(spec.name, t)).strip().lower()
    if sched not in SCHEDULES[family]:
        raise ConfigError(f"schedule {sched!r} does not exist on {spec.name}; choose one of "
                          f"{', '.join(SCHEDULES[family])}")
    capacity = spec.smem_per_block_bytes
    rejections: list[str] = []
    notes: list[str] = []
    if family == "sm80":
        return _analyze_multistage(spec, fa, fb, fo, t, grouped, source)
    try:
        if family == "sm100":
            two_sm = sched == "2sm"
            cta_m = t.m // 2 if two_sm else t.m
            epi = _epilogue_sm100(cta_m, t.n, fo, source, grouped)
            acc_stages = 1 if t.n == 256 else 2
            kcarve = _sm100_kernel_carveout(grouped, acc_stages)
            ml = _sm100_mainloop(fa, fb, t, sched, epi.shared.size, capacity, kcarve, rejections)
            kernel = _kernel_sm100(ml, epi, grouped, acc_stages)
            formula_extra = kcarve
        else:
            epi = _epilogue_sm90_family(family, t, fo, source, grouped, sched)
            if family == "sm120":
                ml = _sm120_mainloop(fa, fb, t, epi.shared.size, capacity, grouped, sched, rejections)
                formula_extra = 0
            else:
                formula_extra = (2 * _TMA_DESCRIPTOR.size + _pipeline(8).size) if grouped else 0
                ml = _sm90_mainloop(fa, fb, t, epi.shared.size, capacity - formula_extra, grouped, rejections)
                if sched == "cooperative" and t.m < 128:
                    rejections.append(KERNEL_BODY_COOPERATIVE_M)
            kernel = _kernel_sm90_family(family, ml, epi, grouped, sched)
    except _Reject as err:
        rejections.append(str(err))
        return _rejected(spec, family, fa, fb, fo, t, grouped, sched, source, rejections, notes)
    if family == "sm120" and sched == "cooperative" and t.m < 128:
        rejections.append(KERNEL_BODY_COOPERATIVE_M)
    total = kernel.total.size
    mainloop_bytes = ml.tensor.size + ml.pipeline.size
    epilogue_bytes = epi.tensor.size + epi.pipeline.size
    padding = total - mainloop_bytes - epilogue_bytes - kernel.extras
    formula_bytes = ml.formula.bytes_for(max(ml.stages, 0)) + formula_extra
    if family == "sm100" and total > capacity:
        rejections.append("SMEM usage exceeded capacity. (static_assert SharedStorageSize <= 232,448)")
    compiles = not rejections
    fits = compiles and total <= capacity
    if not compiles:
        reason = rejections[0]
    elif not fits:
        reason = (f"{ml.stages} stages need {total:,} B > {capacity:,} B: the stage formula counts "
                  f"{formula_bytes:,} B and leaves out {total - formula_bytes:,} B of alignment padding and kernel "
                  f"storage")
    else:
        reason = f"{ml.stages} stages, {total:,} B <= {capacity:,} B"
    detail = {**ml.parts, "mainloop_tensor_bytes": ml.tensor.size, "mainloop_pipeline_bytes": ml.pipeline.size,
              "epilogue_tensor_bytes": epi.tensor.size, "epilogue_smem_bytes": epi.shared.size,
              "epilogue_stages_c": epi.stages_c, "epilogue_tile_m": epi.tile_mn[0], "epilogue_tile_n": epi.tile_mn[1],
              **kernel.parts}
    if spec.name in ("sm_103",):
        notes.append("sm_103 uses CUTLASS's separate SM103 builders; these numbers are the SM100 model's")
    return TileReport(
        arch=spec.name, family=family, a=fa.name, b=fb.name, out=fo.name, source=source, grouped=grouped,
        schedule=sched, tile=t, compiles=compiles, fits=fits, reason=reason, stages=ml.stages, formula=ml.formula,
        formula_bytes=formula_bytes, mainloop_bytes=mainloop_bytes, epilogue_bytes=epilogue_bytes,
        extras_bytes=kernel.extras, padding_bytes=padding, total_bytes=total, capacity_bytes=capacity,
        fits_by_formula_only=compiles and not fits, verified=_verified(spec, family),
        rejections=tuple(rejections), notes=tuple(notes), detail=detail)


def _verified(spec: ArchSpec, family: str) -> bool:
    """Checked against docs/cutlass-probe: the SM90/SM100/SM120 builders (sm_121 shares SM120's; sm_103 does not)."""
    return family in VERIFIED_FAMILIES and spec.name != "sm_103"


def _rejected(spec: ArchSpec, family: str, fa: OperandFormat, fb: OperandFormat, fo: OutputFormat, t: Tile,
              grouped: bool, sched: str, source: bool, rejections: list[str], notes: list[str]) -> TileReport:
    return TileReport(
        arch=spec.name, family=family, a=fa.name, b=fb.name, out=fo.name, source=source, grouped=grouped,
        schedule=sched, tile=t, compiles=False, fits=False, reason=rejections[0], stages=0, formula=None,
        formula_bytes=0, mainloop_bytes=0, epilogue_bytes=0, extras_bytes=0, padding_bytes=0, total_bytes=0,
        capacity_bytes=spec.smem_per_block_bytes, fits_by_formula_only=False, verified=_verified(spec, family),
        rejections=tuple(rejections), notes=tuple(notes))


def _analyze_multistage(spec: ArchSpec, fa: OperandFormat, fb: OperandFormat, fo: OutputFormat, t: Tile,
                        grouped: bool, source: bool) -> TileReport:
    """SM80/86/89 (CUTLASS 2.x multistage cp.async kernels): A+B per stage; the epilogue's staging buffer is a union
    with the mainloop's (gemm/kernel/gemm_universal.h ``union SharedStorage``), so it adds nothing. CUTLASS 2.x takes
    the stage count as a template parameter; reported here is the most that fit. Not verified against CUTLASS."""
    if fa.block_scaled or fb.block_scaled:
        raise ConfigError(f"{fa.name} x {fb.name}: {spec.name} has no block-scaled tensor cores; use bf16/fp16"
                          f"{'/fp8' if spec.name == 'sm_89' else ''} operands")
    if (fa.bits == 8 or fb.bits == 8) and spec.name != "sm_89":
        raise ConfigError(f"{spec.name} has no FP8 tensor cores (sm_89 and later)")
    stage = t.m * t.k * fa.bits // 8 + t.n * t.k * fb.bits // 8
    capacity = spec.smem_per_block_bytes
    stages = capacity // stage
    formula = StageFormula(t.m * t.k * fa.bits // 8, t.n * t.k * fb.bits // 8, 0, 0, 0, capacity, 0)
    compiles = stages >= 2
    total = stages * stage
    reason = (f"{stages} stages, {total:,} B <= {capacity:,} B" if compiles
              else f"2 stages need {2 * stage:,} B > {capacity:,} B")
    return TileReport(
        arch=spec.name, family="sm80", a=fa.name, b=fb.name, out=fo.name, source=source, grouped=grouped,
        schedule="multistage", tile=t, compiles=compiles, fits=compiles, reason=reason, stages=stages,
        formula=formula, formula_bytes=total, mainloop_bytes=total, epilogue_bytes=0, extras_bytes=0,
        padding_bytes=0, total_bytes=total, capacity_bytes=capacity, fits_by_formula_only=False, verified=False,
        notes=("CUTLASS 2.x multistage estimate (A+B per stage, epilogue sharing mainloop memory): not verified "
               "against CUTLASS",))


def analyze_tiles(arch: str, a: str, b: str | None, out: str, tiles: list[Tile | str] | None = None, *,
                  grouped: bool = False, schedule: str | None = None, source: bool = False) -> list[TileReport]:
    """``analyze_tile`` for each tile (default: ``default_tiles``)."""
    chosen = list(tiles) if tiles else list(default_tiles(arch, a, b))
    return [analyze_tile(arch, a, b, out, t, grouped=grouped, schedule=schedule, source=source) for t in chosen]


# --------------------------------------------------------------------------------------------- small-M cost


@dataclass(frozen=True, slots=True)
class SmallMCost:
    """What a tile loses when each expert (or GEMM) has only ``m_tokens`` rows.

    ``row_padding_fraction``: share of the tile rows that are padding, 1 - M / (ceil(M / M_tile) * M_tile).
    ``mma_padding_fraction``: the same over the whole M x N x K iteration space (N and K edges included).
    ``waves``: ceil(CTAs / (SMs x CTAs per SM)); ``wave_efficiency``: CTAs / (waves x SMs x CTAs per SM).
    ``efficiency_ceiling``: (1 - mma_padding_fraction) x wave_efficiency, the largest fraction of tensor-core peak
    the GEMM can reach (before any memory-bandwidth limit).
    """

    m_tokens: int
    n: int
    k: int
    tile: Tile
    groups: int
    sm_count: int
    ctas_per_sm: int
    m_tiles: int
    padded_m: int
    row_padding_fraction: float
    mma_padding_fraction: float
    cta_count: int
    waves: int
    wave_efficiency: float
    efficiency_ceiling: float

    @property
    def summary(self) -> str:
        """One sentence the roofline and diagnosis can quote."""
        return (f"at {self.m_tokens} tokens per expert a {self.tile.m}-row tile does "
                f"{self.row_padding_fraction:.0%} padding; {self.cta_count} CTAs on {self.sm_count} SMs = "
                f"{self.waves} wave{'s' if self.waves != 1 else ''} at {self.wave_efficiency:.0%} occupancy; "
                f"ceiling {self.efficiency_ceiling:.0%} of tensor peak")

    def to_dict(self) -> dict[str, Any]:
        return {"m_tokens": self.m_tokens, "n": self.n, "k": self.k, "tile": str(self.tile), "groups": self.groups,
                "sm_count": self.sm_count, "ctas_per_sm": self.ctas_per_sm, "m_tiles": self.m_tiles,
                "padded_m": self.padded_m, "row_padding_fraction": self.row_padding_fraction,
                "mma_padding_fraction": self.mma_padding_fraction, "cta_count": self.cta_count, "waves": self.waves,
                "wave_efficiency": self.wave_efficiency, "efficiency_ceiling": self.efficiency_ceiling,
                "summary": self.summary}


def small_m_cost(m_tokens: int, n: int, k: int, tile: Tile | str, sm_count: int, *, groups: int = 1,
                 ctas_per_sm: int = 1) -> SmallMCost:
    """Padding and wave cost of running an M x N x K GEMM (``groups`` of them, e.g. active experts) on ``tile``.

    ``m_tokens`` is the rows per group (tokens routed to one expert); ``ctas_per_sm`` is how many CTAs of this kernel
    one SM holds at once (1 for the large-smem tiles this module models; ``TileReport.total_bytes`` against
    ``ArchSpec.smem_per_sm_bytes`` gives it). Raises ``ConfigError`` for non-positive sizes.
    """
    t = parse_tile(tile) if isinstance(tile, str) else tile
    for name, value in (("m_tokens", m_tokens), ("n", n), ("k", k), ("sm_count", sm_count), ("groups", groups),
                        ("ctas_per_sm", ctas_per_sm)):
        if value <= 0:
            raise ConfigError(f"small-M cost: {name} must be positive, got {value}")
    m_tiles = -(-m_tokens // t.m)
    n_tiles = -(-n // t.n)
    k_steps = -(-k // t.k)
    padded_m = m_tiles * t.m
    row_pad = 1.0 - m_tokens / padded_m
    mma_pad = 1.0 - (m_tokens * n * k) / (padded_m * n_tiles * t.n * k_steps * t.k)
    ctas = groups * m_tiles * n_tiles
    slots = sm_count * ctas_per_sm
    waves = -(-ctas // slots)
    wave_eff = ctas / (waves * slots)
    return SmallMCost(m_tokens=m_tokens, n=n, k=k, tile=t, groups=groups, sm_count=sm_count, ctas_per_sm=ctas_per_sm,
                      m_tiles=m_tiles, padded_m=padded_m, row_padding_fraction=row_pad, mma_padding_fraction=mma_pad,
                      cta_count=ctas, waves=waves, wave_efficiency=wave_eff,
                      efficiency_ceiling=(1.0 - mma_pad) * wave_eff)
