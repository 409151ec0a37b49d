"""Our grouped GEMM for MoE experts at decode sizes, written in Triton.

Why a kernel of our own: at decode a routed expert sees a handful of tokens, so the GEMM is a
matrix-vector product in disguise and its floor is the time to stream the expert weights once from HBM.
A per-expert loop of library GEMMs pays a launch and a pipeline ramp per expert, and library tiles made
for large M waste the tensor cores' M dimension. This kernel shows how close to that floor one launch can get:

- **One persistent launch for all local experts.** The grid is a few programs per SM; each walks the
  (expert, n-tile, m-tile) work list with a stride, so there is no launch per expert and no tail per expert.
- **Each expert's weights stream once.** A work item covers all of an expert's tokens when they fit in
  one M tile (always at decode sizes), so a weight tile is read from HBM exactly once; m-tiles of the same
  n-tile are adjacent in the work list so that, at larger M, they run at the same time and share it in L2.
- **Swap A and B for small M.** Hopper's wgmma needs M >= 64 per warpgroup; with a few tokens we compute
  ``out^T = W x^T`` so the weight rows fill the MMA's M and the tokens sit in its N (as small as 16).
  fp8 wgmma wants both operands K-major, which both are in this layout (x [T, K] and W [E, N, K]).
- **Optional fused gate/up + SiLU*mul epilogue**: the gate and up halves of the gate_up weight are loaded
  side by side and the kernel writes ``silu(gate) * up``, halving the output and skipping a second kernel.
- **bf16 and fp8 (e4m3) paths.** fp8 uses a per-token activation scale and a per-output-channel weight
  scale applied in fp32 in the epilogue (per-tensor scales are the special case of constant vectors).

This module imports triton at the top: import it only after checking that triton is installed
(``backends.py`` does). Set ``TRITON_INTERPRET=1`` before importing to run it on the CPU (slowly) in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.errors import TritonError


@triton.jit
def _moe_grouped_gemm_kernel(
    x_ptr,  # [T, K] activations, rows grouped by expert
    w_ptr,  # [E, N, K] weights, K contiguous
    out_ptr,  # [T, N_OUT] bf16
    row_start_ptr,  # [E + 1] int32: expert e owns rows [row_start[e], row_start[e + 1])
    x_scale_ptr,  # [T] fp32 per-token scale (SCALED only)
    w_scale_ptr,  # [E, N] fp32 per-channel scale (SCALED only)
    n_out,  # output columns (N, or N // 2 with FUSE_SILU)
    k_dim,
    num_experts,
    m_tiles,  # cdiv(max tokens per expert, BLOCK_M)
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    stride_wse,
    num_programs,  # the grid size (passed, not tl.num_programs: the CPU interpreter mishandles that in range)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    SCALED: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = n_out // BLOCK_N
    tiles_per_expert = n_tiles * m_tiles
    total_tiles = num_experts * tiles_per_expert
    for tile in range(pid, total_tiles, num_programs):
        expert = tile // tiles_per_expert
        rest = tile - expert * tiles_per_expert
        n_tile = rest // m_tiles
        m_tile = rest - n_tile * m_tiles
        row_lo = tl.load(row_start_ptr + expert)
        row_hi = tl.load(row_start_ptr + expert + 1)
        m_start = row_lo + m_tile * BLOCK_M
        if m_start < row_hi:
            rows = m_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_hi
            cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
            w_base = w_ptr + expert.to(tl.int64) * stride_we
            w_ptrs = w_base + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
            w_up_ptrs = w_ptrs + n_out * stride_wn
            if SWAP_AB:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for _ in range(0, k_dim, BLOCK_K):
                a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
                b = tl.load(w_ptrs)
                if SWAP_AB:  # noqa: SIM108 (constexpr branches, kept as statements for Triton)
                    acc = tl.dot(b, tl.trans(a), acc)
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
                if FUSE_SILU:
                    b_up = tl.load(w_up_ptrs)
                    if SWAP_AB:  # noqa: SIM108
                        acc_up = tl.dot(b_up, tl.trans(a), acc_up)
                    else:
                        acc_up = tl.dot(a, tl.trans(b_up), acc_up)
                    w_up_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            if SCALED:
                x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
                w_scale = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + cols)
                if SWAP_AB:
                    acc = acc * w_scale[:, None] * x_scale[None, :]
                else:
                    acc = acc * x_scale[:, None] * w_scale[None, :]
                if FUSE_SILU:
                    w_scale_up = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + n_out + cols)
                    if SWAP_AB:
                        acc_up = acc_up * w_scale_up[:, None] * x_scale[None, :]
                    else:
                        acc_up = acc_up * x_scale[:, None] * w_scale_up[None, :]
            if FUSE_SILU:
                acc = acc * tl.sigmoid(acc) * acc_up
            result = acc.to(out_ptr.dtype.element_ty)
            if SWAP_AB:
                out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]
                tl.store(out_ptrs, result, mask=row_mask[None, :])
            else:
                out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
                tl.store(out_ptrs, result, mask=row_mask[:, None])


@triton.jit
def _moe_grouped_gemm_tma_kernel(
    x_desc,  # TMA descriptor over x [T, K], block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor over w viewed as [E * N, K], block [BLOCK_N, BLOCK_K]
    out_ptr,
    row_start_ptr,
    x_scale_ptr,
    w_scale_ptr,
    n_out,
    n_rows,  # N: weight rows per expert
    k_dim,
    num_experts,
    m_tiles,
    stride_om,
    stride_wse,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    SCALED: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """The same work list as ``_moe_grouped_gemm_kernel``, but tiles arrive through the TMA engine (Hopper's
    bulk tensor copy) instead of per-thread cp.async: fewer address registers and instructions per byte.
    Rows of x past an expert's end are loaded (they belong to the next expert, or are zero-filled past T)
    and masked at the store. ``WARP_SPECIALIZE`` asks Triton to split the K loop into a TMA producer warp and
    MMA consumer warpgroups (Triton's automatic warp specialization; experimental on Hopper in Triton 3.6)."""
    pid = tl.program_id(0)
    n_tiles = n_out // BLOCK_N
    tiles_per_expert = n_tiles * m_tiles
    total_tiles = num_experts * tiles_per_expert
    for tile in range(pid, total_tiles, num_programs):
        expert = tile // tiles_per_expert
        rest = tile - expert * tiles_per_expert
        n_tile = rest // m_tiles
        m_tile = rest - n_tile * m_tiles
        row_lo = tl.load(row_start_ptr + expert)
        row_hi = tl.load(row_start_ptr + expert + 1)
        m_start = row_lo + m_tile * BLOCK_M
        if m_start < row_hi:
            w_row = expert * n_rows + n_tile * BLOCK_N
            if SWAP_AB:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in tl.range(0, k_dim, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
                a = x_desc.load([m_start, kk])
                b = w_desc.load([w_row, kk])
                if SWAP_AB:  # noqa: SIM108
                    acc = tl.dot(b, tl.trans(a), acc)
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
                if FUSE_SILU:
                    b_up = w_desc.load([w_row + n_out, kk])
                    if SWAP_AB:  # noqa: SIM108
                        acc_up = tl.dot(b_up, tl.trans(a), acc_up)
                    else:
                        acc_up = tl.dot(a, tl.trans(b_up), acc_up)
            rows = m_start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_hi
            cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            if SCALED:
                x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
                w_scale = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + cols)
                if SWAP_AB:
                    acc = acc * w_scale[:, None] * x_scale[None, :]
                else:
                    acc = acc * x_scale[:, None] * w_scale[None, :]
                if FUSE_SILU:
                    w_scale_up = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + n_out + cols)
                    if SWAP_AB:
                        acc_up = acc_up * w_scale_up[:, None] * x_scale[None, :]
                    else:
                        acc_up = acc_up * x_scale[:, None] * w_scale_up[None, :]
            if FUSE_SILU:
                acc = acc * tl.sigmoid(acc) * acc_up
            result = acc.to(out_ptr.dtype.element_ty)
            if SWAP_AB:
                out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]
                tl.store(out_ptrs, result, mask=row_mask[None, :])
            else:
                out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
                tl.store(out_ptrs, result, mask=row_mask[:, None])


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Tile shape and launch parameters of one compiled variant.

    ``programs_per_sm``: the persistent grid is ``SMs * programs_per_sm`` programs (fewer when there are fewer
    tiles). ``swap_ab`` puts the weight rows in the MMA's M dimension (for small M, see the module docstring).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool
    programs_per_sm: int = 1
    tma: bool = False
    warp_specialize: bool = False

    @property
    def label(self) -> str:
        swap = "s" if self.swap_ab else "n"
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}"
                f"s{self.num_stages}{swap}p{self.programs_per_sm}"
                f"{'t' if self.tma else ''}{'w' if self.warp_specialize else ''}")


