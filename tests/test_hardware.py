"""The GPU catalog: coverage, sources for every figure, dense-not-sparse, lookups by NVML name."""

from __future__ import annotations

import dataclasses

import pytest

from servescope import hardware
from servescope.errors import UnknownNameError

REQUIRED = (
    "h100-sxm",
    "h200-sxm",
    "b200",
    "gb200",
    "b300",
    "rtx-pro-6000-server",
    "rtx-pro-6000-workstation",
    "rtx-pro-6000-maxq",
    "rtx-5090",
    "l40s",
    "a100-sxm-80gb",
    "mi300x",
    "mi355x",
)

_NUMERIC_FIELDS = (
    "sm_count",
    "boost_clock_mhz",
    "memory_bytes",
    "memory_bandwidth_bytes_s",
    "l2_bytes",
    "smem_per_sm_bytes",
    "smem_per_block_bytes",
    "tdp_w",
    "link_bandwidth_bytes_s",
)


def test_catalog_covers_the_issue_list():
    keys = {g.key for g in hardware.list_gpus()}
    assert set(REQUIRED) <= keys


@pytest.mark.parametrize("gpu", hardware.list_gpus(), ids=lambda g: g.key)
def test_every_known_figure_has_a_source(gpu):
    for f in _NUMERIC_FIELDS:
        value = getattr(gpu, f)
        if value is not None:
            assert value > 0, f
            assert gpu.sources.get(f), f"{gpu.key}.{f} has no source"
    assert set(gpu.dense_tflops) == set(hardware.DTYPES)
    assert any(v is not None for v in gpu.dense_tflops.values())
    for dtype, tflops in gpu.dense_tflops.items():
        if tflops is None:
            continue
        assert tflops > 0
        assert gpu.sources.get(f"dense_tflops.{dtype}") or gpu.sources.get("dense_tflops"), (gpu.key, dtype)
    fields = {f.name for f in dataclasses.fields(gpu)}
    for u in gpu.unverified:
        assert u.split(".")[0] in fields, f"unverified names unknown field {u}"


@pytest.mark.parametrize("gpu", hardware.list_gpus(), ids=lambda g: g.key)
def test_dense_rates_keep_the_tensor_core_ratios(gpu):
    """FP8 = 2 x BF16 and FP4 = 2 x FP8 on NVIDIA tensor cores: a sparse figure stored as dense breaks this."""
    tf = gpu.dense_tflops
    if gpu.vendor == "NVIDIA" and tf["fp8"] and tf["bf16"]:
        assert tf["fp8"] / tf["bf16"] == pytest.approx(2.0, rel=0.02)
    if tf["nvfp4"] and tf["fp8"] and gpu.arch in ("sm_100", "sm_120"):
        assert tf["nvfp4"] / tf["fp8"] == pytest.approx(2.0, rel=0.02)
    assert tf["fp16"] == tf["bf16"]


def test_rtx_pro_6000_fp4_is_dense_from_first_principles():
    g = hardware.get_gpu("rtx-pro-6000-server")
    # 188 SMs x 4,096 dense FP4 FLOP/clk/SM x 2,430 MHz.
    assert g.sm_count * 4096 * g.boost_clock_mhz * 1e6 == pytest.approx(g.peak_flops("nvfp4"), rel=1e-3)
    assert g.peak_flops("fp4") == g.peak_flops("nvfp4") < 2000e12  # the seed's 3,700 is the sparse figure
    assert g.memory_bandwidth_bytes_s == 1.792e12
    assert g.smem_per_block_bytes == 101_376


def test_rtx_pro_6000_fp4_ridge_is_about_1000_flop_per_byte():
    ridge = hardware.get_gpu("rtx-pro-6000-server").ridge_flops_per_byte("nvfp4")
    assert ridge == pytest.approx(1871e12 / 1.792e12)
    assert 1000 <= ridge <= 1100


def test_h100_figures_are_half_the_datasheet_sparse_ones():
    g = hardware.get_gpu("h100-sxm")
    assert g.dense_tflops["fp8"] == pytest.approx(3958 / 2, rel=1e-3)
    assert g.dense_tflops["bf16"] == pytest.approx(1979 / 2, rel=1e-3)
    assert g.peak_flops("nvfp4") is None  # no FP4 tensor cores on Hopper
    assert g.ridge_flops_per_byte("nvfp4") is None


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000-server"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000-workstation"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA GeForce RTX 5090", "rtx-5090"),
        ("NVIDIA B200", "b200"),
        ("nvidia l40s", "l40s"),
        ("RTX_PRO_6000_SERVER", "rtx-pro-6000-server"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_lookup_by_alias_and_nvml_name(name, key):
    assert hardware.get_gpu(name).key == key


def test_unknown_gpu_suggests_close_matches():
    with pytest.raises(UnknownNameError) as exc:
        hardware.get_gpu("h2000")
    assert "h200-sxm" in exc.value.suggestions
    assert "unknown GPU 'h2000'" in str(exc.value)
    with pytest.raises(UnknownNameError) as exc:
        hardware.get_gpu("rtx-pro-600-server")
    assert exc.value.suggestions[0] == "rtx-pro-6000-server"


def test_gpu_spec_is_frozen():
    g = hardware.get_gpu("h200")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.sm_count = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        g.dense_tflops["bf16"] = 1.0  # type: ignore[index]


def test_unknown_dtype_is_a_user_error():
    with pytest.raises(UnknownNameError) as exc:
        hardware.get_gpu("h200").peak_flops("fp5")
    assert exc.value.kind == "dtype"


@pytest.mark.parametrize(
    ("name", "arch", "per_block"),
    [
        ("sm120", "sm_120", 101_376),
        ("sm_120", "sm_120", 101_376),
        ("sm_120a", "sm_120", 101_376),
        ("120", "sm_120", 101_376),
        ("12.0", "sm_120", 101_376),
        ("sm_121", "sm_121", 101_376),
        ("sm_100a", "sm_100", 232_448),
        ("sm_103", "sm_103", 232_448),
        ("sm_90a", "sm_90", 232_448),
        ("sm_89", "sm_89", 101_376),
        ("sm_80", "sm_80", 166_912),
    ],
)
def test_get_arch_spellings(name, arch, per_block):
    spec = hardware.get_arch(name)
    assert spec.name == arch
    assert spec.smem_per_block_bytes == per_block
    assert spec.smem_per_sm_bytes >= spec.smem_per_block_bytes
    assert spec.source


def test_unknown_arch_raises_with_suggestions():
    with pytest.raises(UnknownNameError) as exc:
        hardware.get_arch("sm_75")
    assert exc.value.kind == "architecture"


def test_gpu_smem_matches_its_arch():
    for g in hardware.list_gpus():
        arch = hardware.get_arch(g.arch)
        assert g.smem_per_block_bytes == arch.smem_per_block_bytes


def test_to_dict_is_json_ready():
    import json

    d = hardware.get_gpu("b200").to_dict()
    assert json.loads(json.dumps(d))["ridge_flops_per_byte"]["nvfp4"] == pytest.approx(9000e12 / 7.7e12)
