"""Build small, real ``KernelResults`` objects for the CPU tests (no GPU: the numbers are made up)."""

from __future__ import annotations

from servescope.kernels.cost import Ceilings
from servescope.kernels.results import KernelPoint, KernelResults


def point(backend: str, tokens: int, pct: float | None, *, dtype: str = "bf16", model: str = "glm-5",
          status: str = "ok", pct_peak: float | None = None) -> KernelPoint:
    """A point whose time is set so that % of roofline is ``pct`` (ideal time fixed at 100 us)."""
    timed = status == "ok" and pct is not None
    return KernelPoint(
        backend=backend, dtype=dtype, model=model, gemm="gate_up", n=4096, k=6144, local_experts=32,
        tokens_per_expert=tokens, status=status, reason="" if status == "ok" else "made-up failure",
        correct=status == "ok", rel_error=3e-3 if timed else None,
        time_us=100.0 * 100.0 / pct if timed else None, ideal_time_us=100.0 if timed else None, bound="memory",
        flops=1e9, bytes=1e9, achieved_tflops=1.0 if timed else None, achieved_gb_s=1000.0 if timed else None,
        pct_of_roofline=pct if timed else None, pct_of_peak=pct_peak if timed else None, graph=timed,
        power_w=300.0 if timed else None, clock_event_reasons=("sw_power_cap",) if timed else (),
    )


def results(points: list[KernelPoint], *, datasheet: bool = False) -> KernelResults:
    return KernelResults(
        gpu={"name": "NVIDIA H200", "sms": 132},
        software={"torch": "2.11.0", "triton": "3.6.0"},
        ceilings=Ceilings(bandwidth_bytes_s=4.2e12, matmul_flops_s={"bf16": 7.7e14}, source="measured"),
        datasheet=Ceilings(bandwidth_bytes_s=4.8e12, matmul_flops_s={"bf16": 9.89e14}, source="datasheet")
        if datasheet else None,
        points=tuple(points),
        command="servescope kernels --model glm-5 --ep 8",
        created_unix_s=1.0,
        unavailable={"deepgemm": "not installed (no module 'deep_gemm')"},
        warnings=("a made-up warning",),
    )