def default_config(max_tokens_per_expert: int, dtype: torch.dtype, *, fuse_silu: bool = False) -> TritonConfig:
    """The tile shape for a token count, per bucket of M, from the tuning sweep on the H200 (docs/kernels.md,
    docs/measurements/kernels-h200-tune.json; GLM-5 gate_up, 2026-12-02).

    Small M: swap A/B, a BLOCK_M that just covers the tokens, 2 programs per SM with 4-5 pipeline stages of
    64-row weight tiles, so that about 100 KB of weights are in flight per SM (enough to cover HBM latency at
    full bandwidth). Large M: 128 x 256 wgmma tiles fed by TMA, compute-bound.
    """
    fp8 = dtype == torch.float8_e4m3fn
    k2 = 2 if fp8 else 1  # fp8 tiles take twice the K elements for the same bytes
    if max_tokens_per_expert <= 16:
        cfg = TritonConfig(16, 64, 128 * k2, 4, 5, True, 2)
    elif max_tokens_per_expert <= 32:
        cfg = TritonConfig(32, 64, 128 * k2, 4, 4, True, 2, tma=True)
    elif max_tokens_per_expert <= 64:
        cfg = (TritonConfig(64, 128, 128, 4, 4, True, 2, tma=True) if fp8
               else TritonConfig(64, 128, 128, 4, 3, True, 1, tma=True))
    elif max_tokens_per_expert <= 128:
        cfg = (TritonConfig(128, 256, 128, 8, 3, False, 1, tma=True) if fp8
               else TritonConfig(128, 128, 128, 8, 3, False, 1, tma=True))
    elif max_tokens_per_expert <= 256 or fp8:
        cfg = TritonConfig(128, 256, 64 * k2, 8, 4, False, 1, tma=True)
    else:  # bf16 past 256 tokens: 3 stages beat 4 at M = 1024 (2136 vs 2225 us)
        cfg = TritonConfig(128, 256, 64, 8, 3, False, 1, tma=True)
    if fuse_silu and not cfg.swap_ab and cfg.block_n > 128:
        # two accumulators of 128 x 256 fp32 would not fit the registers of 8 warps
        cfg = TritonConfig(cfg.block_m, 128, cfg.block_k, cfg.num_warps, cfg.num_stages, False,
                           cfg.programs_per_sm, cfg.tma)
    return cfg


