"""The two numbers of every kernel point: FLOPs to do and the fewest bytes to move, and the roofline time.

A grouped expert GEMM multiplies ``local_experts`` pairs [M, k] x [k, n]. Its floor is
``max(bytes / bandwidth, flops / matmul_rate)``: at decode sizes (a few tokens per expert) the weights
dominate the bytes and the floor is the time to stream them once from HBM; past the ridge point
(about 200 FLOP/byte in bf16 on an H200) it is the tensor-core rate. A measured time over that floor is
the headroom a better kernel could win, which is what ``servescope kernels`` reports.

Byte counts are the *minimum* traffic: each weight, activation and scale read once and each output
written once. Pure Python (no torch), so the CPU tests cover it.
"""

from __future__ import annotations

from dataclasses import dataclass

from servescope.errors import ConfigError, UnknownNameError
from servescope.kernels.shapes import GemmShape

#: Bytes per stored element of weights and activations, per dtype name used on the command line.
#: nvfp4: 4-bit values plus one 1-byte (e4m3) scale per 16 elements (NVIDIA's NVFP4 block size, per the
#: Blackwell/Transformer Engine docs), i.e. 0.5 + 1/16 bytes.
ELEMENT_BYTES: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / 16.0}

#: Outputs are bf16 for every backend here (what the next MoE stage consumes).
OUTPUT_BYTES = 2.0

#: fp32 scale per activation row and per weight output channel (rowwise / channelwise fp8 scaling).
SCALE_BYTES = 4.0

DTYPES = tuple(ELEMENT_BYTES)


def check_dtype(dtype: str) -> str:
    """Return ``dtype`` if it is one we know, else a ConfigError listing the valid names."""
    if dtype not in ELEMENT_BYTES:
        raise ConfigError(f"unknown kernel dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


@dataclass(frozen=True, slots=True)
class GemmCost:
    """FLOPs and minimum bytes of one grouped GEMM call (all local experts)."""

    flops: float
    weight_bytes: float
    activation_bytes: float
    output_bytes: float
    scale_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes + self.output_bytes + self.scale_bytes

    @property
    def intensity_flops_per_byte(self) -> float:
        return self.flops / self.total_bytes


def gemm_cost(shape: GemmShape, dtype: str, tokens_per_expert: float, *, fused_silu: bool = False) -> GemmCost:
    """The two numbers for ``tokens_per_expert`` tokens on each of the shape's local experts.

    ``fused_silu``: the gate_up GEMM with SiLU(gate) * up applied in the epilogue, so the output is
    [M, n/2] instead of [M, n]; FLOPs of the activation itself (a few per output) are negligible and left out.
    """
    check_dtype(dtype)
    if tokens_per_expert < 0:
        raise ConfigError(f"tokens per expert must be >= 0, got {tokens_per_expert}")
    if fused_silu and shape.gemm != "gate_up":
        raise ConfigError("the fused SiLU-and-multiply epilogue applies to the gate_up GEMM only")
    e, m, n, k = shape.local_experts, float(tokens_per_expert), shape.n, shape.k
    elem = ELEMENT_BYTES[dtype]
    n_out = n // 2 if fused_silu else n
    scales = SCALE_BYTES * e * (m + n) if dtype == "fp8" else 0.0
    return GemmCost(
        flops=2.0 * e * m * n * k,
        weight_bytes=elem * e * n * k,
        activation_bytes=elem * e * m * k,
        output_bytes=OUTPUT_BYTES * e * m * n_out,
        scale_bytes=scales,
    )


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Memory bandwidth and matrix rate per dtype that a roofline is drawn against.

    ``source`` says where they come from: ``measured`` (a device-to-device copy counting read + write, and a
    large matrix product, in the same run) or ``datasheet`` (vendor figures, sourced where defined).
    """

    bandwidth_bytes_s: float
    matmul_flops_s: dict[str, float]
    source: str

    def ideal_time_s(self, cost: GemmCost, dtype: str) -> float:
        """The roofline floor: the larger of the memory time and the compute time."""
        rate = self.matmul_flops_s.get(dtype)
        compute_s = cost.flops / rate if rate else 0.0
        return max(cost.total_bytes / self.bandwidth_bytes_s, compute_s)

    def bound(self, cost: GemmCost, dtype: str) -> str:
        """Which term sets the floor: ``memory`` or ``compute``."""
        rate = self.matmul_flops_s.get(dtype)
        if not rate:
            return "memory"
        return "compute" if cost.flops / rate > cost.total_bytes / self.bandwidth_bytes_s else "memory"

    def to_dict(self) -> dict[str, object]:
        return {"bandwidth_bytes_s": self.bandwidth_bytes_s, "matmul_flops_s": dict(self.matmul_flops_s),
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Ceilings:
        rates = data.get("matmul_flops_s") or {}
        if not isinstance(rates, dict):
            raise ValueError("matmul_flops_s must be an object")
        return cls(bandwidth_bytes_s=float(data["bandwidth_bytes_s"]),  # type: ignore[arg-type]
                   matmul_flops_s={str(k): float(v) for k, v in rates.items()}, source=str(data.get("source", "")))


def datasheet_ceilings(gpu_name: str) -> Ceilings | None:
    """Vendor ceilings (dense) for a GPU name as CUDA/NVML report it, from ``servescope.hardware``'s sourced
    catalog; None when the catalog does not know the GPU or lacks its bandwidth.

    Used for the datasheet-basis efficiency that ``servescope roofline --calibrate`` multiplies with; every %
    in the kernel tables is against the ceilings measured in the same run.
    """
    from servescope import hardware  # the catalog; imported here so cost.py stays importable on its own

    try:
        gpu = hardware.get_gpu(gpu_name)
    except UnknownNameError:
        return None
    if not gpu.memory_bandwidth_bytes_s:
        return None
    rates = {d: float(t) * 1e12 for d, t in gpu.dense_tflops.items() if d in ELEMENT_BYTES and t}
    return Ceilings(bandwidth_bytes_s=float(gpu.memory_bandwidth_bytes_s), matmul_flops_s=rates,
                    source=f"datasheet ({gpu.key})")
