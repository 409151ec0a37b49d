"""The model catalog: one normalised shape for every MoE (and dense) LLM family.

Why: each family spells the same facts differently. The number of routed experts is
``n_routed_experts`` (DeepSeek, GLM, Kimi, Nemotron-H), ``num_experts`` (Qwen) or
``num_local_experts`` (Mixtral, gpt-oss, Llama-4, MiniMax); the expert width is
``moe_intermediate_size`` or, where every layer is MoE, ``intermediate_size``; which
layers are MoE follows ``first_k_dense_replace`` + ``moe_layer_freq``,
``decoder_sparse_step`` + ``mlp_only_layers``, ``interleave_moe_layer_step`` or a
``hybrid_override_pattern``; the weight formats live in ``quantization_config`` or in a
separate ``hf_quant_config.json`` (NVIDIA ModelOpt) whose exclude list keeps attention
and ``lm_head`` in BF16. The roofline needs none of that variety: it needs ``ModelSpec``.

Presets are real Hugging Face ``config.json`` files shipped as package data under
``servescope/data/model-configs/`` (copies of ``shared/model-configs/``; the Llama-4
Maverick one holds the ``text_config`` of ``meta-llama/Llama-4-Maverick-17B-128E-Instruct``
as kept in ai-dynamo/aiconfigurator ``model_configs/``), read by the same code that reads
a user's file, so a preset can never disagree with its source.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from servescope.errors import ModelConfigError, UnknownNameError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- formats
@dataclass(frozen=True, slots=True)
class WeightFormat:
    """A storage format for weights (or KV cache) and what it costs in memory traffic.

    ``bytes_per_elem`` counts the block scales: NVFP4 stores 16 E2M1 values (8 B) plus one
    E4M3 scale (1 B) -> 9/16 = 0.5625 B; MXFP4 32 values (16 B) + one E8M0 scale -> 0.53125 B.
    ``compute_dtype`` is the tensor-core dtype the GEMM runs in (a key of
    ``hardware.DTYPES``), used for the GPU's peak and ridge point.
    """

    name: str
    bytes_per_elem: float
    compute_dtype: str
    source: str


_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp32", 4.0, "tf32", "IEEE binary32"),
        WeightFormat("bf16", 2.0, "bf16", "bfloat16"),
        WeightFormat("fp16", 2.0, "fp16", "IEEE binary16"),
        WeightFormat("fp8", 1.0, "fp8", "E4M3 with one per-tensor FP32 scale (negligible)"),
        WeightFormat(
            "fp8_block128",
            1.0 + 4.0 / (128 * 128),
            "fp8",
            "E4M3 with one FP32 scale per 128x128 block (DeepSeek-V3 weight_block_size [128, 128])",
        ),
        WeightFormat("mxfp8", 1.0 + 1.0 / 32, "fp8", "OCP MX: 32 E4M3 values share one E8M0 scale"),
        WeightFormat("mxfp6", 0.75 + 1.0 / 32, "fp6", "OCP MX: 32 E2M3/E3M2 values share one E8M0 scale"),
        WeightFormat(
            "nvfp4",
            0.5 + 1.0 / 16,
            "nvfp4",
            "NVIDIA NVFP4: 16 E2M1 values share one E4M3 scale, plus one FP32 per-tensor scale (negligible)",
        ),
        WeightFormat("mxfp4", 0.5 + 1.0 / 32, "mxfp4", "OCP MX: 32 E2M1 values share one E8M0 scale"),
    )
}

_FORMAT_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "fp4": "nvfp4",
    "e4m3": "fp8",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
    "fp8_block": "fp8_block128",
}


def list_formats() -> list[WeightFormat]:
    """Every weight / KV-cache format the catalog knows."""
    return list(_FORMATS.values())


def get_format(name: str) -> WeightFormat:
    """Look a format up by name ("nvfp4", "fp8", "bf16", ...); close matches on failure."""
    key = name.strip().lower().replace("-", "_")
    key = _FORMAT_ALIASES.get(key, key)
    if key not in _FORMATS:
        raise UnknownNameError("format", name, difflib.get_close_matches(key, list(_FORMATS), n=3))
    return _FORMATS[key]


# --------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Softmax attention of one model, MLA or GQA (MHA and MQA are GQA with kv = q or 1 heads).

    For ``kind == "mla"`` ``head_dim`` is the query/key head size (nope + rope) and the
    cache holds one latent of ``kv_lora_rank + qk_rope_head_dim`` per token, shared by all
    heads. ``indexer_*`` describe DeepSeek Sparse Attention's lightning indexer (GLM-5):
    a small extra attention that picks ``indexer_topk`` cached tokens to attend to.
    ``output_gate`` (Qwen3.5) doubles the query projection to produce a sigmoid gate.
    """

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    sliding_window: int | None = None
    output_gate: bool = False
    indexer_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_topk: int | None = None

    @property
    def kv_elems_per_token(self) -> int:
        """Cached elements per token per layer (all heads): the KV-cache traffic unit."""
        if self.kind == "mla":
            return (self.kv_lora_rank or 0) + (self.qk_rope_head_dim or 0)
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class LinearMixerSpec:
    """A recurrent token mixer (Mamba-2, Gated DeltaNet) in place of attention on some layers.

    Decode cost is two projections plus reading and writing a fixed-size state per sequence:
    ``in_proj_size`` is the input projection's output width, ``out_proj_in`` the output
    projection's input width, ``state_elems`` the recurrent state per sequence and layer,
    ``conv_state_elems`` the short-convolution state.
    """

    kind: str
    num_heads: int
    in_proj_size: int
    out_proj_in: int
    state_elems: int
    conv_state_elems: int
    state_format: str


