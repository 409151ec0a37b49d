"""GPU-only checks of the probe and our Triton kernel (skipped without a CUDA GPU and triton).

They run on the H200 through the device tool; CI machines have no GPU, so they skip there with a reason.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch", reason="torch not installed")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _reference(x, w, starts, x_scale=None, w_scale=None, fuse=False):
    out = []
    for e in range(w.shape[0]):
        a = x[starts[e]:starts[e + 1]].float()
        b = w[e].float()
        if x_scale is not None:
            a = a * x_scale[starts[e]:starts[e + 1], None]
            b = b * w_scale[e][:, None]
        o = a @ b.t()
        if fuse:
            h = o.shape[1] // 2
            o = torch.nn.functional.silu(o[:, :h]) * o[:, h:]
        out.append(o)
    return torch.cat(out)


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("counts", [[1, 0, 3, 16], [17, 64, 5, 0], [130, 1, 256, 7]])
def test_triton_kernel_matches_float32_reference_with_uneven_experts(dtype, fuse, counts):
    from servescope.kernels.triton_moe import moe_grouped_gemm

    gen = torch.Generator(device="cuda").manual_seed(sum(counts) + fuse)
    e, n, k = len(counts), 512, 768
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    x = torch.randn((starts[-1], k), device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn((e, n, k), device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
    xs = ws = None
    if dtype == "fp8":
        x = x.to(torch.float8_e4m3fn)
        w = (w * k**0.5).to(torch.float8_e4m3fn)
        xs = torch.rand(starts[-1], device="cuda", generator=gen) + 0.5
        ws = (torch.rand((e, n), device="cuda", generator=gen) + 0.5) / k**0.5
    out = torch.full((starts[-1], n // 2 if fuse else n), float("nan"), device="cuda", dtype=torch.bfloat16)
    moe_grouped_gemm(x, w, torch.tensor(starts, dtype=torch.int32, device="cuda"), max_tokens_per_expert=max(counts),
                     x_scale=xs, w_scale=ws, fuse_silu=fuse, out=out)
    ref = _reference(x, w, starts, xs, ws, fuse)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) outputs remain"
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


def test_probe_times_every_available_backend_and_reads_nvml():
    from servescope.kernels.probe import ProbeConfig, run_probe
    from servescope.kernels.shapes import ExpertShape

    shape = ExpertShape(name="tiny", hidden=1024, expert_width=512, experts=8).gemm("gate_up")
    results = run_probe(ProbeConfig(shapes=(shape,), dtypes=("bf16", "fp8"), tokens_per_expert=(1, 32),
                                    window_s=0.2))
    by_status = {(p.backend, p.dtype, p.tokens_per_expert): p.status for p in results.points}
    assert by_status[("torch-loop", "bf16", 1)] == "ok"
    assert by_status[("scaled-mm-loop-rowwise", "fp8", 32)] == "ok"
    ok = [p for p in results.points if p.status == "ok"]
    assert all(p.time_us > 0 and p.pct_of_roofline > 0 for p in ok)
    assert results.ceilings.bandwidth_bytes_s > 1e11
    assert any(p.power_w is not None for p in ok), "NVML power was not read on a GPU machine"
