"""The grouped-GEMM backends the probe compares, their inputs, and the float32 reference they are checked against.

Every backend computes the same function for one set of inputs: for each local expert ``e``,
``out[rows of e] = x[rows of e] @ w[e].T`` (fp8: with the activation and weight scales applied), or for the
``*-silu`` variants ``silu(gate) * up`` of that product. Inputs are drawn fresh for every point, weights in
several rotated copies when one copy would fit in L2 (so each call streams its weights from HBM, as in decode).

Backends (dtype: names):
- bf16: ``torch-loop`` (one ``torch.mm`` per expert, what a naive MoE layer does), ``torch-grouped-mm``
  (``torch._grouped_mm``, PyTorch's CUTLASS grouped GEMM), ``triton`` and ``triton-silu`` (ours).
- fp8 (e4m3): ``scaled-mm-loop-tensor`` / ``scaled-mm-loop-rowwise`` (one ``torch._scaled_mm`` per expert,
  per-tensor or per-row/per-channel scales), ``torch-scaled-grouped-mm`` (``torch._scaled_grouped_mm``,
  rowwise), ``triton`` and ``triton-silu`` (ours, rowwise).
- FlashInfer, CUTLASS (Python) and DeepGEMM grouped GEMMs are detected; servescope has no adapter for them
  yet, so they are reported as not measured with the reason.

This module owns the torch dependency of ``kernels/``: it imports torch at the top, so import it only
after checking torch is installed (``probe.py`` does). Torch errors a backend raises are caught here and
turned into a point status, never a crash.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from servescope.kernels.shapes import GemmShape

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)

#: ||out - ref|| / ||ref|| above this is wrong. Outputs are bf16 (8 bits of mantissa, ~2e-3 relative
#: rounding per element) and fp8 references use the same quantised inputs, so a correct backend lands
#: near 3e-3; METHOD.md's guide for bf16 operands is 1e-3..1e-2.
REL_ERROR_TOLERANCE = 1e-2


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A backend's identity: ``scales`` is how fp8 inputs are scaled ("tensor" or "rowwise")."""

    name: str
    dtype: str
    description: str
    scales: str | None = None
    fused_silu: bool = False


BACKENDS: tuple[BackendSpec, ...] = (
    BackendSpec("torch-loop", "bf16", "torch.mm per expert"),
    BackendSpec("torch-grouped-mm", "bf16", "torch._grouped_mm, one call"),
    BackendSpec("triton", "bf16", "servescope Triton persistent grouped GEMM"),
    BackendSpec("triton-silu", "bf16", "servescope Triton, gate/up fused with SiLU*mul", fused_silu=True),
    BackendSpec("scaled-mm-loop-tensor", "fp8", "torch._scaled_mm per expert, per-tensor scales", scales="tensor"),
    BackendSpec("scaled-mm-loop-rowwise", "fp8", "torch._scaled_mm per expert, rowwise scales", scales="rowwise"),
    BackendSpec("torch-scaled-grouped-mm", "fp8", "torch._scaled_grouped_mm, rowwise scales", scales="rowwise"),
    BackendSpec("triton", "fp8", "servescope Triton persistent grouped GEMM, rowwise scales", scales="rowwise"),
    BackendSpec("triton-silu", "fp8", "servescope Triton, gate/up fused with SiLU*mul, rowwise scales",
                scales="rowwise", fused_silu=True),
)

#: Other grouped-GEMM libraries: the import name that shows each is installed.
EXTERNAL_LIBRARIES = {"flashinfer": "flashinfer", "cutlass": "cutlass", "deepgemm": "deep_gemm"}


def backend_specs(dtype: str, names: tuple[str, ...] | None = None) -> list[BackendSpec]:
    """The backends for a dtype, optionally only those named (unknown names are ignored here)."""
    return [b for b in BACKENDS if b.dtype == dtype and (names is None or b.name in names)]


def known_backend_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys([b.name for b in BACKENDS] + list(EXTERNAL_LIBRARIES)))