@dataclass(frozen=True, slots=True)
class WeightFormats:
    """Format of each weight group (and of the KV cache); names are ``list_formats()`` names.

    ``attention`` covers the query/key/value (and MLA down/up) projections, ``attention_out``
    the output projection, which NVIDIA's NVFP4 checkpoints sometimes quantise apart.
    """

    experts: str = "bf16"
    shared_experts: str = "bf16"
    dense_mlp: str = "bf16"
    attention: str = "bf16"
    attention_out: str = "bf16"
    indexer: str = "bf16"
    router: str = "bf16"
    lm_head: str = "bf16"
    kv_cache: str = "bf16"
    linear_mixer: str = "bf16"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model reduced to what the decode roofline needs, identical across families.

    ``layer_mixers[i]`` is "attention", "sliding_attention", "linear_attention", "mamba" or
    "none"; ``layer_ffns[i]`` is "dense", "moe" or "none". Widths are per expert / per
    layer, before any tensor parallelism. ``shared_expert_intermediate_size`` is the width
    of ONE shared expert (there are ``n_shared_experts`` of them).
    """

    name: str
    source: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    layer_mixers: tuple[str, ...]
    layer_ffns: tuple[str, ...]
    intermediate_size: int | None
    moe_intermediate_size: int | None
    n_routed_experts: int
    top_k: int
    n_shared_experts: int
    shared_expert_intermediate_size: int | None
    gated_mlp: bool
    attention: AttentionSpec | None
    linear_mixer: LinearMixerSpec | None
    weights: WeightFormats
    notes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()

    @property
    def weight_formats(self) -> WeightFormats:
        """Alias of ``weights`` (the name some callers look for)."""
        return self.weights

    # -- layer pattern
    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.layer_ffns) if f == "moe")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.layer_ffns) if f == "dense")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.layer_mixers) if m in ("attention", "sliding_attention"))

    @property
    def sliding_window_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.layer_mixers) if m == "sliding_attention")

    @property
    def linear_mixer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.layer_mixers) if m in ("linear_attention", "mamba"))

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def attention_kind(self) -> str | None:
        return self.attention.kind if self.attention else None

    # -- parameter counts (weights only; embeddings included once, norms and biases left out)
    def expert_params(self) -> int:
        """Parameters of ONE routed expert (gate + up + down, or up + down when not gated)."""
        if not self.moe_intermediate_size:
            return 0
        mats = 3 if self.gated_mlp else 2
        return mats * self.hidden_size * self.moe_intermediate_size

    def param_breakdown(self) -> dict[str, int]:
        """Parameter count per weight group, summed over layers."""
        h = self.hidden_size
        mats = 3 if self.gated_mlp else 2
        out = dict.fromkeys(
            (
                "attention",
                "attention_out",
                "indexer",
                "linear_mixer",
                "dense_mlp",
                "router",
                "experts",
                "shared_experts",
                "embedding",
                "lm_head",
            ),
            0,
        )
        att = self.attention
        for mixer in self.layer_mixers:
            if mixer in ("attention", "sliding_attention") and att is not None:
                qkv, o, idx = _attention_params(att, h)
                out["attention"] += qkv
                out["attention_out"] += o
                out["indexer"] += idx
            elif mixer in ("linear_attention", "mamba") and self.linear_mixer is not None:
                lm = self.linear_mixer
                out["linear_mixer"] += h * lm.in_proj_size + lm.out_proj_in * h
        for ffn in self.layer_ffns:
            if ffn == "dense" and self.intermediate_size:
                out["dense_mlp"] += mats * h * self.intermediate_size
            elif ffn == "moe":
                out["router"] += h * self.n_routed_experts
                out["experts"] += self.n_routed_experts * self.expert_params()
                if self.n_shared_experts and self.shared_expert_intermediate_size:
                    out["shared_experts"] += self.n_shared_experts * mats * h * self.shared_expert_intermediate_size
        out["embedding"] = self.vocab_size * h
        out["lm_head"] = 0 if self.tie_word_embeddings else self.vocab_size * h
        return out

    def total_params(self) -> int:
        return sum(self.param_breakdown().values())

    def active_params_per_token(self) -> int:
        """Parameters one token touches in a forward pass (top-k routed experts, not all)."""
        b = self.param_breakdown()
        routed_active = len(self.moe_layers) * self.top_k * self.expert_params()
        return sum(v for k, v in b.items() if k not in ("experts", "embedding")) + routed_active

    def weight_bytes(self) -> float:
        """Bytes of all weights in their stored formats (block scales included)."""
        b = self.param_breakdown()
        fmt = self.weights
        groups = {
            "attention": fmt.attention,
            "attention_out": fmt.attention_out,
            "indexer": fmt.indexer,
            "linear_mixer": fmt.linear_mixer,
            "dense_mlp": fmt.dense_mlp,
            "router": fmt.router,
            "experts": fmt.experts,
            "shared_experts": fmt.shared_experts,
            "embedding": "bf16",
            "lm_head": fmt.lm_head,
        }
        return sum(b[g] * get_format(f).bytes_per_elem for g, f in groups.items())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with derived facts (layer lists, parameter counts)."""
        d = asdict(self)
        d["layer_mixers"] = list(self.layer_mixers)
        d["layer_ffns"] = list(self.layer_ffns)
        d["notes"] = list(self.notes)
        d["aliases"] = list(self.aliases)
        d.update(
            moe_layers=list(self.moe_layers),
            dense_layers=list(self.dense_layers),
            attention_layers=list(self.attention_layers),
            sliding_window_layers=list(self.sliding_window_layers),
            linear_mixer_layers=list(self.linear_mixer_layers),
            attention_kind=self.attention_kind,
            params=self.param_breakdown(),
            total_params=self.total_params(),
            active_params_per_token=self.active_params_per_token(),
            weight_bytes=self.weight_bytes(),
        )
        return d


