"""servescope.tiles against CUTLASS itself, combination by combination, plus the arithmetic around it.

The reference is docs/cutlass-probe/results.json: what CUTLASS 4.2's own collective builders computed when compiled
by nvcc for sm_120a / sm_100a / sm_90a (docs/cutlass-probe/run_probe.py). Every combination listed there is a test
case here: stage counts and byte totals must match exactly, and tiles CUTLASS rejects must be rejected for the same
static_assert.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from servescope import tiles
from servescope.errors import ConfigError, UnknownNameError

PROBE_PATH = Path(__file__).resolve().parents[1] / "docs" / "cutlass-probe" / "results.json"
PROBE = json.loads(PROBE_PATH.read_text())
RESULTS = PROBE["results"]

#: Fields of the probe's output that the model reproduces byte for byte (probe key -> TileReport.detail key).
EXACT_FIELDS = {
    "smem_a_bytes": "smem_a_bytes",
    "smem_b_bytes": "smem_b_bytes",
    "smem_sfa_bytes": "smem_sfa_bytes",
    "smem_sfb_bytes": "smem_sfb_bytes",
    "mainloop_tensor_bytes": "mainloop_tensor_bytes",
    "mainloop_pipeline_bytes": "mainloop_pipeline_bytes",
    "epilogue_tensor_bytes": "epilogue_tensor_bytes",
    "epilogue_smem_bytes": "epilogue_smem_bytes",
    "kernel_pipelines_bytes": "kernel_pipelines_bytes",
}


def _analyze(rec: dict) -> tiles.TileReport:
    m, n, k = rec["tile"]
    return tiles.analyze_tile(rec["arch"], rec["a"], rec["b"], rec["out"], tiles.Tile(m, n, k),
                              grouped=rec["kernel"] == "grouped", schedule=rec["schedule"], source=rec["source"])


def _assert_message(reason: str) -> str:
    """The static_assert text of a probe reason ('file:line: static assertion failed with "..."')."""
    return reason.split("static assertion failed with ", 1)[-1].strip().strip('"')


def _host_rejections(rep: tiles.TileReport) -> list[str]:
    return [r for r in rep.rejections if tiles.KERNEL_BODY not in r]


def test_probe_table_is_from_the_cutlass_version_the_model_mirrors():
    assert PROBE["cutlass_version"] == tiles.CUTLASS_VERSION
    assert PROBE["package"] == {"name": "nvidia-cutlass", "version": "4.2.0.0"}
    assert len(RESULTS) >= 300
    assert {r["arch"] for r in RESULTS} == {"sm90", "sm100", "sm120"}


@pytest.mark.parametrize("rec", RESULTS, ids=[r["id"] for r in RESULTS])
def test_model_matches_cutlass(rec):
    rep = _analyze(rec)
    if rec["status"] == "ok":
        assert _host_rejections(rep) == [], rep.rejections
        assert rep.stages == rec["stages"]
        assert rep.total_bytes == rec["kernel_smem_bytes"]
        assert rep.capacity_bytes == rec["capacity_bytes"]  # the GPU catalog agrees with cutlass/arch/arch.h
        for probe_key, model_key in EXACT_FIELDS.items():
            if probe_key in rec:
                assert rep.detail[model_key] == rec[probe_key], probe_key
        assert rep.mainloop_bytes == rec["mainloop_tensor_bytes"] + rec["mainloop_pipeline_bytes"]
        kernel_ok = rec["full_build"] in ("ok", "not run")
        assert rep.fits == (kernel_ok and rec["kernel_smem_bytes"] <= rec["capacity_bytes"])
    else:
        message = _assert_message(rec["reason"])
        assert not rep.compiles
        assert any(message in r for r in _host_rejections(rep)), (message, rep.rejections)
    if rec["full_build"] != "not run":
        assert rep.compiles == (rec["full_build"] == "ok"), rec["full_build"]
        if rec["full_build"] != "ok":
            message = _assert_message(rec["full_build"])
            assert any(message in r for r in rep.rejections), (message, rep.rejections)


def test_probe_covers_every_path_of_the_model():
    ok = [r for r in RESULTS if r["status"] == "ok"]
    assert {r["out"] for r in ok if r["arch"] == "sm120"} == {"bf16", "fp16", "fp32", "nvfp4"}
    assert {(r["kernel"], r["schedule"]) for r in ok if r["arch"] == "sm120"} == {
        ("dense", "cooperative"), ("grouped", "cooperative"), ("dense", "pingpong"), ("grouped", "pingpong")}
    assert {r["schedule"] for r in ok if r["arch"] == "sm100"} == {"1sm", "2sm"}
    assert any(r["source"] for r in ok if r["arch"] == "sm100")
    assert {r["a"] for r in ok if r["arch"] == "sm120"} == {"nvfp4", "mxfp4", "mxfp6", "mxfp8"}
    full = [r for r in RESULTS if r["full_build"] != "not run"]
    assert any(r["full_build"] == "ok" for r in full) and any(r["full_build"] != "ok" for r in full)


def test_padding_breaks_fit_for_tiles_the_formula_accepts():
    """The CUT3096 case, found in CUTLASS's own numbers: the builder picks its stages, the kernel asks for more."""
    flagged = [r for r in RESULTS if r["status"] == "ok" and r["kernel_smem_bytes"] > r["capacity_bytes"]]
    assert flagged, "the probe table should hold at least one tile that only fits by the formula"
    for rec in flagged:
        rep = _analyze(rec)
        assert rep.fits_by_formula_only and not rep.fits
        assert rep.formula_bytes <= rep.capacity_bytes < rep.total_bytes
        assert f"{rep.total_bytes:,} B > {rep.capacity_bytes:,} B" in rep.reason


