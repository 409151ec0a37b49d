"""Backends on the CPU with real torch: same function as the float32 reference; wrong output is caught.

torch's CPU kernels run ``torch.mm``, ``torch._grouped_mm`` and ``torch._scaled_mm`` (fp8), so the inputs,
references and per-backend plumbing are tested here; timing needs a GPU (tests/kernels/test_gpu.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch not installed")

from servescope.kernels import backends as bk  # noqa: E402  (after the importorskip)
from servescope.kernels.shapes import ExpertShape  # noqa: E402

CPU = torch.device("cpu")
SHAPE = ExpertShape(name="tiny", hidden=64, expert_width=32, experts=4).gemm("gate_up")


def _problem(dtype: str, tokens: int, *, counts: list[int] | None = None, seed: int = 0) -> bk.Problem:
    gen = torch.Generator().manual_seed(seed)
    weights = bk.make_weights(SHAPE, dtype, copies=2, device=CPU, generator=gen)
    acts = bk.make_activations(SHAPE, dtype, tokens, copies=2, device=CPU, generator=gen, counts=counts)
    return bk.Problem(shape=SHAPE, dtype=dtype, tokens_per_expert=tokens, weights=weights, acts=acts)


CPU_BACKENDS = [("bf16", "torch-loop"), ("bf16", "torch-grouped-mm"), ("fp8", "scaled-mm-loop-tensor"),
                ("fp8", "scaled-mm-loop-rowwise")]


@pytest.mark.parametrize(("dtype", "name"), CPU_BACKENDS)
@pytest.mark.parametrize("counts", [None, [3, 0, 1, 7]])
def test_cpu_backends_match_the_float32_reference(dtype, name, counts):
    problem = _problem(dtype, 5, counts=counts)
    spec = next(s for s in bk.backend_specs(dtype) if s.name == name)
    assert bk.unavailable_reason(spec, SHAPE, CPU) is None
    runner, in_place = bk.build_runner(spec, problem)
    correct, rel, reason = bk.check_backend(spec, problem, runner, in_place, bk.reference(problem, spec, 0))
    assert correct, reason
    assert rel is not None and rel < 5e-3
    # copy 1 holds different inputs: the runner must read them, not copy 0's
    assert not torch.equal(runner(1), runner(0))


def test_fp8_scaling_modes_have_their_own_reference():
    problem = _problem("fp8", 4)
    tensor_spec = next(s for s in bk.backend_specs("fp8") if s.scales == "tensor")
    row_spec = next(s for s in bk.backend_specs("fp8") if s.name == "scaled-mm-loop-rowwise")
    ref_t, ref_r = bk.reference(problem, tensor_spec), bk.reference(problem, row_spec)
    assert ref_t.shape == ref_r.shape
    assert not torch.allclose(ref_t, ref_r)


def test_an_output_left_partly_unwritten_is_reported_wrong():
    problem = _problem("bf16", 4)
    spec = next(s for s in bk.backend_specs("bf16") if s.name == "torch-loop")
    good, in_place = bk.build_runner(spec, problem)

    def skips_last_expert(i: int) -> torch.Tensor:
        out = good(i)
        lo, hi = problem.acts[i].rows[-1]
        if hasattr(skips_last_expert, "armed"):
            out[lo:hi] = float("nan")  # as if a kernel never wrote these rows (poison left in place)
        skips_last_expert.armed = True  # type: ignore[attr-defined]
        return out

    correct, _rel, reason = bk.check_backend(spec, problem, skips_last_expert, in_place, bk.reference(problem, spec))
    assert not correct and "NaN" in reason


def test_a_numerically_wrong_backend_is_reported_with_its_error():
    problem = _problem("bf16", 4)
    spec = next(s for s in bk.backend_specs("bf16") if s.name == "torch-loop")
    good, _ = bk.build_runner(spec, problem)
    correct, rel, reason = bk.check_backend(spec, problem, lambda i: good(i) * 1.05, False,
                                            bk.reference(problem, spec))
    assert not correct and rel == pytest.approx(0.05, rel=0.1) and "relative error" in reason


def test_errors_become_reasons_and_unavailability_is_explained():
    problem = _problem("bf16", 4)
    spec = next(s for s in bk.backend_specs("bf16") if s.name == "torch-loop")

    def broken(i: int) -> torch.Tensor:
        raise RuntimeError("CUDA error: something unsupported\nmore detail")

    correct, _, reason = bk.check_backend(spec, problem, broken, False, bk.reference(problem, spec))
    assert not correct and reason == "error: CUDA error: something unsupported"
    silu = next(s for s in bk.backend_specs("bf16") if s.name == "triton-silu")
    down = ExpertShape(name="tiny", hidden=64, expert_width=32, experts=4).gemm("down")
    assert "gate_up" in (bk.unavailable_reason(silu, down, CPU) or "")
    assert set(bk.external_library_status()) == {"flashinfer", "cutlass", "deepgemm"}