def external_library_status() -> dict[str, str]:
    """Why each external grouped-GEMM library is not measured (all of them, for now)."""
    status = {}
    for name, module in EXTERNAL_LIBRARIES.items():
        if importlib.util.find_spec(module) is None:
            status[name] = f"not installed (no module {module!r})"
        else:
            status[name] = "installed, but servescope has no adapter for it yet"
    return status


def triton_usable(device: torch.device) -> str | None:
    """None when our Triton kernel can run on ``device``, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton needs a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)"
    return None


def unavailable_reason(spec: BackendSpec, shape: GemmShape, device: torch.device) -> str | None:
    """None when ``spec`` can run for this shape on this device, else a one-line reason."""
    if spec.fused_silu and shape.gemm != "gate_up":
        return "the fused SiLU epilogue applies to the gate_up GEMM only"
    if spec.dtype == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 tensor cores need compute capability 8.9 or newer"
    if spec.name.startswith("triton"):
        return triton_usable(device)
    if spec.name == "torch-grouped-mm" and not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if spec.name == "torch-scaled-grouped-mm" and not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    return None


@dataclass
class ExpertWeights:
    """One copy of the local experts' weights [E, N, K] (K contiguous) and, for fp8, their scales."""

    w: torch.Tensor
    scale_rowwise: torch.Tensor | None = None  # [E, N] fp32, per output channel
    scale_tensor: torch.Tensor | None = None  # [E] fp32, one per expert

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


@dataclass
class Activations:
    """One batch of tokens grouped by expert: ``rows[e]`` = (first, end) row of expert ``e``.

    For fp8 the same random activations are quantised twice: per token (``x`` with ``scale_rowwise``) and
    per tensor (``x_tensor`` with ``scale_tensor``), one for each scaling mode.
    """

    x: torch.Tensor
    rows: tuple[tuple[int, int], ...]
    row_starts: torch.Tensor  # [E + 1] int32, device
    offs_end: torch.Tensor  # [E] int32, device: cumulative end rows (torch._grouped_mm's ``offs``)
    scale_rowwise: torch.Tensor | None = None  # [T] fp32
    x_tensor: torch.Tensor | None = None
    scale_tensor: torch.Tensor | None = None  # 0-dim fp32


@dataclass
class Problem:
    """Inputs for one (shape, dtype, tokens per expert) point, in ``len(weights)`` rotated copies."""

    shape: GemmShape
    dtype: str
    tokens_per_expert: int
    weights: list[ExpertWeights]
    acts: list[Activations]

    @property
    def copies(self) -> int:
        return len(self.weights)


def make_weights(shape: GemmShape, dtype: str, *, copies: int, device: torch.device,
                 generator: torch.Generator) -> list[ExpertWeights]:
    """Random expert weights, ``copies`` independent sets (values ~ N(0, 1/k) after scaling)."""
    e, n, k = shape.local_experts, shape.n, shape.k
    out = []
    for _ in range(copies):
        w = torch.randn((e, n, k), dtype=torch.bfloat16, device=device, generator=generator)
        if dtype == "bf16":
            w.mul_(1.0 / math.sqrt(k))
            out.append(ExpertWeights(w=w))
        else:
            w8 = w.to(FP8)  # N(0, 1) values sit well inside e4m3's range; scales carry the 1/sqrt(k)
            del w
            rowwise = (0.5 + torch.rand((e, n), device=device, generator=generator)) / math.sqrt(k)
            tensor = torch.full((e,), 1.0 / math.sqrt(k), device=device)
            out.append(ExpertWeights(w=w8, scale_rowwise=rowwise.float(), scale_tensor=tensor.float()))
    return out


