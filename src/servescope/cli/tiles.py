"""``servescope tiles``: which CUTLASS GEMM tiles fit in shared memory, with how many stages, and what small M costs.

Thin: parses flags, calls ``servescope.tiles.analyze_tiles`` (and ``small_m_cost`` with ``--tokens-per-expert``) and
prints one row per tile, or the reports as JSON with ``--json``.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from servescope import hardware, tiles
from servescope.errors import ConfigError

SCHEMA_VERSION = 1


def _fits_cell(r: tiles.TileReport) -> str:
    if not r.compiles:
        return "no (build)"
    if not r.fits:
        return "NO (padding)" if r.fits_by_formula_only else "no"
    return "yes"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = ["<" if i < 2 else ">" for i in range(len(header))]
    out = ["  ".join(f"{h:{a}{w}}" for h, a, w in zip(header, fmt, widths, strict=True))]
    out += ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(row, fmt, widths, strict=True)) for row in rows]
    return out


def render_text(reports: list[tiles.TileReport], costs: list[tiles.SmallMCost | None]) -> str:
    """The human-readable table: one row per tile, then the reason for every tile that does not fit."""
    first = reports[0]
    verified = "verified against CUTLASS" if first.verified else "NOT verified against CUTLASS"
    lines = [
        f"{first.arch}  {first.a} x {first.b} -> {first.out}{' (+C)' if first.source else ''}  "
        f"{first.kernel}  CUTLASS {tiles.CUTLASS_VERSION} model, {verified}; "
        f"capacity {first.capacity_bytes:,} B per block",
        "",
    ]
    header = ["tile", "schedule", "B/stage", "stages", "mainloop", "epilogue", "extras", "padding", "total", "fits"]
    rows = []
    for r in reports:
        stage = f"{r.formula.stage_bytes:,}" if r.formula else "-"
        if r.compiles:
            sizes = [f"{r.mainloop_bytes:,}", f"{r.epilogue_bytes:,}", f"{r.extras_bytes:,}", f"{r.padding_bytes:,}",
                     f"{r.total_bytes:,}"]
        else:
            sizes = ["-"] * 5
        rows.append([str(r.tile), r.schedule, stage, str(r.stages), *sizes, _fits_cell(r)])
    lines += _table(rows, header)
    lines.append("")
    for r in reports:
        if not r.fits:
            lines.append(f"{r.tile}: {r.reason}")
        for note in r.notes:
            lines.append(f"{r.tile}: note: {note}")
    if any(c is not None for c in costs):
        lines.append("")
        header = ["tile", "tokens", "row pad", "MMA pad", "CTAs", "waves", "occupancy", "ceiling"]
        rows = [[str(c.tile), str(c.m_tokens), f"{c.row_padding_fraction:.0%}", f"{c.mma_padding_fraction:.0%}",
                 f"{c.cta_count:,}", str(c.waves), f"{c.wave_efficiency:.0%}", f"{c.efficiency_ceiling:.0%}"]
                for c in costs if c is not None]
        lines += _table(rows, header)
        lines.append("")
        lines += [c.summary for c in costs if c is not None][:1]
    return "\n".join(lines).rstrip() + "\n"


def register(app: typer.Typer) -> None:
    """Add the ``tiles`` command to the servescope app."""

    @app.command("tiles")
    def tiles_cmd(
        arch: str = typer.Option(None, "--arch", help="Architecture: sm80, sm89, sm90, sm100, sm120 (sm_120a ...)."),
        a: str = typer.Option(..., "--a", help="Operand A format: nvfp4, mxfp4, mxfp6, mxfp8, fp8, bf16, fp16."),
        b: str = typer.Option(None, "--b", help="Operand B format (default: same as --a)."),
        out: str = typer.Option("bf16", "--out", help="Output D: bf16, fp16, fp32, nvfp4 (with scale factors)."),
        tile: Annotated[
            list[str] | None, typer.Option("--tile", help="MxNxK tile, repeatable (default: common tiles).")
        ] = None,
        grouped: bool = typer.Option(False, "--grouped", help="Grouped (ptr-array, MoE) kernel instead of dense."),
        schedule: str = typer.Option(None, "--schedule", help="cooperative|pingpong (sm90/sm120), 1sm|2sm (sm100)."),
        source: bool = typer.Option(False, "--source", help="The epilogue also reads C (D = alpha*acc + beta*C)."),
        tokens_per_expert: int = typer.Option(None, "--tokens-per-expert", help="M rows per expert: small-M cost."),
        gemm_n: int = typer.Option(None, "--gemm-n", help="GEMM N for the small-M cost (e.g. expert width)."),
        gemm_k: int = typer.Option(None, "--gemm-k", help="GEMM K for the small-M cost (e.g. hidden size)."),
        experts: int = typer.Option(1, "--experts", help="GEMMs run together (active experts) for the wave count."),
        gpu: str = typer.Option(None, "--gpu", help="GPU from the catalog: its SM count (and arch if --arch unset)."),
        sm_count: int = typer.Option(None, "--sm-count", help="SM count for the wave count (overrides --gpu)."),
        as_json: bool = typer.Option(False, "--json", help="Print the reports as JSON."),
    ) -> None:
        """Shared memory, pipeline stages and fit of CUTLASS GEMM tiles (CUTLASS 4.2 builders, verified by probe)."""
        spec = hardware.get_gpu(gpu) if gpu else None
        if arch is None:
            if spec is None:
                raise ConfigError("tiles: give --arch (e.g. sm120) or --gpu (e.g. rtx-pro-6000)")
            arch = spec.arch
        chosen = [tiles.parse_tile(t) for t in tile] if tile else None
        reports = tiles.analyze_tiles(arch, a, b, out, chosen, grouped=grouped, schedule=schedule, source=source)
        costs: list[tiles.SmallMCost | None] = [None] * len(reports)
        if tokens_per_expert is not None:
            sms = sm_count if sm_count is not None else (spec.sm_count if spec else None)
            if sms is None or gemm_n is None or gemm_k is None:
                raise ConfigError("--tokens-per-expert needs --gemm-n, --gemm-k and --sm-count (or --gpu)")
            costs = [tiles.small_m_cost(tokens_per_expert, gemm_n, gemm_k, r.tile, sms, groups=experts)
                     for r in reports]
        if as_json:
            doc = {"schema_version": SCHEMA_VERSION, "cutlass_version": tiles.CUTLASS_VERSION,
                   "tiles": [r.to_dict() for r in reports],
                   "small_m": [c.to_dict() for c in costs if c is not None]}
            typer.echo(json.dumps(doc, indent=1))
        else:
            typer.echo(render_text(reports, costs), nl=False)
