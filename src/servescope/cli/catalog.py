"""``servescope gpus`` and ``servescope models [show NAME|PATH]``: print the catalogs.

Thin: the catalogs live in ``servescope.hardware`` and ``servescope.models``; this module
only formats them (a rich table, or JSON on stdout with ``--json``).
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from servescope import hardware, models

_JSON_OPT = typer.Option(False, "--json", help="Print JSON on stdout instead of a table.")


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:,.0f} GB"


def _print_json(obj: object) -> None:
    typer.echo(json.dumps(obj, indent=2))


def gpus_table(gpus: list[hardware.GpuSpec]) -> Table:
    t = Table(title="GPU catalog (dense TFLOP/s; '*' = unverified figure, '-' = unknown or unsupported)")
    for col in (
        "key",
        "arch",
        "SMs",
        "boost MHz",
        "FP4",
        "FP8",
        "BF16",
        "TF32",
        "memory",
        "BW TB/s",
        "L2 MB",
        "smem/block",
        "TDP W",
        "FP4 ridge",
    ):
        t.add_column(col, justify="left" if col in ("key", "arch", "memory") else "right")
    for g in gpus:

        def mark(field: str, text: str, g: hardware.GpuSpec = g) -> str:
            return text + ("*" if field in g.unverified or field.split(".")[0] in g.unverified else "")

        tf = g.dense_tflops
        ridge = g.ridge_flops_per_byte("nvfp4") if tf.get("nvfp4") else None
        t.add_row(
            g.key,
            g.arch,
            mark("sm_count", _num(g.sm_count)),
            mark("boost_clock_mhz", _num(g.boost_clock_mhz)),
            mark("dense_tflops.nvfp4", _num(tf.get("nvfp4"))),
            mark("dense_tflops.fp8", _num(tf.get("fp8"))),
            mark("dense_tflops.bf16", _num(tf.get("bf16"))),
            mark("dense_tflops.tf32", _num(tf.get("tf32"))),
            mark("memory_bytes", f"{_gb(g.memory_bytes)} {g.memory_type or ''}".strip()),
            _num(g.memory_bandwidth_bytes_s and g.memory_bandwidth_bytes_s / 1e12, "{:.3g}"),
            mark("l2_bytes", _num(g.l2_bytes and g.l2_bytes / 1e6)),
            _num(g.smem_per_block_bytes),
            _num(g.tdp_w),
            _num(ridge),
        )
    return t


def models_table(specs: list[models.ModelSpec]) -> Table:
    t = Table(title="Model presets (servescope models show NAME for details)")
    for col in (
        "name",
        "layers (moe)",
        "hidden",
        "experts",
        "top-k",
        "expert width",
        "shared",
        "attention",
        "params",
        "active",
        "experts fmt",
        "kv",
    ):
        t.add_column(col, justify="left" if col in ("name", "attention", "experts fmt", "kv") else "right")
    for m in specs:
        shared = f"{m.n_shared_experts}x{m.shared_expert_intermediate_size}" if m.n_shared_experts else "-"
        att = m.attention_kind or "-"
        if m.linear_mixer_layers and m.linear_mixer:
            att += f"+{m.linear_mixer.kind}"
        t.add_row(
            m.name,
            f"{m.num_layers} ({len(m.moe_layers)})",
            _num(m.hidden_size),
            _num(m.n_routed_experts) if m.is_moe else "-",
            _num(m.top_k) if m.is_moe else "-",
            _num(m.moe_intermediate_size),
            shared,
            att,
            f"{m.total_params() / 1e9:,.1f}B",
            f"{m.active_params_per_token() / 1e9:,.1f}B",
            m.weights.experts if m.is_moe else m.weights.dense_mlp,
            m.weights.kv_cache,
        )
    return t


def _ranges(idx: tuple[int, ...]) -> str:
    """Compress layer indices: (0,1,2,5) -> '0-2,5'."""
    if not idx:
        return "none"
    out, start, prev = [], idx[0], idx[0]
    for i in (*idx[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def model_details(m: models.ModelSpec) -> Table:
    t = Table(title=f"{m.name}  ({m.source})", show_header=False)
    t.add_column("field")
    t.add_column("value")
    rows: list[tuple[str, str]] = [
        ("model_type", m.model_type),
        ("layers", str(m.num_layers)),
        ("moe layers", _ranges(m.moe_layers)),
        ("dense layers", _ranges(m.dense_layers)),
        ("hidden_size", str(m.hidden_size)),
        ("dense intermediate", _num(m.intermediate_size)),
        ("routed experts x width", f"{m.n_routed_experts} x {m.moe_intermediate_size}" if m.is_moe else "-"),
        ("top-k", str(m.top_k) if m.is_moe else "-"),
        (
            "shared experts",
            f"{m.n_shared_experts} x {m.shared_expert_intermediate_size}" if m.n_shared_experts else "0",
        ),
        ("gated MLP (SwiGLU)", str(m.gated_mlp)),
        ("vocab / tied", f"{m.vocab_size} / {m.tie_word_embeddings}"),
    ]
    a = m.attention
    if a is not None:
        if a.kind == "mla":
            desc = (
                f"MLA {a.num_heads} heads, q_lora {a.q_lora_rank}, kv_lora {a.kv_lora_rank}, "
                f"qk_nope {a.qk_nope_head_dim}, rope {a.qk_rope_head_dim}, v {a.v_head_dim}"
            )
            if a.indexer_heads:
                desc += f"; DSA indexer {a.indexer_heads}x{a.indexer_head_dim}, top {a.indexer_topk}"
        else:
            desc = f"GQA {a.num_heads}/{a.num_kv_heads} heads x {a.head_dim}"
            if a.output_gate:
                desc += ", output gate"
        rows.append(("attention", desc))
        rows.append(("attention layers", _ranges(m.attention_layers)))
        if m.sliding_window_layers:
            rows.append(("sliding-window layers", f"{_ranges(m.sliding_window_layers)} (window {a.sliding_window})"))
        rows.append(("KV per token per layer", f"{a.kv_elems_per_token} elements"))
    if m.linear_mixer is not None:
        rows.append(("linear mixer", f"{m.linear_mixer.kind} on layers {_ranges(m.linear_mixer_layers)}"))
    rows.append(("weight formats", ", ".join(f"{k}={v}" for k, v in m.weights.as_dict().items())))
    rows.append(
        ("params total / active", f"{m.total_params() / 1e9:,.2f}B / {m.active_params_per_token() / 1e9:,.2f}B")
    )
    rows.append(("weight bytes", f"{m.weight_bytes() / 1e9:,.1f} GB"))
    rows.extend(("note", n) for n in m.notes)
    for k, v in rows:
        t.add_row(k, v)
    return t


def register(app: typer.Typer) -> None:
    """Add ``gpus`` and ``models`` (with ``models show``) to the servescope app."""

    @app.command("gpus")
    def gpus(json_out: bool = _JSON_OPT) -> None:
        """List the GPU catalog: dense peaks per dtype, memory, bandwidth, smem, TDP (every figure sourced)."""
        specs = hardware.list_gpus()
        if json_out:
            _print_json({"schema_version": 1, "gpus": [g.to_dict() for g in specs]})
            return
        Console(width=200).print(gpus_table(specs))

    models_app = typer.Typer(
        help="List model presets, or show one preset or config.json normalised.", no_args_is_help=False
    )

    @models_app.callback(invoke_without_command=True)
    def models_list(ctx: typer.Context, json_out: bool = _JSON_OPT) -> None:
        """List model presets (read from the configs shipped with servescope)."""
        if ctx.invoked_subcommand is not None:
            return
        specs = models.list_models()
        if json_out:
            _print_json({"schema_version": 1, "models": [m.to_dict() for m in specs]})
            return
        Console(width=200).print(models_table(specs))

    @models_app.command("show")
    def models_show(
        name: str = typer.Argument(..., help="A preset name (see `servescope models`) or a config.json / directory."),
        json_out: bool = _JSON_OPT,
    ) -> None:
        """Show one model normalised: layer pattern, experts, attention, weight formats."""
        spec = models.get_model(name)
        if json_out:
            _print_json({"schema_version": 1, "model": spec.to_dict()})
            return
        Console(width=200).print(model_details(spec))

    app.add_typer(models_app, name="models")