def make_activations(shape: GemmShape, dtype: str, tokens_per_expert: int, *, copies: int, device: torch.device,
                     generator: torch.Generator, counts: list[int] | None = None) -> list[Activations]:
    """Random activations, ``tokens_per_expert`` rows for each local expert (or ``counts[e]`` rows)."""
    e, k = shape.local_experts, shape.k
    counts = counts if counts is not None else [tokens_per_expert] * e
    if len(counts) != e:
        raise ValueError(f"counts needs {e} entries, got {len(counts)}")
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    rows = tuple((starts[i], starts[i + 1]) for i in range(e))
    total = starts[-1]
    row_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    offs_end = torch.tensor(starts[1:], dtype=torch.int32, device=device)
    out = []
    for _ in range(copies):
        x = torch.randn((total, k), dtype=torch.bfloat16, device=device, generator=generator)
        if dtype == "bf16":
            out.append(Activations(x=x, rows=rows, row_starts=row_starts, offs_end=offs_end))
            continue
        xf = x.float()
        row_amax = xf.abs().amax(dim=1).clamp(min=1e-6)
        scale_row = (row_amax / FP8_MAX).contiguous()
        x_row = (xf / scale_row[:, None]).to(FP8)
        scale_t = (xf.abs().amax().clamp(min=1e-6) / FP8_MAX).reshape(())
        x_t = (xf / scale_t).to(FP8)
        out.append(Activations(x=x_row, rows=rows, row_starts=row_starts, offs_end=offs_end,
                               scale_rowwise=scale_row, x_tensor=x_t, scale_tensor=scale_t))
    return out


def reference(problem: Problem, spec: BackendSpec, index: int = 0) -> torch.Tensor:
    """The float32 answer for copy ``index`` in the backend's scaling mode (fp8: dequantised inputs).

    Computed expert by expert in float32 on the inputs' device, so it costs one weight copy's size in
    temporary memory at most.
    """
    acts, weights = problem.acts[index], problem.weights[index]
    n = problem.shape.n
    ref = torch.empty((acts.x.shape[0], n), dtype=torch.float32, device=acts.x.device)
    for e, (lo, hi) in enumerate(acts.rows):
        if hi == lo:
            continue
        if problem.dtype == "bf16":
            a = acts.x[lo:hi].float()
            b = weights.w[e].float()
        elif spec.scales == "tensor":
            a = acts.x_tensor[lo:hi].float() * acts.scale_tensor  # type: ignore[index,operator]
            b = weights.w[e].float() * weights.scale_tensor[e]  # type: ignore[index]
        else:
            a = acts.x[lo:hi].float() * acts.scale_rowwise[lo:hi, None]  # type: ignore[index]
            b = weights.w[e].float() * weights.scale_rowwise[e][:, None]  # type: ignore[index]
        torch.matmul(a, b.t(), out=ref[lo:hi])
    if spec.fused_silu:
        half = n // 2
        ref = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]
    return ref


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float | None, str]:
    """(correct, ||out - ref|| / ||ref||, reason) with NaN/Inf (unwritten poison) counted as wrong."""
    if out.shape != ref.shape:
        return False, None, f"output shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    finite = torch.isfinite(out)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        return False, None, f"{bad} of {out.numel()} outputs are NaN/Inf (unwritten or overflowed)"
    ref_norm = float(torch.linalg.vector_norm(ref))
    err = float(torch.linalg.vector_norm(out.float() - ref)) / (ref_norm if ref_norm > 0 else 1.0)
    if not math.isfinite(err) or err > REL_ERROR_TOLERANCE:
        return False, err, f"relative error {err:.2e} > {REL_ERROR_TOLERANCE:.0e} against the float32 reference"
    return True, err, ""


Runner = Callable[[int], torch.Tensor]


