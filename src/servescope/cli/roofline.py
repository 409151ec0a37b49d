"""``servescope roofline``: the decode-step roofline of a model on a GPU at several concurrencies.

Thin: parses flags, calls ``servescope.roofline.build_sweep`` and prints a table per
concurrency (or the sweep as JSON with ``--json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from servescope import roofline
from servescope.errors import ConfigError


def parse_concurrency(text: str) -> list[int]:
    """ "256,512,1024" -> [256, 512, 1024]; anything not a positive integer is a ConfigError."""
    out = []
    for part in text.split(","):
        p = part.strip()
        if not p.isdigit() or int(p) <= 0:
            raise ConfigError(f"--concurrency {text!r}: {p!r} is not a positive integer (e.g. 256,512,1024)")
        out.append(int(p))
    return out


def _load_efficiency(path: Path) -> roofline.Efficiency:
    try:
        from servescope.kernels.calibration import load_calibration  # optional module: imported lazily
    except ImportError as err:
        raise ConfigError(
            "--calibrate needs servescope.kernels.calibration, which this build does not have yet; "
            "run without --calibrate"
        ) from err
    return load_calibration(path).efficiency


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def point_table(p: roofline.DecodePoint) -> Table:
    tpe = p.tokens_per_expert_mean
    head = f"concurrency {p.concurrency}: step {p.step_time_us / 1e3:,.2f} ms, {p.bound}-bound, "
    head += f"<= {p.tok_s_upper_bound:,.0f} tok/s"
    if tpe is not None:
        head += f", tokens/expert mean {tpe:,.1f} max {p.tokens_per_expert_max:,.1f}"
    t = Table(title=head, title_justify="left")
    for col in (
        "op",
        "m",
        "n",
        "k",
        "count",
        "dtype",
        "GFLOP",
        "MB",
        "FLOP/B",
        "ridge",
        "TFLOP/s",
        "% peak",
        "time us",
        "share",
    ):
        t.add_column(col, justify="left" if col in ("op", "dtype") else "right")
    total = p.step_time_us or 1.0
    for o in p.ops:
        is_comm = o.kind == "comm"
        t.add_row(
            o.name,
            _fmt(o.m, ",.1f") if o.m is not None else "",
            _fmt(o.n) if o.n is not None else "",
            _fmt(o.k) if o.k is not None else "",
            _fmt(o.count, ",.0f"),
            o.dtype if not is_comm else "link",
            _fmt(o.flops / 1e9, ",.1f"),
            _fmt(o.bytes / 1e6, ",.1f"),
            "" if is_comm else _fmt(o.intensity, ",.1f"),
            "" if is_comm else _fmt(o.ridge, ",.0f"),
            "" if is_comm else _fmt(o.attainable_tflops, ",.1f"),
            "" if is_comm else _fmt(o.pct_of_peak, ".1f"),
            _fmt(o.time_us, ",.0f"),
            f"{100 * o.time_us / total:.1f}%",
        )
    return t


def summary_table(sweep: roofline.RooflineSweep) -> Table:
    t = Table(title="summary (per GPU of the TP group; tok/s for the whole group)", title_justify="left")
    for col in (
        "concurrency",
        "tok/expert mean",
        "tok/expert max",
        "step ms",
        "memory ms",
        "compute ms",
        "comm ms",
        "bound",
        "dominant",
        "tok/s upper bound",
        "fits",
    ):
        t.add_column(col, justify="left" if col in ("bound", "dominant") else "right")
    for p in sweep.points:
        t.add_row(
            str(p.concurrency),
            _fmt(p.tokens_per_expert_mean, ",.1f"),
            _fmt(p.tokens_per_expert_max, ",.1f"),
            _fmt(p.step_time_us / 1e3, ",.2f"),
            _fmt(p.memory_time_us / 1e3, ",.2f"),
            _fmt(p.compute_time_us / 1e3, ",.2f"),
            _fmt(p.comm_time_us / 1e3, ",.2f"),
            p.bound,
            p.dominant_term,
            _fmt(p.tok_s_upper_bound, ",.0f"),
            {True: "yes", False: "NO", None: "?"}[p.fits_in_memory],
        )
    return t


def register(app: typer.Typer) -> None:
    """Add ``roofline`` to the servescope app."""

    @app.command("roofline")
    def roofline_cmd(
        model: str = typer.Option(..., "--model", help="Model preset (servescope models) or a config.json path."),
        gpu: str = typer.Option(..., "--gpu", help="GPU key, alias or NVML name (servescope gpus)."),
        dtype: str | None = typer.Option(
            None,
            "--dtype",
            help="Format of the expert / shared / dense MLP weights (nvfp4, mxfp4, fp8, bf16...); "
            "default: the model's own.",
        ),
        tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs (attention, dense and shared MLP, lm_head)."),
        ep: int = typer.Option(1, "--ep", help="Expert-parallel degree of the MoE within the TP GPUs (divides --tp)."),
        concurrency: str = typer.Option(
            "256,512,1024,2048", "--concurrency", help="Comma-separated decode batch sizes (sequences in flight)."
        ),
        context: int = typer.Option(256, "--context", help="Tokens in each sequence's KV cache during decode."),
        routing: str = typer.Option("balanced", "--routing", help="balanced | uniform | zipf:S (e.g. zipf:1.2)."),
        link_gb_s: float | None = typer.Option(
            None, "--link-gb-s", help="GPU-to-GPU bandwidth per direction in GB/s; default: the GPU's interconnect."
        ),
        kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="KV-cache format (fp8, bf16); default: model's."),
        seed: int = typer.Option(0, "--seed", help="Seed of the Monte-Carlo routing models."),
        calibrate: str | None = typer.Option(
            None, "--calibrate", help="Results of `servescope kernels`: measured expert-GEMM efficiency."
        ),
        json_out: bool = typer.Option(False, "--json", help="Print the sweep as JSON on stdout."),
    ) -> None:
        """Decode-step roofline per GEMM at each concurrency: step time, bound, tok/s upper bound."""
        concurrencies = parse_concurrency(concurrency)
        if link_gb_s is not None and link_gb_s <= 0:
            raise ConfigError(f"--link-gb-s must be positive, got {link_gb_s}")
        efficiency = _load_efficiency(Path(calibrate)) if calibrate is not None else None
        sweep = roofline.build_sweep(
            model,
            gpu,
            dtype=dtype,
            concurrencies=concurrencies,
            context_len=context,
            tp=tp,
            ep=ep,
            routing=routing,
            link_bandwidth_bytes_s=link_gb_s * 1e9 if link_gb_s is not None else None,
            efficiency=efficiency,
            seed=seed,
            kv_dtype=kv_dtype,
        )
        if json_out:
            typer.echo(json.dumps(sweep.to_dict(), indent=2))
            return
        console = Console(width=200)
        first = sweep.points[0]
        console.print(
            f"[bold]{first.model}[/bold] on {first.gpu} x{first.tp} (ep {first.ep}), weights {first.dtype}, "
            f"context {first.context_len}, routing {routing}, link "
            + (f"{first.link_bandwidth_bytes_s / 1e9:,.0f} GB/s" if first.link_bandwidth_bytes_s else "unknown")
        )
        for p in sweep.points:
            console.print(point_table(p))
        console.print(summary_table(sweep))
        cb = sweep.compute_bound_concurrency
        console.print(
            f"step turns compute-bound at concurrency {cb:,}"
            if cb is not None
            else "step stays memory-bound up to concurrency 1,048,576 (KV-cache traffic grows with the FLOPs)"
        )
        if sweep.expert_ridge_tokens_per_expert is not None:
            console.print(
                f"expert gate/up GEMM reaches the ridge at {sweep.expert_ridge_tokens_per_expert:,.0f} tokens/expert "
                f"(concurrency ~{sweep.expert_ridge_concurrency:,.0f} with balanced routing)"
            )
        for w in dict.fromkeys(w for p in sweep.points for w in p.warnings):
            typer.echo(f"warning: {w}", err=True)
