"""The probe's CPU-side logic: request validation, shape resolution, and the GPU check."""

from __future__ import annotations

import pytest

from servescope.errors import ConfigError, KernelProbeError, UnknownNameError
from servescope.kernels.probe import KernelsRequest, ProbeConfig, require_gpu, resolve_shapes, run_kernels
from servescope.kernels.shapes import ExpertShape


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_resolve_shapes_for_models_and_a_custom_shape():
    custom = ExpertShape(name="custom", hidden=1024, expert_width=512, experts=16)
    shapes = resolve_shapes(KernelsRequest(models=("glm-5", "qwen3-235b-a22b"), custom=custom, ep=8,
                                           gemms=("gate_up", "down")))
    assert [(s.model, s.gemm, s.n, s.k, s.local_experts) for s in shapes] == [
        ("glm-5", "gate_up", 4096, 6144, 32), ("glm-5", "down", 6144, 2048, 32),
        ("qwen3-235b-a22b", "gate_up", 3072, 4096, 16), ("qwen3-235b-a22b", "down", 4096, 1536, 16),
        ("custom", "gate_up", 1024, 1024, 2), ("custom", "down", 1024, 512, 2),
    ]
    with pytest.raises(ConfigError, match="--model"):
        resolve_shapes(KernelsRequest())


def test_probe_config_validates_its_inputs():
    shape = ExpertShape(name="c", hidden=64, expert_width=32, experts=4).gemm("gate_up")
    with pytest.raises(ConfigError, match="unknown kernel dtype"):
        ProbeConfig(shapes=(shape,), dtypes=("int3",))
    with pytest.raises(ConfigError, match="positive"):
        ProbeConfig(shapes=(shape,), tokens_per_expert=(0, 1))
    with pytest.raises(ConfigError, match="no expert shape"):
        ProbeConfig(shapes=())


@pytest.mark.skipif(_cuda(), reason="this machine has a GPU")
def test_without_a_gpu_the_probe_refuses_before_any_lookup():
    with pytest.raises(KernelProbeError, match="no CUDA GPU"):
        require_gpu()
    # the GPU check comes first, so even an unknown model or backend reports the missing GPU
    with pytest.raises(KernelProbeError):
        run_kernels(KernelsRequest(models=("no-such-model",), backends=("nope",)))


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU to get past the GPU check")
def test_unknown_backend_names_are_refused_on_a_gpu():
    with pytest.raises(UnknownNameError):
        run_kernels(KernelsRequest(models=("glm-5",), backends=("tritn",)))