def build_runner(spec: BackendSpec, problem: Problem, *, triton_config: object | None = None) -> tuple[Runner, bool]:
    """A function computing the backend's output for input copy ``i``, and whether it writes into
    preallocated (poisonable) outputs. Nothing runs until it is called."""
    p = problem
    n_out = p.shape.n // 2 if spec.fused_silu else p.shape.n
    device = p.acts[0].x.device
    outs = [torch.empty((a.x.shape[0], n_out), dtype=torch.bfloat16, device=device) for a in p.acts]

    if spec.name == "torch-loop":
        def run(i: int) -> torch.Tensor:
            a, w, o = p.acts[i], p.weights[i].w, outs[i]
            for e, (lo, hi) in enumerate(a.rows):
                if hi > lo:
                    torch.mm(a.x[lo:hi], w[e].t(), out=o[lo:hi])
            return o
        return run, True

    if spec.name == "torch-grouped-mm":
        def run(i: int) -> torch.Tensor:
            a, w = p.acts[i], p.weights[i].w
            return torch._grouped_mm(a.x, w.transpose(-2, -1), offs=a.offs_end)
        return run, False

    if spec.name in ("scaled-mm-loop-tensor", "scaled-mm-loop-rowwise"):
        # cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED) scale pointers that are not 16-byte aligned, which a
        # slice of one scale vector per expert is not (seen on the H200, torch 2.11): an engine looping over
        # experts keeps one scale tensor per expert, so build those here, outside anything timed.
        rowwise = spec.scales == "rowwise"
        per_copy_scales = []
        for a, wt in zip(p.acts, p.weights, strict=True):
            if rowwise:
                sa = [a.scale_rowwise[lo:hi].unsqueeze(1).clone() for lo, hi in a.rows]  # type: ignore[index]
                sb = [wt.scale_rowwise[e].unsqueeze(0).clone() for e in range(len(a.rows))]  # type: ignore[index]
            else:
                sa = [a.scale_tensor] * len(a.rows)
                sb = [wt.scale_tensor[e].clone() for e in range(len(a.rows))]  # type: ignore[index]
            per_copy_scales.append((sa, sb))

        def run(i: int) -> torch.Tensor:
            a, w, o = p.acts[i], p.weights[i].w, outs[i]
            x = a.x if rowwise else a.x_tensor
            sa, sb = per_copy_scales[i]
            for e, (lo, hi) in enumerate(a.rows):
                if hi > lo:
                    torch._scaled_mm(x[lo:hi], w[e].t(), scale_a=sa[e], scale_b=sb[e],  # type: ignore[index]
                                     out_dtype=torch.bfloat16, out=o[lo:hi])
            return o
        return run, True

    if spec.name == "torch-scaled-grouped-mm":
        def run(i: int) -> torch.Tensor:
            a, wt = p.acts[i], p.weights[i]
            return torch._scaled_grouped_mm(a.x, wt.w.transpose(-2, -1), a.scale_rowwise, wt.scale_rowwise,
                                            offs=a.offs_end, out_dtype=torch.bfloat16)
        return run, False

    if spec.name in ("triton", "triton-silu"):
        from servescope.kernels import triton_moe  # lazy: needs the triton package

        cfg = triton_config if isinstance(triton_config, triton_moe.TritonConfig) else None

        def run(i: int) -> torch.Tensor:
            a, wt = p.acts[i], p.weights[i]
            scaled = p.dtype == "fp8"
            return triton_moe.moe_grouped_gemm(
                a.x, wt.w, a.row_starts, max_tokens_per_expert=max(hi - lo for lo, hi in a.rows),
                x_scale=a.scale_rowwise if scaled else None, w_scale=wt.scale_rowwise if scaled else None,
                fuse_silu=spec.fused_silu, out=outs[i], config=cfg)
        return run, True

    raise ValueError(f"no runner for backend {spec.name!r}")


def poison_outputs(runner_writes_in_place: bool, out: torch.Tensor) -> None:
    """Fill a preallocated output with NaN so that an element the backend forgets to write fails the check."""
    if runner_writes_in_place:
        out.fill_(float("nan"))


def check_backend(spec: BackendSpec, problem: Problem, runner: Runner, writes_in_place: bool,
                  ref: torch.Tensor) -> tuple[bool, float | None, str]:
    """Run copy 0 once (poisoned first) and compare with the reference. Torch errors become a reason."""
    try:
        if writes_in_place:
            poison_outputs(True, runner(0))  # first call allocates nothing new; poison its buffer, then rerun
        out = runner(0)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return False, None, f"error: {first[:300]}"
    return relative_error(out, ref)
