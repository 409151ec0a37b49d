"""The tiny random MoE builder: real builds with transformers and tokenizers, on CPU."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from servescope.engine import tiny_model
from servescope.engine.tiny_model import (
    IM_END,
    MARKER_FILE,
    SPECIAL_TOKENS,
    TinyMoeSpec,
    build_tiny_moe,
    default_cache_dir,
    model_dir_for,
    suppressed_token_ids,
)
from servescope.errors import EngineError


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_writes_a_complete_hf_model_folder(tiny_model_dir: Path):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", MARKER_FILE} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["hidden_size"] == 128
    assert config["num_hidden_layers"] == 2
    assert config.get("num_experts", config.get("num_local_experts")) == 8
    assert config["num_experts_per_tok"] == 2
    assert config["vocab_size"] == 4096
    assert config["tie_word_embeddings"] is False
    marker = json.loads((tiny_model_dir / MARKER_FILE).read_text())
    assert marker["cache_key"] == TinyMoeSpec().cache_key()
    # Small: ~6 MB of float32 weights (local-engine.md).
    assert (tiny_model_dir / "model.safetensors").stat().st_size < 16 * 1024 * 1024


def test_tokenizer_is_4096_byte_level_bpe_with_specials_and_chat_template(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == 4096
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == IM_END
    text = "Throughput: 1,640 tok/s — café 日本語 🚀"
    assert tok.decode(tok.encode(text)) == text  # byte-level: every string round-trips
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_special_tokens_are_never_generated(tiny_model_dir: Path):
    """Sampling 3 x 300 tokens at temperature 1 (and greedily) never yields a suppressed id, so lengths are exact."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    suppressed = set(suppressed_token_ids(tiny_model_dir))
    assert {0, 1, 2} <= suppressed
    prompt = torch.tensor([[5, 77, 300, 1200, 4000], [9, 8, 7, 6, 5], [100, 200, 300, 400, 500]])
    torch.manual_seed(1234)
    for do_sample in (True, False):
        out = model.generate(prompt, max_new_tokens=300, do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0)
        new = out[:, prompt.shape[1] :]
        assert new.shape == (3, 300)
        assert not (set(new.flatten().tolist()) & suppressed)
    logits = model(input_ids=prompt).logits[0, -1]
    ordinary = torch.ones_like(logits, dtype=torch.bool)
    ordinary[sorted(suppressed)] = False
    assert (logits[ordinary].max() - logits[~ordinary].max()).item() > 500


def test_cache_hit_reuses_the_folder_without_rebuilding(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    def _must_not_build(*_args: object) -> None:
        raise AssertionError("rebuilt despite a complete cached model")

    monkeypatch.setattr(tiny_model, "_build_into", _must_not_build)
    assert build_tiny_moe(cache_dir=tiny_model_dir.parent) == tiny_model_dir


def test_build_is_deterministic(tiny_model_dir: Path, tmp_path: Path):
    """A second build elsewhere gives byte-identical weights and tokenizer (fixed seed, shipped corpus)."""
    again = build_tiny_moe(cache_dir=tmp_path)
    assert again.name == tiny_model_dir.name
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(tiny_model_dir / name), name


def test_crash_mid_build_leaves_no_model_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real_build = tiny_model._build_into

    def _crash_after_writing(spec: TinyMoeSpec, out_dir: Path, device: str) -> None:
        real_build(spec, out_dir, device)
        raise KeyboardInterrupt  # as if Ctrl-C arrived just before the rename

    monkeypatch.setattr(tiny_model, "_build_into", _crash_after_writing)
    spec = TinyMoeSpec(seed=7)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_moe(spec, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(tiny_model, "_build_into", real_build)
    built = build_tiny_moe(spec, cache_dir=tmp_path)
    assert built == model_dir_for(spec, tmp_path)
    assert (built / MARKER_FILE).is_file()


def test_cache_key_depends_on_every_spec_field():
    base = TinyMoeSpec()
    assert base.cache_key() == TinyMoeSpec().cache_key()
    assert TinyMoeSpec(seed=1).cache_key() != base.cache_key()
    assert TinyMoeSpec(num_hidden_layers=3).cache_key() != base.cache_key()
    assert TinyMoeSpec(dtype="bfloat16").cache_key() != base.cache_key()


def test_gpu_preset_has_qwen3_30b_a3b_shapes():
    spec = TinyMoeSpec.gpu()
    assert (spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (
        2048,
        128,
        8,
        768,
    )
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (32, 4, 128)
    assert spec.num_hidden_layers == 8
    assert spec.dtype == "bfloat16"
    assert spec.tokenizer_vocab_size == 4096 < spec.vocab_size
    assert TinyMoeSpec.gpu(num_hidden_layers=4).num_hidden_layers == 4


def test_foreign_folder_at_the_cache_path_is_not_overwritten(tmp_path: Path):
    spec = TinyMoeSpec(seed=11)
    squatter = model_dir_for(spec, tmp_path)
    squatter.mkdir(parents=True)
    (squatter / "precious.txt").write_text("keep me")
    with pytest.raises(EngineError, match="not a complete servescope model"):
        build_tiny_moe(spec, cache_dir=tmp_path)
    assert (squatter / "precious.txt").read_text() == "keep me"


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("SERVESCOPE_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SERVESCOPE_CACHE")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "servescope" / "models"


def test_gpu_preset_without_a_gpu_is_a_clear_error(tmp_path: Path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU preset would build")
    with pytest.raises(EngineError, match="built on a GPU"):
        build_tiny_moe(TinyMoeSpec.gpu(), cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_rows_beyond_the_tokenizer_and_bf16_are_suppressed_too(tmp_path: Path):
    """The GPU preset's situation in miniature: more model rows than tokenizer tokens, bf16 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = TinyMoeSpec(vocab_size=4608, dtype="bfloat16", name="tiny-wide-vocab")
    model_dir = build_tiny_moe(spec, cache_dir=tmp_path)
    suppressed = set(suppressed_token_ids(model_dir))
    assert suppressed == {0, 1, 2} | set(range(4096, 4608))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == torch.bfloat16
    torch.manual_seed(5)
    out = model.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=200, do_sample=True, top_k=0, top_p=1.0)
    assert out.shape == (1, 203)
    assert not (set(out[0, 3:].tolist()) & suppressed)