def _attention_params(att: AttentionSpec, h: int) -> tuple[int, int, int]:
    """(q/k/v projection params, output projection params, indexer params) of one layer."""
    if att.kind == "mla":
        nope, rope, v = att.qk_nope_head_dim or 0, att.qk_rope_head_dim or 0, att.v_head_dim or 0
        kv_lora, heads = att.kv_lora_rank or 0, att.num_heads
        if att.q_lora_rank:
            q = h * att.q_lora_rank + att.q_lora_rank * heads * (nope + rope)
        else:
            q = h * heads * (nope + rope)
        kv = h * (kv_lora + rope) + kv_lora * heads * (nope + v)
        o = heads * v * h
        idx = 0
        if att.indexer_heads and att.indexer_head_dim:
            # DSA lightning indexer: wq_b (q_lora -> heads*dim), wk (hidden -> dim), weights_proj (hidden -> heads)
            q_in = att.q_lora_rank or h
            idx = q_in * att.indexer_heads * att.indexer_head_dim + h * att.indexer_head_dim + h * att.indexer_heads
        return q + kv, o, idx
    q_width = att.num_heads * att.head_dim * (2 if att.output_gate else 1)
    qkv = h * (q_width + 2 * att.num_kv_heads * att.head_dim)
    return qkv, att.num_heads * att.head_dim * h, 0


# --------------------------------------------------------------------------- reading
def _get(cfg: Mapping[str, Any], path: str, *keys: str, default: Any = None, required: bool = False) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    if required:
        raise ModelConfigError(path, f"missing {' / '.join(repr(k) for k in keys)}; is this a decoder LLM config.json?")
    return default


