"""PNG plots of kernel curves: achieved bandwidth and % of roofline against tokens per expert.

One figure per dtype, one column per (model, gemm): the top row shows achieved GB/s with the measured copy
bandwidth (and 80% of it, the target of our kernel at decode sizes) as horizontal lines; the bottom row
shows % of the roofline. Rendering only: reads a ``KernelResults``, measures nothing.
"""

from __future__ import annotations

from pathlib import Path

from servescope.kernels.results import KernelResults


def plot_results(results: KernelResults, out_dir: str | Path, *, prefix: str = "kernels") -> list[Path]:
    """Write ``{prefix}-{dtype}.png`` per dtype into ``out_dir``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    dtypes = sorted({p.dtype for p in results.points if p.status == "ok"})
    copy_gb_s = results.ceilings.bandwidth_bytes_s / 1e9
    for dtype in dtypes:
        pts = [p for p in results.points if p.dtype == dtype and p.status == "ok"]
        groups = sorted({(p.model, p.gemm) for p in pts})
        fig, axes = plt.subplots(2, len(groups), figsize=(5.2 * len(groups), 8), squeeze=False)
        for col, (model, gemm) in enumerate(groups):
            gp = [p for p in pts if p.model == model and p.gemm == gemm]
            backends = sorted({p.backend for p in gp})
            ax_bw, ax_pct = axes[0][col], axes[1][col]
            for backend in backends:
                bp = sorted((p for p in gp if p.backend == backend), key=lambda p: p.tokens_per_expert)
                xs = [p.tokens_per_expert for p in bp]
                style = "-" if backend.startswith("triton") else "--"
                ax_bw.plot(xs, [p.achieved_gb_s for p in bp], style, marker="o", ms=3, label=backend)
                ax_pct.plot(xs, [p.pct_of_roofline for p in bp], style, marker="o", ms=3, label=backend)
            ax_bw.axhline(copy_gb_s, color="black", lw=0.8)
            ax_bw.axhline(0.8 * copy_gb_s, color="grey", lw=0.8, ls=":")
            ax_bw.text(1, copy_gb_s, " measured copy BW", va="bottom", fontsize=7)
            first = gp[0]
            ax_bw.set_title(f"{model} {gemm} {dtype}\n{first.local_experts} experts, k={first.k}, n={first.n}",
                            fontsize=9)
            for ax in (ax_bw, ax_pct):
                ax.set_xscale("log", base=2)
                ax.grid(True, which="both", alpha=0.3)
                ax.set_xlabel("tokens per expert")
            ax_bw.set_ylabel("achieved GB/s (minimum bytes / time)")
            ax_pct.set_ylabel("% of roofline (measured ceilings)")
            ax_pct.set_ylim(0, 110)
            ax_pct.legend(fontsize=7)
        fig.suptitle(f"MoE expert GEMMs on {results.gpu.get('name', 'GPU')} ({dtype})")
        fig.tight_layout()
        path = out / f"{prefix}-{dtype}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
