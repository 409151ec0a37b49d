"""``servescope kernels``: measure MoE expert GEMM efficiency curves on the local GPU.

Thin: parses flags into a ``KernelsRequest`` and calls ``servescope.kernels.probe.run_kernels``. Progress
goes to stderr; the result tables (or ``--json``) to stdout; with ``--out DIR`` also ``kernels.json``,
``kernels.md`` and PNG plots. On a machine without a GPU it prints one error line and exits 2.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import typer

from servescope.errors import ConfigError

_OUT_OPT = typer.Option(None, "--out", help="Write kernels.json, kernels.md and PNG plots into this directory.")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _csv(text))
    except ValueError as err:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from err


def register(app: typer.Typer) -> None:
    """Add ``kernels`` to the servescope app."""

    @app.command("kernels")
    def kernels(
        model: str = typer.Option("", "--model", help="Model name(s) from `servescope models`, comma-separated."),
        tp: int = typer.Option(1, "--tp", help="Tensor parallelism: splits each expert's width."),
        ep: int = typer.Option(1, "--ep", help="Expert parallelism: local experts = routed experts / EP."),
        dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp8 or nvfp4 (comma-separated for several)."),
        tokens_per_expert: str = typer.Option(
            "1,2,4,8,16,32,64,128,256,512,1024", "--tokens-per-expert", help="Comma-separated token counts (M)."
        ),
        gemm: str = typer.Option("gate_up", "--gemm", help="gate_up, down, or both comma-separated."),
        backends: str = typer.Option("", "--backends", help="Only these backends (comma-separated); default all."),
        window_s: float = typer.Option(1.0, "--window-s", help="Steady-loop length per point for timing + NVML."),
        hidden: int = typer.Option(0, "--hidden", help="Custom shape: hidden size (with --expert-width, --experts)."),
        expert_width: int = typer.Option(0, "--expert-width", help="Custom shape: moe_intermediate_size."),
        experts: int = typer.Option(0, "--experts", help="Custom shape: routed experts in the layer."),
        device: int = typer.Option(0, "--device", help="CUDA device index."),
        out: Path | None = _OUT_OPT,
        as_json: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
    ) -> None:
        """Measure MoE expert GEMMs (every backend) against the roofline on the local GPU."""
        from servescope.kernels.probe import KernelsRequest, run_kernels
        from servescope.kernels.results import render_markdown
        from servescope.kernels.shapes import ExpertShape

        custom = None
        if hidden or expert_width or experts:
            if not (hidden and expert_width and experts):
                raise ConfigError("a custom shape needs all of --hidden, --expert-width and --experts")
            custom = ExpertShape(name="custom", hidden=hidden, expert_width=expert_width, experts=experts)
        request = KernelsRequest(
            models=_csv(model), custom=custom, tp=tp, ep=ep, gemms=_csv(gemm), dtypes=_csv(dtype),
            tokens_per_expert=_ints(tokens_per_expert, "--tokens-per-expert"),
            backends=_csv(backends) or None, window_s=window_s, out=out, device_index=device,
            command=shlex.join(["servescope", *sys.argv[1:]]),
        )
        results, path = run_kernels(request, progress=lambda msg: typer.echo(msg, err=True))
        if as_json:
            typer.echo(json.dumps(results.to_dict(), indent=2))
        else:
            typer.echo(render_markdown(results))
        if path is not None:
            typer.echo(f"results written to {path}", err=True)
