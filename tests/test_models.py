"""The model catalog: every real HF config in ../shared/model-configs normalised, presets, bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from servescope import models
from servescope.errors import ModelConfigError, UnknownNameError

#: ../shared/model-configs beside the clone (tests/ -> repo root -> its parent).
SHARED_CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "model-configs"
PACKAGED_CONFIGS = Path(models.__file__).parent / "data" / "model-configs"

needs_shared = pytest.mark.skipif(not SHARED_CONFIGS.is_dir(), reason=f"{SHARED_CONFIGS} not present")

# file -> (layers, dense layers, hidden, expert width, routed experts, top-k, shared experts, attention, vocab,
#          expert format, kv-cache format). Figures cross-checked with shared/reference/hardware.md "MoE configs".
EXPECTED = {
    "MiniMaxAI--MiniMax-M2.5_config.json": (62, 0, 3072, 1536, 256, 8, 0, "gqa", 200064, "fp8_block128", "bf16"),
    "Qwen--Qwen3-235B-A22B-FP8_config.json": (94, 0, 4096, 1536, 128, 8, 0, "gqa", 151936, "fp8_block128", "bf16"),
    "Qwen--Qwen3-235B-A22B_config.json": (94, 0, 4096, 1536, 128, 8, 0, "gqa", 151936, "bf16", "bf16"),
    "Qwen--Qwen3-30B-A3B_config.json": (48, 0, 2048, 768, 128, 8, 0, "gqa", 151936, "bf16", "bf16"),
    "Qwen--Qwen3-8B_config.json": (36, 36, 4096, None, 0, 0, 0, "gqa", 151936, "bf16", "bf16"),
    "Qwen--Qwen3.5-397B-A17B_config.json": (60, 0, 4096, 1024, 512, 10, 1, "gqa", 248320, "bf16", "bf16"),
    "deepseek-ai--DeepSeek-R1_config.json": (61, 3, 7168, 2048, 256, 8, 1, "mla", 129280, "fp8_block128", "bf16"),
    "deepseek-ai--DeepSeek-V3_config.json": (61, 3, 7168, 2048, 256, 8, 1, "mla", 129280, "fp8_block128", "bf16"),
    "meta-llama--Llama-4-Scout-17B-16E-Instruct_config.json": (
        48,
        0,
        5120,
        8192,
        16,
        1,
        1,
        "gqa",
        202048,
        "bf16",
        "bf16",
    ),
    "meta-llama--Meta-Llama-3.1-70B_config.json": (80, 80, 8192, None, 0, 0, 0, "gqa", 128256, "bf16", "bf16"),
    "meta-llama--Meta-Llama-3.1-8B_config.json": (32, 32, 4096, None, 0, 0, 0, "gqa", 128256, "bf16", "bf16"),
    "mistralai--Mixtral-8x22B-v0.1_config.json": (56, 0, 6144, 16384, 8, 2, 0, "gqa", 32000, "bf16", "bf16"),
    "mistralai--Mixtral-8x7B-v0.1_config.json": (32, 0, 4096, 14336, 8, 2, 0, "gqa", 32000, "bf16", "bf16"),
    "moonshotai--Kimi-K2-Instruct_config.json": (61, 1, 7168, 2048, 384, 8, 1, "mla", 163840, "fp8_block128", "bf16"),
    "nvidia--DeepSeek-V3.1-NVFP4_config.json": (61, 3, 7168, 2048, 256, 8, 1, "mla", 129280, "nvfp4", "fp8"),
    "nvidia--GLM-5-NVFP4_config.json": (78, 3, 6144, 2048, 256, 8, 1, "mla", 154880, "nvfp4", "fp8"),
    "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16_config.json": (
        52,
        0,
        2688,
        1856,
        128,
        6,
        1,
        "gqa",
        131072,
        "bf16",
        "bf16",
    ),
    "nvidia--Qwen3-235B-A22B-NVFP4_config.json": (94, 0, 4096, 1536, 128, 8, 0, "gqa", 151936, "nvfp4", "fp8"),
    "openai--gpt-oss-120b_config.json": (36, 0, 2880, 2880, 128, 4, 0, "gqa", 201088, "mxfp4", "bf16"),
    "openai--gpt-oss-20b_config.json": (24, 0, 2880, 2880, 32, 4, 0, "gqa", 201088, "mxfp4", "bf16"),
    "zai-org--GLM-5-FP8_config.json": (78, 3, 6144, 2048, 256, 8, 1, "mla", 154880, "fp8_block128", "bf16"),
    "zai-org--GLM-5_config.json": (78, 3, 6144, 2048, 256, 8, 1, "mla", 154880, "bf16", "bf16"),
}


@needs_shared
def test_every_shared_config_file_is_read_and_normalised():
    files = sorted(p.name for p in SHARED_CONFIGS.iterdir() if p.is_file())
    configs = [f for f in files if f.endswith("_config.json") and not f.endswith("_hf_quant_config.json")]
    quants = [f for f in files if f.endswith("_hf_quant_config.json")]
    assert set(configs) | set(quants) == set(files), "a file in shared/model-configs is neither kind"
    assert set(configs) == set(EXPECTED), "shared/model-configs changed: add the new file to EXPECTED"
    for name in configs:
        spec = models.load_hf_config(SHARED_CONFIGS / name)
        got = (
            spec.num_layers,
            len(spec.dense_layers),
            spec.hidden_size,
            spec.moe_intermediate_size,
            spec.n_routed_experts,
            spec.top_k,
            spec.n_shared_experts,
            spec.attention_kind,
            spec.vocab_size,
            spec.weights.experts if spec.is_moe else spec.weights.dense_mlp,
            spec.weights.kv_cache,
        )
        assert got == EXPECTED[name], name
    # Every ModelOpt quant file is picked up by the config beside it: its algorithm shows in the formats.
    for qname in quants:
        cfg = SHARED_CONFIGS / qname.replace("_hf_quant_config.json", "_config.json")
        algo = json.loads((SHARED_CONFIGS / qname).read_text())["quantization"]["quant_algo"].lower()
        assert models.load_hf_config(cfg).weights.experts == algo, qname


@needs_shared
def test_packaged_presets_are_byte_copies_of_the_shared_configs():
    for p in SHARED_CONFIGS.iterdir():
        assert (PACKAGED_CONFIGS / p.name).read_bytes() == p.read_bytes(), p.name


@needs_shared
@pytest.mark.parametrize("preset", models.preset_names())
def test_preset_equals_loading_its_source_file(preset):
    spec = models.get_model(preset)
    src = SHARED_CONFIGS / Path(spec.source).name
    if not src.exists():  # Llama-4 Maverick ships only with servescope (aiconfigurator's copy of the HF config)
        pytest.skip(f"{src.name} is not in shared/model-configs")
    from_file = models.load_hf_config(src)
    assert from_file.to_dict() | {"name": spec.name, "source": spec.source, "aliases": list(spec.aliases)} == (
        spec.to_dict()
    )


def test_issue_presets_exist():
    names = set(models.preset_names())
    for want in (
        "glm-5",
        "deepseek-v3",
        "deepseek-r1",
        "kimi-k2",
        "qwen3-235b-a22b",
        "qwen3-30b-a3b",
        "gpt-oss-120b",
        "gpt-oss-20b",
        "mixtral-8x7b",
        "mixtral-8x22b",
        "llama-4-scout",
        "llama-4-maverick",
        "llama-3.1-8b",
        "llama-3.1-70b",
    ):
        assert want in names


def test_glm5_nvfp4_keeps_attention_and_lm_head_in_bf16():
    m = models.get_model("nvidia/GLM-5-NVFP4")
    w = m.weights
    assert (w.experts, w.shared_experts, w.dense_mlp) == ("nvfp4", "nvfp4", "nvfp4")
    assert (w.attention, w.attention_out, w.indexer, w.lm_head, w.router) == ("bf16",) * 5
    assert w.kv_cache == "fp8"
    assert m.moe_layers == tuple(range(3, 78))
    a = m.attention
    assert (
        a.kind,
        a.num_heads,
        a.q_lora_rank,
        a.kv_lora_rank,
        a.qk_nope_head_dim,
        a.qk_rope_head_dim,
        a.v_head_dim,
    ) == ("mla", 64, 2048, 512, 192, 64, 256)
    assert (a.indexer_heads, a.indexer_head_dim, a.indexer_topk) == (32, 128, 2048)
    assert a.kv_elems_per_token == 576


def test_glm5_sizes_match_hardware_reference():
    m = models.get_model("glm-5-nvfp4")
    # hardware.md: one expert 37.7M params = 21.2 MB NVFP4; ~408 GB of experts over 75 MoE layers.
    assert m.expert_params() == 3 * 6144 * 2048 == pytest.approx(37.7e6, rel=2e-3)
    assert m.expert_params() * models.get_format("nvfp4").bytes_per_elem == pytest.approx(21.2e6, rel=3e-3)
    experts_bytes = m.param_breakdown()["experts"] * 0.5625
    assert experts_bytes == pytest.approx(408e9, rel=0.05)
    assert m.total_params() == pytest.approx(744e9, rel=0.01)  # GLM-5 is published as 744B total


def test_deepseek_v3_and_gpt_oss_parameter_counts_match_published_totals():
    assert models.get_model("deepseek-v3").total_params() == pytest.approx(671e9, rel=0.01)
    assert models.get_model("deepseek-v3").active_params_per_token() == pytest.approx(37e9, rel=0.03)
    oss = models.get_model("gpt-oss-120b")
    assert oss.total_params() == pytest.approx(116.8e9, rel=0.01)  # OpenAI model card: 116.8B total, 5.1B active
    assert oss.active_params_per_token() == pytest.approx(5.1e9, rel=0.03)


def test_gpt_oss_sliding_window_on_alternate_layers():
    m = models.get_model("gpt-oss-20b")
    assert m.sliding_window_layers == tuple(range(0, 24, 2))
    assert m.attention.sliding_window == 128
    assert m.weights.attention == "bf16"
    assert m.weights.experts == "mxfp4"


def test_llama4_maverick_interleaves_moe_and_dense():
    m = models.get_model("llama-4-maverick")
    assert m.moe_layers == tuple(range(1, 48, 2))
    assert m.dense_layers == tuple(range(0, 48, 2))
    assert m.intermediate_size == 16384 and m.moe_intermediate_size == 8192
    assert m.n_shared_experts == 1
    assert m.total_params() == pytest.approx(400e9, rel=0.02)


def test_hybrid_models_pattern():
    n = models.get_model("nemotron-3-nano-30b-a3b")
    assert n.layer_mixers.count("mamba") == 23 and n.layer_ffns.count("moe") == 23
    assert len(n.attention_layers) == 6
    assert n.linear_mixer is not None and n.linear_mixer.kind == "mamba2"
    assert not n.gated_mlp  # relu2 experts: up + down only
    q = models.get_model("qwen3.5-397b-a17b")
    assert len(q.linear_mixer_layers) == 45 and q.attention_layers == tuple(range(3, 60, 4))
    assert q.attention.output_gate


def test_formats_bytes_include_block_scales():
    assert models.get_format("nvfp4").bytes_per_elem == 0.5625
    assert models.get_format("mxfp4").bytes_per_elem == 0.53125
    assert models.get_format("mxfp8").bytes_per_elem == 1.03125
    assert models.get_format("fp8_block128").bytes_per_elem == pytest.approx(1.000244, rel=1e-6)
    assert models.get_format("bf16").bytes_per_elem == 2.0
    with pytest.raises(UnknownNameError):
        models.get_format("int3")


@pytest.mark.parametrize("alias", ["GLM-5", "glm5", "zai-org/GLM-5", "  glm-5 "])
def test_aliases(alias):
    assert models.get_model(alias).name == "glm-5"


def test_unknown_model_suggests_close_matches():
    with pytest.raises(UnknownNameError) as exc:
        models.get_model("glm-6")
    assert "glm-5" in exc.value.suggestions
    with pytest.raises(UnknownNameError):
        models.get_model("nonsense-model-xyz")


def _copy_glm5_nvfp4(dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(PACKAGED_CONFIGS / "nvidia--GLM-5-NVFP4_config.json", dst / "config.json")
    shutil.copy(PACKAGED_CONFIGS / "nvidia--GLM-5-NVFP4_hf_quant_config.json", dst / "hf_quant_config.json")
    return dst


def test_checkpoint_directory_with_quant_config(tmp_path):
    d = _copy_glm5_nvfp4(tmp_path / "GLM-5-NVFP4")
    for arg in (d, d / "config.json", str(d)):
        m = models.get_model(str(arg))
        assert m.weights.experts == "nvfp4" and m.weights.kv_cache == "fp8"
        assert m.name == "GLM-5-NVFP4"
    (d / "hf_quant_config.json").unlink()
    assert models.get_model(str(d)).weights.experts == "bf16"


def _write(tmp_path: Path, content: str, name: str = "config.json") -> Path:
    p = tmp_path / name
    p.write_text(content)
    return p


def _base_cfg() -> dict:
    return json.loads((PACKAGED_CONFIGS / "Qwen--Qwen3-30B-A3B_config.json").read_text())


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda c: c.pop("hidden_size"), "'hidden_size'"),
        (lambda c: c.update(hidden_size=0), "'hidden_size' must be a positive integer, got 0"),
        (lambda c: c.update(num_hidden_layers=-3), "'num_hidden_layers' must be a positive integer"),
        (lambda c: c.update(num_experts_per_tok=200), "exceeds the number of experts"),
        (lambda c: c.update(num_key_value_heads=5), "not a multiple of num_key_value_heads"),
        (lambda c: c.update(moe_intermediate_size="big"), "'moe_intermediate_size' must be a positive integer"),
        (lambda c: c.update(quantization_config={"quant_method": "awq"}), "unsupported quantization_config"),
    ],
)
def test_malformed_configs_raise_model_config_error(tmp_path, mutate, needle):
    cfg = _base_cfg()
    mutate(cfg)
    p = _write(tmp_path, json.dumps(cfg))
    with pytest.raises(ModelConfigError) as exc:
        models.load_hf_config(p)
    assert needle in str(exc.value)
    assert str(p) in str(exc.value)
    assert "\n" not in str(exc.value)


def test_invalid_json_names_line_and_column(tmp_path):
    p = _write(tmp_path, '{\n  "hidden_size": 12,\n  oops\n}')
    with pytest.raises(ModelConfigError, match=r"not valid JSON \(line 3, column 3"):
        models.get_model(str(p))


def test_not_an_object_and_missing_path(tmp_path):
    with pytest.raises(ModelConfigError, match="not a JSON object"):
        models.load_hf_config(_write(tmp_path, "[1, 2]"))
    with pytest.raises(ModelConfigError, match="no such file"):
        models.get_model(str(tmp_path / "absent" / "config.json"))
    with pytest.raises(ModelConfigError, match="no such file"):
        models.load_hf_config(tmp_path / "empty-dir-without-config")


def test_bad_quant_config(tmp_path):
    d = _copy_glm5_nvfp4(tmp_path / "m")
    (d / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "INT3"}}))
    with pytest.raises(ModelConfigError, match="unsupported quantisation algorithm 'INT3'"):
        models.load_hf_config(d)
    (d / "hf_quant_config.json").write_text(json.dumps({"producer": {}}))
    with pytest.raises(ModelConfigError, match="no 'quantization' object"):
        models.load_hf_config(d)
    with pytest.raises(ModelConfigError, match="quantisation config"):
        models.load_hf_config(d / "hf_quant_config.json")


def test_model_spec_to_dict_is_json_ready():
    d = json.loads(json.dumps(models.get_model("kimi-k2").to_dict()))
    assert d["moe_layers"] == list(range(1, 61))
    assert d["attention"]["kind"] == "mla"
    assert d["weights"]["experts"] == "fp8_block128"