# ----------------------------------------------------------------------------------------- the stage formula


def test_sm120_nvfp4_stage_formula_term_by_term():
    """NVFP4 128x128x128: A 128*128/2, B the same, 128 rows x 8 UE4M3 scales for each, one 16-byte barrier pair."""
    rep = tiles.analyze_tile("sm120", "nvfp4", "nvfp4", "bf16", "128x128x128")
    f = rep.formula
    assert (f.a_bytes, f.b_bytes, f.sfa_bytes, f.sfb_bytes, f.barrier_bytes) == (8192, 8192, 1024, 1024, 16)
    assert f.stage_bytes == 18_448
    # Epilogue carve-out: two 64x32 bf16 sub-tiles (8,192 B) + fusion scratch, rounded to the 512-B swizzle
    # alignment, + the 2-stage C pipeline (32 B), rounded again: 9,216 B.
    assert f.carveout_bytes == 9_216
    assert rep.stages == (101_376 - 9_216) // 18_448 == 4


def test_sm120_mxfp8_wide_tile_fails_with_the_two_stage_reason():
    rep = tiles.analyze_tile("sm_120a", "mxfp8", "mxfp8", "bf16", "128x256x128")
    assert not rep.compiles and not rep.fits
    # 2 x (128*128 + 256*128 + 128*4 + 256*4 + 16) + 9,216 = 110,624
    assert "2 stages need 110,624 B > 101,376 B" in rep.reason


def test_mxf8f6f4_stores_four_bit_operands_in_a_byte():
    """MXFP8 x MXFP4 runs on the MXF8F6F4 MMA, which keeps every element in one byte of shared memory."""
    mixed = tiles.analyze_tile("sm120", "mxfp8", "mxfp4", "bf16", "128x128x128")
    pure = tiles.analyze_tile("sm120", "mxfp4", "mxfp4", "bf16", "128x128x128")
    assert mixed.formula.b_bytes == 128 * 128 and pure.formula.b_bytes == 128 * 128 // 2
    assert mixed.stages < pure.stages


def test_sm121_is_the_sm120_model():
    a = tiles.analyze_tile("sm120", "nvfp4", "nvfp4", "bf16", "128x256x128")
    b = tiles.analyze_tile("sm_121a", "nvfp4", "nvfp4", "bf16", "128x256x128")
    assert (a.stages, a.total_bytes, a.fits) == (b.stages, b.total_bytes, b.fits)


def test_small_tiles_on_sm120_are_rejected_for_the_scale_factor_tma():
    rep = tiles.analyze_tile("sm120", "nvfp4", "nvfp4", "bf16", "128x64x128")
    assert not rep.compiles
    assert "TMA requires CTA_Tile and SLayout top-level size equivalence" in rep.reason


def test_sm90_grouped_capacity_subtracts_descriptors_and_scheduler_pipeline():
    rep = tiles.analyze_tile("sm90", "bf16", "bf16", "bf16", "128x128x64", grouped=True)
    assert rep.formula.capacity_bytes == 232_448 - 2 * 128 - 128


def test_multistage_estimate_for_ampere_is_marked_unverified():
    rep = tiles.analyze_tile("sm80", "bf16", "bf16", "bf16", "128x128x32")
    assert rep.stages == 166_912 // (128 * 32 * 2 * 2)
    assert not rep.verified and rep.notes


@pytest.mark.parametrize("arch,a,hint", [("sm90", "nvfp4", "block-scaled"), ("sm120", "bf16", "block-scaled"),
                                         ("sm80", "fp8", "FP8"), ("sm80", "mxfp4", "block-scaled")])
def test_formats_an_architecture_cannot_run_are_config_errors(arch, a, hint):
    with pytest.raises(ConfigError, match=hint):
        tiles.analyze_tile(arch, a, a, "bf16", "128x128x128")


