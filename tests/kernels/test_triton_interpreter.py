"""Our Triton kernel under Triton's CPU interpreter (TRITON_INTERPRET=1): every variant against float32.

Runs only where the triton package is importable (it is not a servescope dependency; the GPU machine has it);
skipped otherwise. The interpreter must be switched on before triton decorates the kernel, hence a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent(
    """
    import itertools
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as ti

    # Triton 3.6's interpreter, with numpy 2.x: scalars are 1-element arrays that int() refuses, and bf16
    # (stored as uint16) reaches np.matmul as integers. Patch both, for this test process only.
    _patch_tensor = ti._patch_lang_tensor
    def _patched(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    ti._patch_lang_tensor = _patched
    _dot = ti.InterpreterBuilder.create_dot
    def _f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return ti.TensorHandle(ti._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                   tl.float32)
        return h
    ti.InterpreterBuilder.create_dot = lambda self, a, b, d, *args: _dot(self, _f32(a), _f32(b), d, *args)

    from servescope.kernels.triton_moe import TritonConfig, moe_grouped_gemm

    torch.manual_seed(0)
    E, N, K = 3, 64, 64
    worst = 0.0
    for dt, swap, fuse, tma, bm in itertools.product([torch.bfloat16, torch.float8_e4m3fn], [True, False],
                                                      [False, True], [False, True], [16, 32]):
        counts = [5, 0, bm + 3]  # one short expert, one empty, one spanning two M tiles
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        x = torch.randn(starts[-1], K).to(dt)
        w = (torch.randn(E, N, K) / 8).to(dt)
        xs = ws = None
        if dt == torch.float8_e4m3fn:
            xs, ws = torch.rand(starts[-1]) + 0.5, (torch.rand(E, N) + 0.5) / 8
        out = torch.full((starts[-1], N // 2 if fuse else N), float("nan"), dtype=torch.bfloat16)
        moe_grouped_gemm(x, w, torch.tensor(starts, dtype=torch.int32), max_tokens_per_expert=max(counts),
                         x_scale=xs, w_scale=ws, fuse_silu=fuse, out=out,
                         config=TritonConfig(bm, 32, 32, 4, 2, swap, 1, tma))
        refs = []
        for e in range(E):
            a, b = x[starts[e]:starts[e + 1]].float(), w[e].float()
            if xs is not None:
                a, b = a * xs[starts[e]:starts[e + 1], None], b * ws[e][:, None]
            o = a @ b.t()
            if fuse:
                o = torch.nn.functional.silu(o[:, : N // 2]) * o[:, N // 2 :]
            refs.append(o)
        ref = torch.cat(refs)
        assert torch.isfinite(out).all(), (dt, swap, fuse, tma, bm)
        worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item())
    print(f"worst {worst:.2e}")
    assert worst < 1e-2
    """
)


def test_every_kernel_variant_matches_float32_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "worst" in res.stdout