def _pos_int(path: str, name: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
        need = "a non-negative" if allow_zero else "a positive"
        raise ModelConfigError(path, f"{name!r} must be {need} integer, got {value!r}")
    return value


def _quant_format_from_algo(path: str, algo: str | None) -> str | None:
    if algo is None:
        return None
    table = {
        "NVFP4": "nvfp4",
        "FP8": "fp8",
        "MXFP4": "mxfp4",
        "MXFP8": "mxfp8",
        "FP8_BLOCK": "fp8_block128",
        "W4A16_NVFP4": "nvfp4",
        "NVFP4_AWQ": "nvfp4",
    }
    key = str(algo).upper()
    if key not in table:
        raise ModelConfigError(path, f"unsupported quantisation algorithm {algo!r}; supported: {', '.join(table)}")
    return table[key]


def _module_names(spec_family: str, layer: int, group: str) -> list[str]:
    """Representative module names of one weight group in one layer, as checkpoints spell them.

    Exclude lists from ModelOpt / transformers are globs over these names; matching a
    module or any of its parents excludes it (``model.layers.*.self_attn`` excludes all
    attention projections).
    """
    p = f"model.layers.{layer}"
    if group == "attention":
        if spec_family == "mla":
            return [
                f"{p}.self_attn.q_a_proj",
                f"{p}.self_attn.q_b_proj",
                f"{p}.self_attn.kv_a_proj_with_mqa",
                f"{p}.self_attn.kv_b_proj",
            ]
        return [f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj"]
    if group == "attention_out":
        return [f"{p}.self_attn.o_proj"]
    if group == "indexer":
        return [f"{p}.self_attn.indexer.wq_b", f"{p}.self_attn.indexer.wk"]
    if group == "experts":
        return [f"{p}.mlp.experts.0.gate_proj", f"{p}.mlp.experts.0.down_proj", f"{p}.mlp.experts.gate_up_proj"]
    if group == "shared_experts":
        return [f"{p}.mlp.shared_experts.gate_proj", f"{p}.mlp.shared_expert.gate_proj"]
    if group == "dense_mlp":
        return [f"{p}.mlp.gate_proj", f"{p}.mlp.down_proj"]
    if group == "router":
        return [f"{p}.mlp.gate", f"{p}.mlp.router"]
    return [group]


def _compile_patterns(patterns: list[str]) -> re.Pattern[str] | None:
    """One regex for a whole exclude list (ModelOpt lists run to hundreds of globs)."""
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def _excluded(name: str, patterns: re.Pattern[str] | None) -> bool:
    if patterns is None:
        return False
    parts = name.split(".")
    return any(patterns.match(".".join(parts[: i + 1])) for i in range(len(parts)))


def _group_excluded(
    family: str, group: str, layers: list[int], patterns: re.Pattern[str] | None, notes: list[str]
) -> bool:
    """A group keeps the base format when excluded in the majority of the layers that have it."""
    if not layers:
        return False
    hits = sum(any(_excluded(n, patterns) for n in _module_names(family, i, group)) for i in layers)
    if 0 < hits < len(layers):
        notes.append(f"{group}: excluded from quantisation in {hits} of {len(layers)} layers; modelled as the majority")
    return hits * 2 > len(layers)


def _weight_formats(
    path: str,
    cfg: Mapping[str, Any],
    quant_file: Mapping[str, Any] | None,
    family: str,
    mixers: tuple[str, ...],
    ffns: tuple[str, ...],
    notes: list[str],
    *,
    has_shared: bool,
    has_indexer: bool,
) -> WeightFormats:
    base_dtype = str(_get(cfg, path, "torch_dtype", "dtype", default="bfloat16"))
    base = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(base_dtype, "bf16")
    qfmt: str | None = None
    kv = base
    patterns: list[str] = []
    if quant_file is not None:
        q = quant_file.get("quantization")
        if not isinstance(q, Mapping):
            raise ModelConfigError(path, "hf_quant_config.json has no 'quantization' object")
        qfmt = _quant_format_from_algo(path, q.get("quant_algo"))
        kv = _quant_format_from_algo(path, q.get("kv_cache_quant_algo")) or base
        patterns = [str(p) for p in q.get("exclude_modules") or []]
    else:
        qc = cfg.get("quantization_config")
        if isinstance(qc, Mapping):
            method = str(qc.get("quant_method", "")).lower()
            patterns = [str(p) for p in qc.get("modules_to_not_convert") or qc.get("ignore") or []]
            if method == "fp8":
                block = qc.get("weight_block_size")
                qfmt = "fp8_block128" if block else "fp8"
                if block and list(block) != [128, 128]:
                    notes.append(f"fp8 weight blocks {block}: scale overhead counted as for 128x128")
            elif method == "mxfp4":
                qfmt = "mxfp4"
            elif method == "modelopt":
                qfmt = _quant_format_from_algo(path, qc.get("quant_algo"))
                kv = _quant_format_from_algo(path, qc.get("kv_cache_quant_algo")) or base
                patterns = [str(p) for p in qc.get("exclude_modules") or patterns]
            else:
                raise ModelConfigError(
                    path, f"unsupported quantization_config.quant_method {method!r}; supported: fp8, mxfp4, modelopt"
                )
    if qfmt is None:
        return WeightFormats(**dict.fromkeys(WeightFormats.__dataclass_fields__, base))
    compiled = _compile_patterns(patterns)

    def fmt(group: str, layers: list[int]) -> str:
        # A group the model does not have keeps the base dtype (it is never used).
        if not layers or _group_excluded(family, group, layers, compiled, notes):
            return base
        return qfmt  # type: ignore[return-value]

    att_layers = [i for i, m in enumerate(mixers) if m in ("attention", "sliding_attention")]
    moe_layers = [i for i, f in enumerate(ffns) if f == "moe"]
    dense_layers = [i for i, f in enumerate(ffns) if f == "dense"]
    shared_layers = moe_layers if has_shared else []
    indexer_layers = att_layers if has_indexer else []
    lm = base if _excluded("lm_head", compiled) or quant_file is None else qfmt
    if quant_file is None and not _excluded("lm_head", compiled):
        # transformers keeps the output layer unquantised (get_keys_to_not_convert), as DeepSeek's FP8 release does.
        notes.append("lm_head kept in the base dtype (transformers does not quantise the output layer)")
    return WeightFormats(
        experts=fmt("experts", moe_layers),
        shared_experts=fmt("shared_experts", shared_layers),
        dense_mlp=fmt("dense_mlp", dense_layers),
        attention=fmt("attention", att_layers),
        attention_out=fmt("attention_out", att_layers),
        indexer=fmt("indexer", indexer_layers),
        # Routers are tiny and every engine keeps them in BF16/FP32; listed in every exclude list we have seen.
        router=base,
        lm_head=lm,
        kv_cache=kv,
        linear_mixer=base,
    )


def _layer_pattern(path: str, cfg: Mapping[str, Any], n_layers: int, n_experts: int) -> tuple[tuple[str, ...], ...]:
    """(mixers, ffns) per layer, from whichever family-specific fields the config has."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):  # Nemotron-H: one character per layer
        if len(pattern) != n_layers:
            raise ModelConfigError(
                path, f"hybrid_override_pattern has {len(pattern)} layers, num_hidden_layers says {n_layers}"
            )
        table = {"M": ("mamba", "none"), "*": ("attention", "none"), "E": ("none", "moe"), "-": ("none", "dense")}
        bad = sorted(set(pattern) - set(table))
        if bad:
            raise ModelConfigError(path, f"hybrid_override_pattern has unknown layer kinds {bad}")
        return tuple(table[c][0] for c in pattern), tuple(table[c][1] for c in pattern)

    # mixers
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if isinstance(layer_types, list) and layer_types:
        if len(layer_types) != n_layers:
            raise ModelConfigError(
                path, f"layer_types has {len(layer_types)} entries, num_hidden_layers says {n_layers}"
            )
        names = {
            "full_attention": "attention",
            "sliding_attention": "sliding_attention",
            "chunked_attention": "sliding_attention",
            "linear_attention": "linear_attention",
        }
        unknown = sorted({t for t in layer_types if t not in names})
        if unknown:
            raise ModelConfigError(path, f"unknown layer_types {unknown}")
        mixers = tuple(names[t] for t in layer_types)
    elif cfg.get("attention_chunk_size") and cfg.get("model_type") == "llama4_text":
        # Llama-4: chunked (local) attention on RoPE layers, every 4th layer global (no_rope_layer_interval=4,
        # transformers Llama4TextConfig).
        mixers = tuple("sliding_attention" if (i + 1) % 4 != 0 else "attention" for i in range(n_layers))
    elif (
        window
        and cfg.get("use_sliding_window", True) is not False
        and cfg.get("model_type") not in ("qwen3", "qwen3_moe")
    ):
        mixers = ("sliding_attention",) * n_layers
    else:
        mixers = ("attention",) * n_layers

    # ffns
    if n_experts == 0:
        return mixers, ("dense",) * n_layers
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:  # DeepSeek, GLM, Kimi
        k = _pos_int(path, "first_k_dense_replace", int(cfg.get("first_k_dense_replace") or 0), allow_zero=True)
        freq = _pos_int(path, "moe_layer_freq", int(cfg.get("moe_layer_freq") or 1))
        ffns = tuple("moe" if i >= k and i % freq == 0 else "dense" for i in range(n_layers))
    elif "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:  # Qwen-MoE (transformers Qwen3MoeDecoderLayer)
        step = _pos_int(path, "decoder_sparse_step", int(cfg.get("decoder_sparse_step") or 1))
        dense_only = set(cfg.get("mlp_only_layers") or [])
        ffns = tuple("moe" if i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(n_layers))
    elif "moe_layers" in cfg or "interleave_moe_layer_step" in cfg:  # Llama-4 (Llama4TextConfig.moe_layers)
        moe = cfg.get("moe_layers")
        if moe is None:
            step = _pos_int(path, "interleave_moe_layer_step", int(cfg.get("interleave_moe_layer_step") or 1))
            moe = list(range(step - 1, n_layers, step))
        ffns = tuple("moe" if i in set(moe) else "dense" for i in range(n_layers))
    else:  # Mixtral, gpt-oss, MiniMax: every layer is MoE
        ffns = ("moe",) * n_layers
    return mixers, ffns


def _attention(path: str, cfg: Mapping[str, Any], hidden: int) -> AttentionSpec:
    heads = _pos_int(path, "num_attention_heads", _get(cfg, path, "num_attention_heads", required=True))
    if cfg.get("kv_lora_rank"):
        kv_lora = _pos_int(path, "kv_lora_rank", cfg["kv_lora_rank"])
        nope = _pos_int(path, "qk_nope_head_dim", _get(cfg, path, "qk_nope_head_dim", required=True))
        rope = _pos_int(path, "qk_rope_head_dim", _get(cfg, path, "qk_rope_head_dim", required=True))
        v = _pos_int(path, "v_head_dim", _get(cfg, path, "v_head_dim", required=True))
        q_lora = cfg.get("q_lora_rank")
        if q_lora is not None:
            q_lora = _pos_int(path, "q_lora_rank", q_lora)
        idx_heads = cfg.get("index_n_heads")
        return AttentionSpec(
            kind="mla",
            num_heads=heads,
            num_kv_heads=1,  # one shared latent per token
            head_dim=nope + rope,
            q_lora_rank=q_lora,
            kv_lora_rank=kv_lora,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=v,
            indexer_heads=_pos_int(path, "index_n_heads", idx_heads) if idx_heads else None,
            indexer_head_dim=_pos_int(path, "index_head_dim", cfg["index_head_dim"]) if idx_heads else None,
            indexer_topk=_pos_int(path, "index_topk", cfg["index_topk"]) if idx_heads else None,
        )
    kv_heads = _pos_int(path, "num_key_value_heads", _get(cfg, path, "num_key_value_heads", default=heads))
    if heads % kv_heads:
        raise ModelConfigError(path, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    head_dim = _pos_int(path, "head_dim", head_dim)
    window = cfg.get("sliding_window") or cfg.get("attention_chunk_size")
    return AttentionSpec(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        sliding_window=_pos_int(path, "sliding_window", window) if window else None,
        output_gate=bool(cfg.get("attn_output_gate", False)),
    )


def _linear_mixer(path: str, cfg: Mapping[str, Any], mixers: tuple[str, ...]) -> LinearMixerSpec | None:
    if "mamba" in mixers:
        # Mamba-2 (transformers NemotronHMamba2Mixer): in_proj -> 2*d_inner + 2*groups*state + heads.
        heads = _pos_int(path, "mamba_num_heads", _get(cfg, path, "mamba_num_heads", required=True))
        hd = _pos_int(path, "mamba_head_dim", _get(cfg, path, "mamba_head_dim", required=True))
        groups = _pos_int(path, "n_groups", _get(cfg, path, "n_groups", default=1))
        state = _pos_int(path, "ssm_state_size", _get(cfg, path, "ssm_state_size", required=True))
        conv = _pos_int(path, "conv_kernel", _get(cfg, path, "conv_kernel", default=4))
        d_inner = heads * hd
        sdt = str(cfg.get("mamba_ssm_cache_dtype", "float32"))
        return LinearMixerSpec(
            kind="mamba2",
            num_heads=heads,
            in_proj_size=2 * d_inner + 2 * groups * state + heads,
            out_proj_in=d_inner,
            state_elems=heads * hd * state,
            conv_state_elems=(d_inner + 2 * groups * state) * (conv - 1),
            state_format={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(sdt, "fp32"),
        )
    if "linear_attention" in mixers:
        # Gated DeltaNet (transformers Qwen3NextGatedDeltaNet): in_proj_qkvz + in_proj_ba, state v_heads x dk x dv.
        kh = _pos_int(path, "linear_num_key_heads", _get(cfg, path, "linear_num_key_heads", required=True))
        vh = _pos_int(path, "linear_num_value_heads", _get(cfg, path, "linear_num_value_heads", required=True))
        dk = _pos_int(path, "linear_key_head_dim", _get(cfg, path, "linear_key_head_dim", required=True))
        dv = _pos_int(path, "linear_value_head_dim", _get(cfg, path, "linear_value_head_dim", required=True))
        conv = _pos_int(path, "linear_conv_kernel_dim", _get(cfg, path, "linear_conv_kernel_dim", default=4))
        key_dim, value_dim = kh * dk, vh * dv
        sdt = str(cfg.get("mamba_ssm_dtype", "float32"))
        return LinearMixerSpec(
            kind="gated_deltanet",
            num_heads=vh,
            in_proj_size=2 * key_dim + 2 * value_dim + 2 * vh,
            out_proj_in=value_dim,
            state_elems=vh * dk * dv,
            conv_state_elems=(2 * key_dim + value_dim) * (conv - 1),
            state_format={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(sdt, "fp32"),
        )
    return None


def spec_from_config(
    config: Mapping[str, Any],
    *,
    name: str,
    source: str,
    quant_config: Mapping[str, Any] | None = None,
    aliases: tuple[str, ...] = (),
) -> ModelSpec:
    """Normalise one parsed HF config (plus optional ModelOpt quant config) into a ``ModelSpec``."""
    path = source
    if not isinstance(config, Mapping):
        raise ModelConfigError(path, "top level is not a JSON object")
    top = config
    cfg = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    notes: list[str] = []

    n_layers = _pos_int(path, "num_hidden_layers", _get(cfg, path, "num_hidden_layers", "num_layers", required=True))
    hidden = _pos_int(path, "hidden_size", _get(cfg, path, "hidden_size", required=True))
    vocab = _pos_int(path, "vocab_size", _get(cfg, path, "vocab_size", "padded_vocab_size", required=True))
    n_experts = _get(cfg, path, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    n_experts = _pos_int(path, "n_routed_experts", int(n_experts), allow_zero=True)
    top_k = 0
    if n_experts:
        top_k = _pos_int(
            path,
            "num_experts_per_tok",
            _get(cfg, path, "num_experts_per_tok", "experts_per_token", "moe_topk", required=True),
        )
        if top_k > n_experts:
            raise ModelConfigError(path, f"num_experts_per_tok {top_k} exceeds the number of experts {n_experts}")

    mixers, ffns = _layer_pattern(path, cfg, n_layers, n_experts)
    has_moe = "moe" in ffns
    has_dense = "dense" in ffns

    # Widths. Llama-4 names its expert width intermediate_size and its dense width intermediate_size_mlp.
    inter = cfg.get("intermediate_size")
    moe_inter = cfg.get("moe_intermediate_size")
    if cfg.get("intermediate_size_mlp"):
        moe_inter = moe_inter or inter
        inter = cfg["intermediate_size_mlp"]
    if has_moe and not moe_inter:
        moe_inter = inter  # Mixtral, gpt-oss, MiniMax: every layer is MoE and intermediate_size is the expert width
        if not has_dense:
            inter = None
    if has_moe:
        if moe_inter is None:
            raise ModelConfigError(path, "MoE model without moe_intermediate_size / intermediate_size")
        moe_inter = _pos_int(path, "moe_intermediate_size", moe_inter)
    else:
        moe_inter = None
    if has_dense:
        if inter is None:
            raise ModelConfigError(path, "dense MLP layers but no intermediate_size")
        inter = _pos_int(path, "intermediate_size", inter)
    else:
        inter = None

    # Shared experts: DeepSeek/GLM/Kimi count * moe width; Qwen3.5/Qwen2-MoE one of its own width;
    # Llama-4 one of the expert width; Nemotron-H its own width; MiniMax says 0.
    n_shared = 0
    shared_w: int | None = None
    if has_moe:
        if cfg.get("n_shared_experts"):
            n_shared = _pos_int(path, "n_shared_experts", cfg["n_shared_experts"])
            shared_w = cfg.get("moe_shared_expert_intermediate_size") or moe_inter
        elif cfg.get("shared_expert_intermediate_size"):
            n_shared, shared_w = 1, cfg["shared_expert_intermediate_size"]
        elif cfg.get("shared_intermediate_size"):
            n_shared, shared_w = 1, cfg["shared_intermediate_size"]
        elif (cfg.get("model_type") or "").startswith("llama4"):
            n_shared, shared_w = 1, moe_inter
            notes.append("Llama-4: one shared expert of the routed expert width in every MoE layer")
        if shared_w is not None:
            shared_w = _pos_int(path, "shared_expert_intermediate_size", shared_w)

    act = str(cfg.get("mlp_hidden_act") or cfg.get("hidden_act") or "silu")
    gated = act not in ("relu2", "gelu", "gelu_new", "relu")  # SwiGLU-style unless the MLP says otherwise

    attention = None
    if any(m in ("attention", "sliding_attention") for m in mixers):
        attention = _attention(path, cfg, hidden)
    linear = _linear_mixer(path, cfg, mixers)
    family = attention.kind if attention else "gqa"
    model_type = str(top.get("model_type") or cfg.get("model_type") or "unknown")
    tie = bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    qcfg_holder = top if "quantization_config" in top else cfg
    weights = _weight_formats(
        path,
        qcfg_holder,
        quant_config,
        family,
        mixers,
        ffns,
        notes,
        has_shared=n_shared > 0,
        has_indexer=bool(attention and attention.indexer_heads),
    )
    if attention is not None and attention.sliding_window and "sliding_attention" not in mixers:
        attention = AttentionSpec(**{**asdict(attention), "sliding_window": None})
    if int(cfg.get("num_nextn_predict_layers") or 0) or cfg.get("mtp_num_hidden_layers") or cfg.get("use_mtp"):
        notes.append("multi-token-prediction layers are not modelled (plain decode, no speculative tokens)")
    return ModelSpec(
        name=name,
        source=source,
        model_type=model_type,
        num_layers=n_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        layer_mixers=mixers,
        layer_ffns=ffns,
        intermediate_size=inter,
        moe_intermediate_size=moe_inter,
        n_routed_experts=n_experts if has_moe else 0,
        top_k=top_k if has_moe else 0,
        n_shared_experts=n_shared,
        shared_expert_intermediate_size=shared_w,
        gated_mlp=gated,
        attention=attention,
        linear_mixer=linear,
        weights=weights,
        notes=tuple(notes),
        aliases=aliases,
    )


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ModelConfigError(str(path), f"cannot read: {err.strerror or err}") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelConfigError(str(path), f"not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from err


def _quant_sibling(config_path: Path) -> Path:
    """Where ModelOpt's ``hf_quant_config.json`` sits next to a config file.

    Beside ``config.json`` in a checkpoint directory; beside ``ORG--NAME_config.json`` as
    ``ORG--NAME_hf_quant_config.json`` in a flat folder such as ``shared/model-configs``.
    """
    name = config_path.name
    if name.endswith("_config.json") and name != "config.json":
        return config_path.with_name(name[: -len("config.json")] + "hf_quant_config.json")
    return config_path.with_name("hf_quant_config.json")


def _name_from_path(config_path: Path, cfg: Mapping[str, Any]) -> str:
    if isinstance(cfg.get("_name_or_path"), str) and cfg["_name_or_path"]:
        return cfg["_name_or_path"]
    if config_path.name == "config.json":
        return config_path.parent.name or "model"
    stem = config_path.name.removesuffix(".json").removesuffix("_config")
    return stem.replace("--", "/")


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a HF ``config.json`` (a file or a directory holding one) into a ``ModelSpec``.

    A ModelOpt ``hf_quant_config.json`` next to it (see ``_quant_sibling``) supplies the
    weight and KV-cache formats; without one, ``quantization_config`` inside the config does.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ModelConfigError(str(p), "no such file; pass a config.json, a directory holding one, or a preset name")
    if p.name.endswith("hf_quant_config.json"):
        raise ModelConfigError(str(p), "this is a quantisation config; pass the config.json beside it")
    cfg = _read_json(p)
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(str(p), "top level is not a JSON object")
    qpath = _quant_sibling(p)
    quant = None
    if qpath.exists():
        quant = _read_json(qpath)
        if not isinstance(quant, Mapping):
            raise ModelConfigError(str(qpath), "top level is not a JSON object")
    return spec_from_config(cfg, name=_name_from_path(p, cfg), source=str(p), quant_config=quant)


# --------------------------------------------------------------------------- presets
@dataclass(frozen=True, slots=True)
class _Preset:
    key: str
    file: str
    aliases: tuple[str, ...]


#: Preset name -> config file in servescope/data/model-configs/ (copies of shared/model-configs/).
_PRESETS: tuple[_Preset, ...] = (
    _Preset("glm-5", "zai-org--GLM-5_config.json", ("glm5", "zai-org/GLM-5")),
    _Preset("glm-5-fp8", "zai-org--GLM-5-FP8_config.json", ("glm5-fp8", "zai-org/GLM-5-FP8")),
    _Preset("glm-5-nvfp4", "nvidia--GLM-5-NVFP4_config.json", ("glm5-nvfp4", "nvidia/GLM-5-NVFP4")),
    _Preset("deepseek-v3", "deepseek-ai--DeepSeek-V3_config.json", ("deepseek-v3-fp8", "deepseek-ai/DeepSeek-V3")),
    _Preset("deepseek-r1", "deepseek-ai--DeepSeek-R1_config.json", ("deepseek-r1-fp8", "deepseek-ai/DeepSeek-R1")),
    _Preset("deepseek-v3.1-nvfp4", "nvidia--DeepSeek-V3.1-NVFP4_config.json", ("nvidia/DeepSeek-V3.1-NVFP4",)),
    _Preset("kimi-k2", "moonshotai--Kimi-K2-Instruct_config.json", ("kimi-k2-instruct", "moonshotai/Kimi-K2-Instruct")),
    _Preset("qwen3-235b-a22b", "Qwen--Qwen3-235B-A22B_config.json", ("qwen3-235b", "Qwen/Qwen3-235B-A22B")),
    _Preset("qwen3-235b-a22b-fp8", "Qwen--Qwen3-235B-A22B-FP8_config.json", ("Qwen/Qwen3-235B-A22B-FP8",)),
    _Preset("qwen3-235b-a22b-nvfp4", "nvidia--Qwen3-235B-A22B-NVFP4_config.json", ("nvidia/Qwen3-235B-A22B-NVFP4",)),
    _Preset("qwen3-30b-a3b", "Qwen--Qwen3-30B-A3B_config.json", ("qwen3-30b", "Qwen/Qwen3-30B-A3B")),
    _Preset("qwen3-8b", "Qwen--Qwen3-8B_config.json", ("Qwen/Qwen3-8B",)),
    _Preset("qwen3.5-397b-a17b", "Qwen--Qwen3.5-397B-A17B_config.json", ("qwen3.5-397b", "Qwen/Qwen3.5-397B-A17B")),
    _Preset("gpt-oss-120b", "openai--gpt-oss-120b_config.json", ("gptoss-120b", "openai/gpt-oss-120b")),
    _Preset("gpt-oss-20b", "openai--gpt-oss-20b_config.json", ("gptoss-20b", "openai/gpt-oss-20b")),
    _Preset("mixtral-8x7b", "mistralai--Mixtral-8x7B-v0.1_config.json", ("mistralai/Mixtral-8x7B-v0.1",)),
    _Preset("mixtral-8x22b", "mistralai--Mixtral-8x22B-v0.1_config.json", ("mistralai/Mixtral-8x22B-v0.1",)),
    _Preset(
        "llama-4-scout",
        "meta-llama--Llama-4-Scout-17B-16E-Instruct_config.json",
        ("llama4-scout", "meta-llama/Llama-4-Scout-17B-16E-Instruct"),
    ),
    _Preset(
        "llama-4-maverick",
        "meta-llama--Llama-4-Maverick-17B-128E-Instruct_config.json",
        ("llama4-maverick", "meta-llama/Llama-4-Maverick-17B-128E-Instruct"),
    ),
    _Preset(
        "llama-3.1-8b", "meta-llama--Meta-Llama-3.1-8B_config.json", ("llama3.1-8b", "meta-llama/Meta-Llama-3.1-8B")
    ),
    _Preset(
        "llama-3.1-70b", "meta-llama--Meta-Llama-3.1-70B_config.json", ("llama3.1-70b", "meta-llama/Meta-Llama-3.1-70B")
    ),
    _Preset("minimax-m2.5", "MiniMaxAI--MiniMax-M2.5_config.json", ("MiniMaxAI/MiniMax-M2.5",)),
    _Preset(
        "nemotron-3-nano-30b-a3b",
        "nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16_config.json",
        ("nemotron-3-nano", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"),
    ),
)


def _norm(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _load_preset(preset: _Preset) -> ModelSpec:
    base = resources.files("servescope") / "data" / "model-configs"
    cfg_res = base / preset.file
    source = f"servescope/data/model-configs/{preset.file}"
    try:
        cfg = json.loads(cfg_res.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:  # a broken install, not a user error
        raise ModelConfigError(source, f"packaged preset unreadable ({err}); reinstall servescope") from err
    quant = None
    qname = preset.file[: -len("config.json")] + "hf_quant_config.json"
    q_res = base / qname
    if q_res.is_file():
        quant = json.loads(q_res.read_text(encoding="utf-8"))
    return spec_from_config(cfg, name=preset.key, source=source, quant_config=quant, aliases=preset.aliases)


def preset_names() -> list[str]:
    """Every preset key (what ``servescope models`` lists)."""
    return [p.key for p in _PRESETS]


def list_models() -> list[ModelSpec]:
    """Every preset, loaded from its packaged config."""
    return [_load_preset(p) for p in _PRESETS]


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name or alias (incl. HF repo ids), or a config.json / checkpoint directory by path."""
    key = _norm(name_or_path)
    for p in _PRESETS:
        if key == p.key or key in (_norm(a) for a in p.aliases):
            return _load_preset(p)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return load_hf_config(path)
    if name_or_path.endswith(".json") or name_or_path.startswith((".", "/", "~")):
        raise ModelConfigError(name_or_path, "no such file; pass a config.json, a directory holding one, or a preset")
    labels: dict[str, str] = {}
    for p in _PRESETS:
        for label in (p.key, *p.aliases):
            labels.setdefault(_norm(label), p.key)
    close = difflib.get_close_matches(key, list(labels), n=6, cutoff=0.5)
    raise UnknownNameError("model", name_or_path, list(dict.fromkeys(labels[c] for c in close))[:3])