def test_scale_factor_mismatch_is_rejected_like_cutlass():
    rep = tiles.analyze_tile("sm120", "nvfp4", "mxfp8", "bf16", "128x128x128")
    assert not rep.compiles and "Scale factor types for A and B must be the same" in rep.reason


def test_unknown_names_and_schedules():
    with pytest.raises(UnknownNameError):
        tiles.get_format("nvfp5")
    with pytest.raises(UnknownNameError):
        tiles.get_output("int4")
    with pytest.raises(UnknownNameError):
        tiles.analyze_tile("sm999", "nvfp4", None, "bf16", "128x128x128")
    with pytest.raises(ConfigError, match="schedule"):
        tiles.analyze_tile("sm120", "nvfp4", None, "bf16", "128x128x128", schedule="2sm")
    with pytest.raises(ConfigError, match="no CUTLASS GEMM tile model"):
        tiles.analyze_tile("gfx942", "bf16", None, "bf16", "128x128x64")


@pytest.mark.parametrize("text", ["128x256", "128x256x", "axbxc", "0x128x128", "100x128x128", "128x128x2048", ""])
def test_parse_tile_rejects_bad_strings(text):
    with pytest.raises(ConfigError, match="bad tile"):
        tiles.parse_tile(text)


def test_parse_tile_accepts_spacing_and_case():
    assert tiles.parse_tile(" 128X256x64 ") == tiles.Tile(128, 256, 64)
    assert str(tiles.Tile(128, 256, 64)) == "128x256x64"


@pytest.mark.parametrize("arch,a", [("sm120", "nvfp4"), ("sm120", "mxfp8"), ("sm100", "nvfp4"), ("sm100", "mxfp8"),
                                    ("sm90", "bf16"), ("sm90", "fp8"), ("sm89", "fp8")])
def test_default_tiles_analyze_cleanly(arch, a):
    reports = tiles.analyze_tiles(arch, a, None, "bf16")
    assert len(reports) >= 4
    assert any(r.fits for r in reports)
    for r in reports:
        json.dumps(r.to_dict())  # JSON-ready
        if r.fits:
            assert 0 < r.total_bytes <= r.capacity_bytes
            assert r.mainloop_bytes + r.epilogue_bytes + r.extras_bytes + r.padding_bytes == r.total_bytes


def test_default_schedule_follows_the_tile():
    assert tiles.default_schedule("sm100", tiles.Tile(256, 128, 256)) == "2sm"
    assert tiles.default_schedule("sm100", tiles.Tile(128, 128, 256)) == "1sm"
    assert tiles.default_schedule("sm90", tiles.Tile(64, 128, 64)) == "pingpong"
    assert tiles.default_schedule("sm120", tiles.Tile(128, 128, 128)) == "cooperative"


# ----------------------------------------------------------------------------------------- small-M cost


def test_small_m_cost_quotes_the_padding():
    cost = tiles.small_m_cost(32, 2048, 6144, "128x128x128", 188, groups=256)
    assert cost.row_padding_fraction == pytest.approx(0.75)
    assert cost.mma_padding_fraction == pytest.approx(0.75)
    assert cost.summary.startswith("at 32 tokens per expert a 128-row tile does 75% padding")
    assert cost.cta_count == 256 * 1 * 16
    assert cost.waves == math.ceil(4096 / 188) == 22
    assert cost.wave_efficiency == pytest.approx(4096 / (22 * 188))
    assert cost.efficiency_ceiling == pytest.approx(0.25 * 4096 / (22 * 188))
    json.dumps(cost.to_dict())


def test_small_m_cost_edges():
    full = tiles.small_m_cost(256, 2048, 6144, tiles.Tile(128, 128, 128), 188)
    assert full.row_padding_fraction == 0.0 and full.padded_m == 256
    ragged = tiles.small_m_cost(130, 100, 96, tiles.Tile(128, 128, 128), 4)
    assert ragged.padded_m == 256
    assert ragged.mma_padding_fraction == pytest.approx(1 - (130 * 100 * 96) / (256 * 128 * 128))
    assert ragged.cta_count == 2 and ragged.waves == 1 and ragged.wave_efficiency == 0.5
    two_per_sm = tiles.small_m_cost(128, 4096, 4096, "128x128x128", 16, ctas_per_sm=2)
    assert two_per_sm.waves == 1 and two_per_sm.wave_efficiency == 1.0


@pytest.mark.parametrize("kwargs", [{"m_tokens": 0}, {"n": -1}, {"sm_count": 0}, {"groups": 0}])
def test_small_m_cost_rejects_nonpositive_sizes(kwargs):
    args = {"m_tokens": 32, "n": 2048, "k": 6144, "tile": "128x128x128", "sm_count": 188, **kwargs}
    with pytest.raises(ConfigError):
        tiles.small_m_cost(**args)
