"""Decode-step roofline for MoE (and dense) models: per GEMM, per step, per concurrency.

Why: the question "why does throughput plateau below what the GPUs can do" starts with
arithmetic. At concurrency C a decode step pushes C tokens through every layer; each
expert GEMM then sees only ~C*k/E rows, its weights (read once per step) dominate its
memory traffic, and its arithmetic intensity (~2*M / bytes-per-weight) sits far under
the GPU's ridge point. This module does that arithmetic exactly, for every GEMM of the
step, with weights in their real formats (block scales included), and adds the KV-cache
traffic and the tensor-parallel collectives, giving a step time, the bound that
dominates and an upper bound on output tokens/s. ``docs/roofline.md`` gives every
formula term by term with its source.

Parallelism modelled (sglang's and vLLM's default for ``--tp T --ep E``): attention,
dense MLP, shared experts and lm_head are tensor-parallel over the T GPUs, and every GPU
sees all C tokens; the routed experts are split ``ep`` ways by expert and ``T/ep`` ways
by width; after attention and after the FFN the partial sums are all-reduced (ring:
2(T-1)/T of the activation bytes per GPU). Data-parallel attention with all-to-all
expert dispatch (DeepEP) is NOT modelled.

Model of time: each op runs alone at ``max(flops / (peak * efficiency), bytes / bandwidth)``
(no overlap between kernels, no launch overheads), collectives at
``bytes / link_bandwidth``; the step is the sum. The MoE part is evaluated per sampled
routing for every EP rank, and the step waits for the slowest rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from servescope import routing as routing_mod
from servescope.errors import ConfigError
from servescope.hardware import GpuSpec, get_gpu
from servescope.models import ModelSpec, WeightFormats, get_format, get_model

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: Activations leave every GEMM in BF16 (what the next op or the all-reduce reads).
OUT_BYTES = 2.0
#: Efficiency callable: (compute dtype, tokens per expert) -> fraction in (0, 1] of the ideal attainable rate.
Efficiency = Callable[[str, float], float]

_QUANT_DTYPES = ("nvfp4", "mxfp4", "fp6", "fp8")


@dataclass(frozen=True, slots=True)
class Op:
    """One kernel class of a decode step on ONE GPU, summed over its repeats in the step.

    For GEMMs ``m``, ``n``, ``k`` are the shape of one instance ([m, k] x [k, n]) and
    ``count`` how many instances run per step (layers x experts x heads); ``flops`` and
    ``bytes`` are totals over all instances. ``time_us`` includes ``efficiency``.
    """

    name: str
    kind: str  # "gemm" | "attention" | "state" | "comm"
    group: str
    m: float | None
    n: int | None
    k: int | None
    count: float
    dtype: str
    weight_format: str | None
    flops: float
    bytes: float
    weight_bytes: float
    peak_flops: float
    bandwidth_bytes_s: float
    efficiency: float
    time_us: float

    @property
    def intensity(self) -> float:
        """FLOP per byte of memory (or link) traffic."""
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def weight_intensity(self) -> float:
        """FLOP per byte of WEIGHT traffic only (the back-of-envelope figure)."""
        return self.flops / self.weight_bytes if self.weight_bytes else math.inf

    @property
    def ridge(self) -> float:
        return self.peak_flops / self.bandwidth_bytes_s if self.bandwidth_bytes_s else math.inf

    @property
    def bound(self) -> str:
        if self.kind == "comm":
            return "communication"
        return "compute" if self.intensity >= self.ridge else "memory"

    @property
    def attainable_tflops(self) -> float:
        """min(peak, intensity x bandwidth) x efficiency, in TFLOP/s."""
        ideal = min(self.peak_flops, self.intensity * self.bandwidth_bytes_s) if self.peak_flops else 0.0
        return ideal * self.efficiency / 1e12

    @property
    def pct_of_peak(self) -> float:
        return 100.0 * self.attainable_tflops * 1e12 / self.peak_flops if self.peak_flops else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "group": self.group,
            "m": self.m,
            "n": self.n,
            "k": self.k,
            "count": self.count,
            "dtype": self.dtype,
            "weight_format": self.weight_format,
            "flops": self.flops,
            "bytes": self.bytes,
            "weight_bytes": self.weight_bytes,
            "intensity": _finite(self.intensity),
            "weight_intensity": _finite(self.weight_intensity),
            "ridge": _finite(self.ridge),
            "bound": self.bound,
            "attainable_tflops": self.attainable_tflops,
            "pct_of_peak": self.pct_of_peak,
            "efficiency": self.efficiency,
            "time_us": self.time_us,
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """The roofline of one decode step at one concurrency, per GPU of the TP group."""

    model: str
    gpu: str
    dtype: str
    tp: int
    ep: int
    concurrency: int
    context_len: int
    routing: routing_mod.RoutingStats | None
    ops: tuple[Op, ...]
    link_bandwidth_bytes_s: float | None
    memory_needed_bytes: float
    memory_bytes: float | None
    warnings: tuple[str, ...] = ()

    # -- totals
    @property
    def step_time_us(self) -> float:
        return sum(o.time_us for o in self.ops)

    @property
    def comm_time_us(self) -> float:
        return sum(o.time_us for o in self.ops if o.kind == "comm")

    @property
    def memory_time_us(self) -> float:
        """Time if every byte moved at full bandwidth and compute were free."""
        return sum(o.bytes / o.bandwidth_bytes_s * 1e6 for o in self.ops if o.kind != "comm")

    @property
    def compute_time_us(self) -> float:
        """Time if every FLOP ran at (efficiency x) peak and memory were free."""
        return sum(o.flops / (o.peak_flops * o.efficiency) * 1e6 for o in self.ops if o.kind != "comm" and o.peak_flops)

    @property
    def bound(self) -> str:
        """ "compute" when compute-bound ops take more of the step than memory-bound ones."""
        mem = sum(o.time_us for o in self.ops if o.bound == "memory")
        comp = sum(o.time_us for o in self.ops if o.bound == "compute")
        return "compute" if comp > mem else "memory"

    @property
    def dominant_term(self) -> str:
        """The op name taking the largest share of the step time."""
        return max(self.ops, key=lambda o: o.time_us).name if self.ops else ""

    @property
    def tok_s_upper_bound(self) -> float:
        """Output tokens/s of the whole TP group: C tokens per step."""
        return self.concurrency / (self.step_time_us * 1e-6) if self.step_time_us > 0 else math.inf

    @property
    def tokens_per_expert_mean(self) -> float | None:
        return self.routing.tokens_per_expert_mean if self.routing else None

    @property
    def tokens_per_expert_max(self) -> float | None:
        return self.routing.tokens_per_expert_max if self.routing else None

    @property
    def gemms(self) -> tuple[Op, ...]:
        return tuple(o for o in self.ops if o.kind == "gemm")

    @property
    def fits_in_memory(self) -> bool | None:
        return None if self.memory_bytes is None else self.memory_needed_bytes <= self.memory_bytes

    def to_dict(self) -> dict[str, object]:
        total_flops = sum(o.flops for o in self.ops if o.kind != "comm")
        total_bytes = sum(o.bytes for o in self.ops if o.kind != "comm")
        return {
            "model": self.model,
            "gpu": self.gpu,
            "dtype": self.dtype,
            "tp": self.tp,
            "ep": self.ep,
            "concurrency": self.concurrency,
            "context_len": self.context_len,
            "routing": self.routing.to_dict() if self.routing else None,
            "tokens_per_expert_mean": self.tokens_per_expert_mean,
            "tokens_per_expert_max": self.tokens_per_expert_max,
            "step_time_us": self.step_time_us,
            "memory_time_us": self.memory_time_us,
            "compute_time_us": self.compute_time_us,
            "comm_time_us": self.comm_time_us,
            "bound": self.bound,
            "dominant_term": self.dominant_term,
            "tok_s_upper_bound": self.tok_s_upper_bound,
            "flops_per_step": total_flops,
            "bytes_per_step": total_bytes,
            "weight_bytes_per_step": sum(o.weight_bytes for o in self.ops),
            "kv_bytes_per_step": sum(o.bytes for o in self.ops if o.kind == "attention"),
            "comm_bytes_per_step": sum(o.bytes for o in self.ops if o.kind == "comm"),
            "link_bandwidth_bytes_s": self.link_bandwidth_bytes_s,
            "memory_needed_bytes": self.memory_needed_bytes,
            "memory_bytes": self.memory_bytes,
            "fits_in_memory": self.fits_in_memory,
            "gemms": [o.to_dict() for o in self.ops if o.kind == "gemm"],
            "ops": [o.to_dict() for o in self.ops if o.kind != "gemm"],
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- helpers
@dataclass(slots=True)
class _Ctx:
    gpu: GpuSpec
    formats: WeightFormats
    warnings: list[str] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    fallback_noted: set[str] = field(default_factory=set)

    def compute_of(self, fmt_name: str) -> tuple[str, float, float]:
        """(compute dtype, weight bytes/elem, activation bytes/elem) for a weight format on this GPU.

        Quantised formats run W and A in the same format (ModelOpt NVFP4 / FP8 recipes are
        W4A4 / W8A8). A GPU without tensor cores for the format runs it weight-only: the
        weights are read at their stored size, dequantised, and multiplied in BF16 (Marlin-style).
        """
        fmt = get_format(fmt_name)
        dtype = fmt.compute_dtype
        if self.gpu.peak_flops(dtype) is None and dtype != "bf16":
            if fmt_name not in self.fallback_noted:
                self.fallback_noted.add(fmt_name)
                self.warnings.append(
                    f"{self.gpu.key} has no {dtype} tensor-core figure: {fmt_name} weights modelled as weight-only "
                    "(dequantised to bf16, activations bf16)"
                )
            return "bf16", fmt.bytes_per_elem, 2.0
        act = fmt.bytes_per_elem if dtype in _QUANT_DTYPES else 2.0
        return dtype, fmt.bytes_per_elem, act

    def peak(self, dtype: str) -> float:
        p = self.gpu.peak_flops(dtype)
        if p is None:
            raise ConfigError(f"{self.gpu.key} has no {dtype} peak in the catalog; the roofline cannot be computed")
        return p


def _time_us(flops: float, bytes_: float, peak: float, bw: float, eff: float) -> float:
    return max(flops / (peak * eff), bytes_ / bw) * 1e6


def _gemm(
    ctx: _Ctx, name: str, group: str, fmt_name: str, m: float, n: int, k: int, count: float, eff: float = 1.0
) -> None:
    if count <= 0 or m <= 0:
        return
    dtype, w_b, a_b = ctx.compute_of(fmt_name)
    flops = 2.0 * m * n * k * count
    weight_bytes = n * k * w_b * count
    act_bytes = (m * k * a_b + m * n * OUT_BYTES) * count
    peak, bw = ctx.peak(dtype), float(ctx.gpu.memory_bandwidth_bytes_s or 0)
    ctx.ops.append(
        Op(
            name,
            "gemm",
            group,
            m,
            n,
            k,
            count,
            dtype,
            fmt_name,
            flops,
            weight_bytes + act_bytes,
            weight_bytes,
            peak,
            bw,
            eff,
            _time_us(flops, weight_bytes + act_bytes, peak, bw, eff),
        )
    )


def gemm(
    gpu: GpuSpec | str,
    *,
    m: float,
    n: int,
    k: int,
    weight_format: str,
    count: float = 1,
    efficiency: float = 1.0,
    name: str = "gemm",
) -> Op:
    """The roofline of one GEMM shape, [m, k] x [k, n] with weights in ``weight_format``, on ``gpu``.

    The building block of ``decode_point``, public so that kernel probes and tile maths can
    quote the same intensity, ridge and attainable rate for a measured shape.
    """
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not g.memory_bandwidth_bytes_s:
        raise ConfigError(f"{g.key} has no memory bandwidth in the catalog; the roofline needs one")
    for label, v in (("m", m), ("n", n), ("k", k), ("count", count)):
        if not v > 0:
            raise ConfigError(f"GEMM {label} must be positive, got {v!r}")
    if not 0.0 < efficiency <= 1.0:
        raise ConfigError(f"efficiency must be in (0, 1], got {efficiency!r}")
    ctx = _Ctx(gpu=g, formats=WeightFormats())
    _gemm(ctx, name, "gemm", get_format(weight_format).name, m, n, k, count, efficiency)
    return ctx.ops[0]


def _stream_op(ctx: _Ctx, name: str, kind: str, group: str, flops: float, bytes_: float, dtype: str = "bf16") -> None:
    if bytes_ <= 0 and flops <= 0:
        return
    peak, bw = ctx.peak(dtype), float(ctx.gpu.memory_bandwidth_bytes_s or 0)
    ctx.ops.append(
        Op(
            name,
            kind,
            group,
            None,
            None,
            None,
            1,
            dtype,
            None,
            flops,
            bytes_,
            0.0,
            peak,
            bw,
            1.0,
            _time_us(flops, bytes_, peak, bw, 1.0),
        )
    )


def _comm_op(ctx: _Ctx, name: str, bytes_: float, link_bw: float | None) -> None:
    if bytes_ <= 0:
        return
    time_us = bytes_ / link_bw * 1e6 if link_bw else 0.0
    ctx.ops.append(
        Op(
            name,
            "comm",
            "communication",
            None,
            None,
            None,
            1,
            "bf16",
            None,
            0.0,
            bytes_,
            0.0,
            0.0,
            float(link_bw or 0.0),
            1.0,
            time_us,
        )
    )


def _pos(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _resolve(model: ModelSpec | str, gpu: GpuSpec | str) -> tuple[ModelSpec, GpuSpec]:
    m = get_model(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not g.memory_bandwidth_bytes_s:
        raise ConfigError(f"{g.key} has no memory bandwidth in the catalog; the roofline needs one")
    return m, g


def effective_formats(model: ModelSpec, dtype: str | None, kv_dtype: str | None = None) -> WeightFormats:
    """The model's weight formats with ``dtype`` applied to the MLP-side weights.

    ``dtype`` (e.g. "nvfp4") replaces the format of the routed experts, the shared experts
    and the dense MLP layers, the weights NVFP4/FP8 checkpoints quantise; attention,
    router and lm_head keep the model's formats (NVIDIA's GLM-5-NVFP4 keeps them BF16).
    """
    f = model.weights
    mlp = get_format(dtype).name if dtype else None
    kv = get_format(kv_dtype).name if kv_dtype else f.kv_cache
    return WeightFormats(
        experts=mlp or f.experts,
        shared_experts=mlp or f.shared_experts,
        dense_mlp=mlp or f.dense_mlp,
        attention=f.attention,
        attention_out=f.attention_out,
        indexer=f.indexer,
        router=f.router,
        lm_head=f.lm_head,
        kv_cache=kv,
        linear_mixer=f.linear_mixer,
    )


def check_parallelism(model: ModelSpec, tp: int, ep: int) -> None:
    """Reject tp/ep combinations the engines cannot run, naming the fix."""
    _pos("tp", tp)
    _pos("ep", ep)
    if tp % ep:
        raise ConfigError(f"--ep {ep} must divide --tp {tp} (the MoE runs ep-way by expert x tp/ep-way by width)")
    if ep > 1 and not model.is_moe:
        raise ConfigError(f"--ep {ep} given but {model.name} has no MoE layers; drop --ep")
    if model.is_moe and model.n_routed_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide the {model.n_routed_experts} experts of {model.name}")
    moe_tp = tp // ep
    if model.is_moe and model.moe_intermediate_size and model.moe_intermediate_size % moe_tp:
        raise ConfigError(
            f"expert width {model.moe_intermediate_size} of {model.name} is not divisible by tp/ep = {moe_tp}"
        )
    att = model.attention
    if att is not None and att.num_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide the {att.num_heads} attention heads of {model.name}")
    if model.intermediate_size and model.dense_layers and model.intermediate_size % tp:
        raise ConfigError(f"dense MLP width {model.intermediate_size} of {model.name} is not divisible by --tp {tp}")


# --------------------------------------------------------------------------- the step
def _attention_ops(ctx: _Ctx, model: ModelSpec, tp: int, b: int, ctx_len: int) -> None:
    att = model.attention
    if att is None:
        return
    f = ctx.formats
    h = model.hidden_size
    kv_fmt = get_format(f.kv_cache)
    layers = model.attention_layers
    n_full = sum(1 for i in layers if model.layer_mixers[i] == "attention")
    n_swa = len(layers) - n_full
    heads = att.num_heads // tp
    n_layers = len(layers)
    if att.kind == "mla":
        nope, rope, v = att.qk_nope_head_dim or 0, att.qk_rope_head_dim or 0, att.v_head_dim or 0
        lora = att.kv_lora_rank or 0
        if att.q_lora_rank:
            # fused_qkv_a_proj_with_mqa in sglang: replicated on every TP rank.
            _gemm(ctx, "attn.qkv_a_proj", "attention", f.attention, b, att.q_lora_rank + lora + rope, h, n_layers)
            _gemm(ctx, "attn.q_b_proj", "attention", f.attention, b, heads * (nope + rope), att.q_lora_rank, n_layers)
        else:
            _gemm(ctx, "attn.kv_a_proj", "attention", f.attention, b, lora + rope, h, n_layers)
            _gemm(ctx, "attn.q_proj", "attention", f.attention, b, heads * (nope + rope), h, n_layers)
        # Weight absorption at decode: kv_b_proj split into W_UK (q_nope -> latent) and W_UV (latent -> v), per head.
        _gemm(ctx, "attn.w_uk_absorb", "attention", f.attention, b, lora, nope, n_layers * heads)
        _gemm(ctx, "attn.w_uv_absorb", "attention", f.attention, b, v, lora, n_layers * heads)
        _gemm(ctx, "attn.o_proj", "attention_out", f.attention_out, b, h, heads * v, n_layers)
        attended = min(ctx_len, att.indexer_topk) if att.indexer_topk else ctx_len
        # Latent cache (kv_lora + rope per token) is one "head", replicated on every TP rank.
        kv_bytes = b * attended * (lora + rope) * kv_fmt.bytes_per_elem * n_layers
        flops = b * heads * attended * 2.0 * ((lora + rope) + lora) * n_layers
        _stream_op(ctx, "attn.mla_decode", "attention", "kv_cache", flops, kv_bytes)
        if att.indexer_heads and att.indexer_head_dim:
            q_in = att.q_lora_rank or h
            ih, idim = att.indexer_heads, att.indexer_head_dim
            _gemm(ctx, "indexer.wq_b", "indexer", f.indexer, b, ih * idim, q_in, n_layers)
            _gemm(ctx, "indexer.wk", "indexer", f.indexer, b, idim, h, n_layers)
            _gemm(ctx, "indexer.weights_proj", "indexer", f.indexer, b, ih, h, n_layers)
            # The indexer scores EVERY cached token (FP8 keys + one fp32 scale per 128 in sglang's DSA).
            idx_bytes = b * ctx_len * idim * (1.0 + 4.0 / 128) * n_layers
            idx_flops = b * ctx_len * 2.0 * ih * idim * n_layers
            _stream_op(ctx, "indexer.score", "attention", "kv_cache", idx_flops, idx_bytes)
        return
    hd = att.head_dim
    kv_heads = math.ceil(att.num_kv_heads / tp)  # replicated when fewer KV heads than ranks
    q_width = heads * hd * (2 if att.output_gate else 1)
    _gemm(ctx, "attn.qkv_proj", "attention", f.attention, b, q_width + 2 * kv_heads * hd, h, n_layers)
    _gemm(ctx, "attn.o_proj", "attention_out", f.attention_out, b, h, heads * hd, n_layers)
    window = att.sliding_window or ctx_len
    for label, count, span in (("attn.gqa_decode", n_full, ctx_len), ("attn.swa_decode", n_swa, min(ctx_len, window))):
        if count:
            kv_bytes = b * span * 2 * kv_heads * hd * kv_fmt.bytes_per_elem * count
            flops = b * heads * span * 4.0 * hd * count
            _stream_op(ctx, label, "attention", "kv_cache", flops, kv_bytes)


def _linear_mixer_ops(ctx: _Ctx, model: ModelSpec, tp: int, b: int) -> None:
    lm = model.linear_mixer
    layers = model.linear_mixer_layers
    if lm is None or not layers:
        return
    n = len(layers)
    _gemm(
        ctx,
        "mixer.in_proj",
        "linear_mixer",
        ctx.formats.linear_mixer,
        b,
        math.ceil(lm.in_proj_size / tp),
        model.hidden_size,
        n,
    )
    _gemm(
        ctx,
        "mixer.out_proj",
        "linear_mixer",
        ctx.formats.linear_mixer,
        b,
        model.hidden_size,
        math.ceil(lm.out_proj_in / tp),
        n,
    )
    s_b = get_format(lm.state_format).bytes_per_elem
    # Each step reads and writes each sequence's recurrent state (fp32) and conv state (bf16).
    state_bytes = b * n * 2.0 * (lm.state_elems / tp * s_b + lm.conv_state_elems / tp * 2.0)
    flops = b * n * 4.0 * lm.state_elems / tp
    _stream_op(ctx, f"mixer.{lm.kind}_state", "state", "state", flops, state_bytes)


def _ffn_ops(ctx: _Ctx, model: ModelSpec, tp: int, b: int) -> None:
    f = ctx.formats
    h = model.hidden_size
    up_mats = 2 if model.gated_mlp else 1
    n_dense = len(model.dense_layers)
    if n_dense and model.intermediate_size:
        w = model.intermediate_size // tp
        _gemm(ctx, "mlp.gate_up", "dense_mlp", f.dense_mlp, b, up_mats * w, h, n_dense)
        _gemm(ctx, "mlp.down", "dense_mlp", f.dense_mlp, b, h, w, n_dense)
    n_moe = len(model.moe_layers)
    if n_moe:
        _gemm(ctx, "moe.router", "router", f.router, b, model.n_routed_experts, h, n_moe)
        if model.n_shared_experts and model.shared_expert_intermediate_size:
            w = model.n_shared_experts * model.shared_expert_intermediate_size // tp
            _gemm(ctx, "shared.gate_up", "shared_experts", f.shared_experts, b, up_mats * w, h, n_moe)
            _gemm(ctx, "shared.down", "shared_experts", f.shared_experts, b, h, w, n_moe)


def _expert_ops(
    ctx: _Ctx,
    model: ModelSpec,
    tp: int,
    ep: int,
    samples: routing_mod.LoadSamples,
    efficiency: Efficiency | None,
    fused_gate_up: bool,
) -> None:
    """Routed experts on the straggler EP rank, evaluated per sampled routing.

    A rank with A active experts and T routed tokens runs, per MoE layer, a grouped GEMM
    reading A experts' weights once and T rows of activations. Per trial the rank with
    the longest expert time sets the step; the reported shape and totals are the
    expectation of that straggler over trials.
    """
    n_moe = len(model.moe_layers)
    h = model.hidden_size
    width = (model.moe_intermediate_size or 0) // (tp // ep)
    dtype, w_b, a_b = ctx.compute_of(ctx.formats.experts)
    peak, bw = ctx.peak(dtype), float(ctx.gpu.memory_bandwidth_bytes_s or 0)
    up_mats = 2 if model.gated_mlp else 1
    if fused_gate_up or up_mats == 1:
        shapes = [("experts.gate_up" if up_mats == 2 else "experts.up", up_mats * width, h)]
    else:
        shapes = [("experts.gate", width, h), ("experts.up", width, h)]
    shapes.append(("experts.down", h, width))

    active = samples.active_experts.astype(np.float64)
    tokens = samples.tokens.astype(np.float64)
    m = np.where(active > 0, tokens / np.maximum(active, 1), 0.0)
    if efficiency is None:
        eff = np.ones_like(m)
    else:
        eff = np.vectorize(lambda x: _checked_eff(efficiency, dtype, float(x)) if x > 0 else 1.0, otypes=[float])(m)

    def parts(n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        flops = 2.0 * tokens * n * k * n_moe
        wbytes = active * n * k * w_b * n_moe
        abytes = (tokens * k * a_b + tokens * n * OUT_BYTES) * n_moe
        time = np.maximum(flops / (peak * eff), (wbytes + abytes) / bw) * 1e6
        return flops, wbytes, abytes, time

    per_shape = [parts(n, k) for _, n, k in shapes]
    total_time = sum(p[3] for p in per_shape)  # (trials, ep)
    straggler = np.argmax(total_time, axis=1)  # per trial
    rows = np.arange(total_time.shape[0])
    for (name, n, k), (flops, wbytes, abytes, time) in zip(shapes, per_shape, strict=True):
        a_s = float(active[rows, straggler].mean())
        ctx.ops.append(
            Op(
                name=name,
                kind="gemm",
                group="experts",
                m=float(m[rows, straggler].mean()),
                n=n,
                k=k,
                count=a_s * n_moe,
                dtype=dtype,
                weight_format=ctx.formats.experts,
                flops=float(flops[rows, straggler].mean()),
                bytes=float((wbytes + abytes)[rows, straggler].mean()),
                weight_bytes=float(wbytes[rows, straggler].mean()),
                peak_flops=peak,
                bandwidth_bytes_s=bw,
                efficiency=float(eff[rows, straggler].mean()),
                time_us=float(time[rows, straggler].mean()),
            )
        )


def _checked_eff(efficiency: Efficiency, dtype: str, m: float) -> float:
    value = float(efficiency(dtype, m))
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ConfigError(f"calibration gave efficiency {value!r} for {dtype} at {m:g} tokens/expert; need (0, 1]")
    return value


def _memory_needed(model: ModelSpec, formats: WeightFormats, tp: int, b: int, ctx_len: int) -> float:
    """Weights held per GPU (all experts of its shard, not just active ones) + KV cache for b x ctx_len."""
    params = model.param_breakdown()
    groups = {
        "attention": formats.attention,
        "attention_out": formats.attention_out,
        "indexer": formats.indexer,
        "linear_mixer": formats.linear_mixer,
        "dense_mlp": formats.dense_mlp,
        "router": formats.router,
        "experts": formats.experts,
        "shared_experts": formats.shared_experts,
        "embedding": "bf16",
        "lm_head": formats.lm_head,
    }
    weights = sum(params[g] * get_format(fmt).bytes_per_elem for g, fmt in groups.items()) / tp
    kv = 0.0
    att = model.attention
    if att is not None:
        per_tok = att.kv_elems_per_token if att.kind == "mla" else 2 * math.ceil(att.num_kv_heads / tp) * att.head_dim
        per_tok_bytes = per_tok * get_format(formats.kv_cache).bytes_per_elem
        if att.indexer_head_dim:  # DSA keeps FP8 indexer keys (+ one fp32 scale per 128) beside the latent
            per_tok_bytes += att.indexer_head_dim * (1.0 + 4.0 / 128)
        kv = b * ctx_len * per_tok_bytes * len(model.attention_layers)
    return weights + kv


def decode_point(
    model: ModelSpec | str,
    gpu: GpuSpec | str,
    *,
    dtype: str | None,
    tp: int = 1,
    ep: int = 1,
    concurrency: int,
    context_len: int,
    routing: str = "balanced",
    link_bandwidth_bytes_s: float | None = None,
    efficiency: Efficiency | None = None,
    seed: int = 0,
    kv_dtype: str | None = None,
    fused_gate_up: bool = True,
    trials: int = routing_mod.DEFAULT_TRIALS,
) -> DecodePoint:
    """Roofline of one decode step with ``concurrency`` sequences of ``context_len`` cached tokens.

    ``dtype`` sets the MLP-side weight format (see ``effective_formats``; None keeps the
    model's). ``link_bandwidth_bytes_s`` defaults to the GPU's catalog interconnect.
    ``efficiency(dtype, tokens_per_expert)`` scales the expert GEMMs' attainable rate
    (measured by ``servescope kernels``).
    """
    m, g = _resolve(model, gpu)
    _pos("concurrency", concurrency)
    _pos("context_len", context_len)
    check_parallelism(m, tp, ep)
    formats = effective_formats(m, dtype, kv_dtype)
    ctx = _Ctx(gpu=g, formats=formats)
    link = link_bandwidth_bytes_s if link_bandwidth_bytes_s is not None else g.link_bandwidth_bytes_s
    if link_bandwidth_bytes_s is not None and link_bandwidth_bytes_s <= 0:
        raise ConfigError(f"link bandwidth must be positive, got {link_bandwidth_bytes_s!r}")
    b = concurrency

    _attention_ops(ctx, m, tp, b, context_len)
    _linear_mixer_ops(ctx, m, tp, b)
    _ffn_ops(ctx, m, tp, b)
    stats = None
    if m.is_moe:
        samples, method = routing_mod.sample_loads(b, m.top_k, m.n_routed_experts, ep, routing, seed, trials)
        stats = routing_mod.summarize(
            samples,
            method,
            batch_tokens=b,
            top_k=m.top_k,
            n_experts=m.n_routed_experts,
            ep=ep,
            routing=routing,
            seed=seed,
        )
        _expert_ops(ctx, m, tp, ep, samples, efficiency, fused_gate_up)
    _gemm(ctx, "lm_head", "lm_head", formats.lm_head, b, math.ceil(m.vocab_size / tp), m.hidden_size, 1)

    if tp > 1:
        # One all-reduce after each mixer and each FFN block of b x hidden BF16 activations; a ring
        # all-reduce sends (and receives) 2(tp-1)/tp of the buffer per GPU. The vocab-parallel logits
        # (BF16) are all-gathered once: (tp-1)/tp of b x vocab per GPU.
        one_allreduce = 2.0 * (tp - 1) / tp * b * m.hidden_size * OUT_BYTES
        n_reduce = sum(1 for x in m.layer_mixers if x != "none") + sum(1 for x in m.layer_ffns if x != "none")
        _comm_op(ctx, "comm.allreduce", one_allreduce * n_reduce, link)
        _comm_op(ctx, "comm.logits_allgather", (tp - 1) / tp * b * m.vocab_size * OUT_BYTES, link)
        if not link:
            ctx.warnings.append(f"no link bandwidth known for {g.key}: collectives are counted in bytes, not time")

    needed = _memory_needed(m, formats, tp, b, context_len)
    if g.memory_bytes is not None and needed > g.memory_bytes:
        ctx.warnings.append(
            f"needs {needed / 1e9:.0f} GB per GPU (weights + KV cache) but {g.key} has {g.memory_bytes / 1e9:.0f} GB"
        )
    return DecodePoint(
        model=m.name,
        gpu=g.key,
        dtype=dtype or formats.experts,
        tp=tp,
        ep=ep,
        concurrency=b,
        context_len=context_len,
        routing=stats,
        ops=tuple(ctx.ops),
        link_bandwidth_bytes_s=link,
        memory_needed_bytes=needed,
        memory_bytes=g.memory_bytes,
        warnings=tuple(ctx.warnings),
    )


def decode_sweep(
    model: ModelSpec | str,
    gpu: GpuSpec | str,
    *,
    dtype: str | None,
    concurrencies: Sequence[int],
    context_len: int,
    tp: int = 1,
    ep: int = 1,
    routing: str = "balanced",
    link_bandwidth_bytes_s: float | None = None,
    efficiency: Efficiency | None = None,
    seed: int = 0,
    kv_dtype: str | None = None,
    fused_gate_up: bool = True,
) -> list[DecodePoint]:
    """``decode_point`` at each concurrency (same seed at each, so points are reproducible)."""
    if not concurrencies:
        raise ConfigError("no concurrency given; pass e.g. --concurrency 256,512,1024")
    m, g = _resolve(model, gpu)
    return [
        decode_point(
            m,
            g,
            dtype=dtype,
            tp=tp,
            ep=ep,
            concurrency=c,
            context_len=context_len,
            routing=routing,
            link_bandwidth_bytes_s=link_bandwidth_bytes_s,
            efficiency=efficiency,
            seed=seed,
            kv_dtype=kv_dtype,
            fused_gate_up=fused_gate_up,
        )
        for c in concurrencies
    ]


def expert_ridge_tokens_per_expert(
    model: ModelSpec | str, gpu: GpuSpec | str, *, dtype: str | None, tp: int = 1, ep: int = 1
) -> float | None:
    """Tokens per expert at which the expert gate/up GEMM's intensity reaches the ridge point.

    AI(M) = 2MNK / (NK w + MK a + MN o) >= R  <=>  M >= R N K w / (2NK - R (K a + N o)).
    None when the GEMM can never get there (the activation traffic alone is above the ridge).
    """
    m, g = _resolve(model, gpu)
    if not m.is_moe:
        return None
    check_parallelism(m, tp, ep)
    ctx = _Ctx(gpu=g, formats=effective_formats(m, dtype))
    cdtype, w_b, a_b = ctx.compute_of(ctx.formats.experts)
    ridge = g.ridge_flops_per_byte(cdtype)
    if ridge is None:
        return None
    n = (2 if m.gated_mlp else 1) * (m.moe_intermediate_size or 0) // (tp // ep)
    k = m.hidden_size
    denom = 2.0 * n * k - ridge * (k * a_b + n * OUT_BYTES)
    return ridge * n * k * w_b / denom if denom > 0 else None


def compute_bound_concurrency(
    model: ModelSpec | str,
    gpu: GpuSpec | str,
    *,
    dtype: str | None,
    context_len: int,
    tp: int = 1,
    ep: int = 1,
    link_bandwidth_bytes_s: float | None = None,
    max_concurrency: int = 1 << 20,
    kv_dtype: str | None = None,
) -> int | None:
    """Smallest concurrency at which the whole decode step is compute-bound (balanced routing).

    Balanced routing makes the search deterministic and monotone; None when the step is
    still memory-bound at ``max_concurrency`` (e.g. KV-cache traffic grows as fast as FLOPs).
    """
    m, g = _resolve(model, gpu)

    def compute_bound(c: int) -> bool:
        p = decode_point(
            m,
            g,
            dtype=dtype,
            tp=tp,
            ep=ep,
            concurrency=c,
            context_len=context_len,
            routing="balanced",
            link_bandwidth_bytes_s=link_bandwidth_bytes_s,
            kv_dtype=kv_dtype,
        )
        return p.bound == "compute"

    lo, hi = 0, 1
    while not compute_bound(hi):
        lo, hi = hi, hi * 2
        if hi > max_concurrency:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if compute_bound(mid):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True, slots=True)
class RooflineSweep:
    """A sweep plus where it turns compute-bound: what ``servescope roofline --json`` prints."""

    points: tuple[DecodePoint, ...]
    compute_bound_concurrency: int | None
    expert_ridge_tokens_per_expert: float | None
    expert_ridge_concurrency: float | None

    def to_dict(self) -> dict[str, object]:
        return {
            "schema_version": SCHEMA_VERSION,
            "compute_bound_concurrency": self.compute_bound_concurrency,
            "expert_ridge_tokens_per_expert": self.expert_ridge_tokens_per_expert,
            "expert_ridge_concurrency": self.expert_ridge_concurrency,
            "points": [p.to_dict() for p in self.points],
        }


def build_sweep(
    model: ModelSpec | str,
    gpu: GpuSpec | str,
    *,
    dtype: str | None,
    concurrencies: Sequence[int],
    context_len: int,
    tp: int = 1,
    ep: int = 1,
    routing: str = "balanced",
    link_bandwidth_bytes_s: float | None = None,
    efficiency: Efficiency | None = None,
    seed: int = 0,
    kv_dtype: str | None = None,
) -> RooflineSweep:
    """``decode_sweep`` plus the concurrency where the step (and the expert GEMMs) turn compute-bound."""
    m, g = _resolve(model, gpu)
    points = decode_sweep(
        m,
        g,
        dtype=dtype,
        concurrencies=concurrencies,
        context_len=context_len,
        tp=tp,
        ep=ep,
        routing=routing,
        link_bandwidth_bytes_s=link_bandwidth_bytes_s,
        efficiency=efficiency,
        seed=seed,
        kv_dtype=kv_dtype,
    )
    crossing = compute_bound_concurrency(
        m,
        g,
        dtype=dtype,
        context_len=context_len,
        tp=tp,
        ep=ep,
        link_bandwidth_bytes_s=link_bandwidth_bytes_s,
        kv_dtype=kv_dtype,
    )
    ridge_m = expert_ridge_tokens_per_expert(m, g, dtype=dtype, tp=tp, ep=ep)
    ridge_c = ridge_m * m.n_routed_experts / m.top_k if ridge_m is not None and m.is_moe else None
    return RooflineSweep(tuple(points), crossing, ridge_m, ridge_c)