def moe_grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    row_starts: torch.Tensor,
    *,
    max_tokens_per_expert: int,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    fuse_silu: bool = False,
    out: torch.Tensor | None = None,
    config: TritonConfig | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """All local experts' GEMMs in one persistent launch: ``out[rows of e] = x[rows of e] @ w[e].T``.

    ``x`` [T, K] bf16 or fp8 e4m3, rows grouped by expert; ``w`` [E, N, K] same dtype, K contiguous;
    ``row_starts`` [E + 1] int32 on the device. fp8 needs ``x_scale`` [T] and ``w_scale`` [E, N] (fp32).
    ``max_tokens_per_expert`` bounds the rows of any expert (a host-side number, so there is no device sync;
    an engine knows it from its batch). With ``fuse_silu`` the first N/2 weight rows are the gate and the last
    N/2 the up projection, and the output is ``silu(gate) * up`` of shape [T, N/2]. Output is bf16.

    Raises ValueError on shapes the kernel does not cover (N and K must be multiples of the tile).
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"expected x [T, K] and w [E, N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("x and w must be contiguous along K")
    num_experts, n, k = w.shape
    if row_starts.numel() != num_experts + 1:
        raise ValueError(f"row_starts needs {num_experts + 1} entries, got {row_starts.numel()}")
    scaled = x.dtype == torch.float8_e4m3fn
    if scaled and (x_scale is None or w_scale is None):
        raise ValueError("fp8 inputs need x_scale [T] and w_scale [E, N]")
    n_out = n // 2 if fuse_silu else n
    if fuse_silu and n % 2:
        raise ValueError(f"fused SiLU needs an even N, got {n}")
    cfg = config or default_config(max_tokens_per_expert, x.dtype, fuse_silu=fuse_silu)
    block_n = cfg.block_n
    while block_n > 16 and n_out % block_n:
        block_n //= 2
    block_k = cfg.block_k
    while block_k > 16 and k % block_k:
        block_k //= 2
    if n_out % block_n or k % block_k:
        raise ValueError(f"N={n_out} and K={k} must be multiples of 16")
    cfg = _fit_shared_memory(cfg, block_n, block_k, x.element_size(), fuse_silu)
    if out is None:
        out = torch.empty((x.shape[0], n_out), dtype=torch.bfloat16, device=x.device)
    if out.shape != (x.shape[0], n_out) or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major [{x.shape[0]}, {n_out}] tensor, got {tuple(out.shape)}")
    m_tiles = max(1, triton.cdiv(max(1, max_tokens_per_expert), cfg.block_m))
    total_tiles = num_experts * (n_out // block_n) * m_tiles
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    grid = (max(1, min(total_tiles, num_sms * cfg.programs_per_sm)),)
    dummy = row_starts  # any tensor: the scale pointers are never read when not SCALED
    try:
        if cfg.tma:
            _launch_tma(grid, x, w, out, row_starts, x_scale if scaled else dummy, w_scale if scaled else dummy,
                        n_out, k, num_experts, m_tiles, w_scale.stride(0) if scaled else 0, cfg, block_n, block_k,
                        fuse_silu, scaled)
        else:
            _launch(grid, x, w, out, row_starts, x_scale if scaled else dummy, w_scale if scaled else dummy,
                    n_out, k, num_experts, m_tiles, w_scale.stride(0) if scaled else 0, cfg, block_n, block_k,
                    fuse_silu, scaled)
    except TritonError as err:  # compile errors, out of shared memory, ptxas failures
        raise RuntimeError(f"triton kernel {cfg.label} failed: {type(err).__name__}: {err}") from err
    return out


#: Hopper's largest dynamic shared memory per block (227 KB, CUDA programming guide, compute capability 9.0),
#: less a little for the barriers and the epilogue's scratch that Triton adds to the pipeline buffers.
_SMEM_LIMIT_BYTES = 227 * 1024 - 1024


def _fit_shared_memory(cfg: TritonConfig, block_n: int, block_k: int, elem_bytes: int, fuse_silu: bool) -> TritonConfig:
    """Drop pipeline stages until the stage buffers fit in shared memory (the fused variant loads two weight
    tiles per stage, so a tuned unfused config can overflow)."""
    stage_bytes = (cfg.block_m * block_k + (2 if fuse_silu else 1) * block_n * block_k) * elem_bytes
    stages = cfg.num_stages
    while stages > 2 and stages * stage_bytes > _SMEM_LIMIT_BYTES:
        stages -= 1
    if stages == cfg.num_stages:
        return cfg
    return TritonConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, stages, cfg.swap_ab, cfg.programs_per_sm,
                        cfg.tma, cfg.warp_specialize)


def _launch(grid: tuple[int], x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, row_starts: torch.Tensor,
            x_scale: torch.Tensor, w_scale: torch.Tensor, n_out: int, k: int, num_experts: int, m_tiles: int,
            stride_wse: int, cfg: TritonConfig, block_n: int, block_k: int, fuse_silu: bool, scaled: bool) -> None:
    _moe_grouped_gemm_kernel[grid](
        x, w, out, row_starts, x_scale, w_scale,
        n_out, k, num_experts, m_tiles,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0), stride_wse,
        grid[0],
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SWAP_AB=cfg.swap_ab, FUSE_SILU=fuse_silu, SCALED=scaled,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_tma(grid: tuple[int], x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, row_starts: torch.Tensor,
                x_scale: torch.Tensor, w_scale: torch.Tensor, n_out: int, k: int, num_experts: int, m_tiles: int,
                stride_wse: int, cfg: TritonConfig, block_n: int, block_k: int, fuse_silu: bool,
                scaled: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("the TMA path needs contiguous x and w")
    n = w.shape[1]
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w.view(num_experts * n, k), [block_n, block_k])
    _moe_grouped_gemm_tma_kernel[grid](
        x_desc, w_desc, out, row_starts, x_scale, w_scale,
        n_out, n, k, num_experts, m_tiles, out.stride(0), stride_wse, grid[0],
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SWAP_AB=cfg.swap_ab, FUSE_SILU=fuse_silu, SCALED=scaled, WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
