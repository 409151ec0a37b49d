"""Measured kernel efficiency as a function of tokens per expert, for the roofline model to use.

The ideal roofline says what an expert GEMM *could* take; ``servescope kernels`` measures what the best
available backend *does* take. Their ratio, per dtype and tokens per expert, is the efficiency that
``servescope roofline --calibrate RESULTS`` multiplies the ideal rate with, so the model predicts what
this GPU and software stack deliver, and the diagnosis can say how much a better kernel would win.

``efficiency`` is the fraction (0, 1] of the ideal roofline rate the *best correct backend* reaches at a
point: ideal time / measured time. The ideal is drawn against the datasheet ceilings when the results file
has them (``basis == "datasheet"``: the same ceilings an analytical roofline uses, so multiplying its rate
by this efficiency reproduces the measured time) and against the ceilings measured in the same run
otherwise (``basis == "measured"``). Between measured points it is interpolated linearly in log(tokens);
outside them it is held at the nearest end.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path

from servescope.errors import ConfigError, RunDataError, UnknownNameError
from servescope.kernels.results import KernelPoint, KernelResults, read_results


@dataclass(frozen=True, slots=True)
class EfficiencyCurve:
    """Best-backend efficiency at each measured tokens-per-expert point, for one (model, gemm, dtype)."""

    model: str
    gemm: str
    dtype: str
    tokens: tuple[float, ...]
    efficiency: tuple[float, ...]
    best_backend: tuple[str, ...]

    def at(self, tokens_per_expert: float) -> float:
        """Efficiency interpolated linearly in log(tokens), held constant beyond the measured range."""
        if tokens_per_expert <= self.tokens[0]:
            return self.efficiency[0]
        if tokens_per_expert >= self.tokens[-1]:
            return self.efficiency[-1]
        hi = bisect.bisect_left(self.tokens, tokens_per_expert)
        lo = hi - 1
        x0, x1 = math.log(self.tokens[lo]), math.log(self.tokens[hi])
        f = (math.log(tokens_per_expert) - x0) / (x1 - x0)
        return self.efficiency[lo] + f * (self.efficiency[hi] - self.efficiency[lo])

    def backend_at(self, tokens_per_expert: float) -> str:
        """The best backend at the measured point nearest in log(tokens)."""
        logs = [abs(math.log(t) - math.log(max(tokens_per_expert, 1e-9))) for t in self.tokens]
        return self.best_backend[logs.index(min(logs))]


def _point_efficiency(point: KernelPoint, basis: str) -> float | None:
    pct = point.pct_of_peak if basis == "datasheet" else point.pct_of_roofline
    if pct is None or not math.isfinite(pct) or pct <= 0:
        return None
    return min(1.0, pct / 100.0)


class Calibration:
    """Efficiency curves read from one kernels results file."""

    def __init__(self, results: KernelResults, source: str = "") -> None:
        self.results = results
        self.source = source
        timed = [p for p in results.points if p.status == "ok" and p.correct]
        if not timed:
            raise RunDataError(source or "<results>", "no correct, timed kernel points to calibrate with")
        self.basis = "datasheet" if all(p.pct_of_peak is not None for p in timed) else "measured"
        self._timed = timed
        self.curves: dict[tuple[str, str, str], EfficiencyCurve] = self._build_curves(timed, backend=None)

    def _build_curves(self, timed: list[KernelPoint], backend: str | None) -> dict[tuple[str, str, str],
                                                                                      EfficiencyCurve]:
        best: dict[tuple[str, str, str], dict[int, tuple[float, str]]] = {}
        for p in timed:
            if backend is not None and p.backend != backend:
                continue
            eff = _point_efficiency(p, self.basis)
            if eff is None:
                continue
            per_tokens = best.setdefault((p.model, p.gemm, p.dtype), {})
            current = per_tokens.get(p.tokens_per_expert)
            if current is None or eff > current[0]:
                per_tokens[p.tokens_per_expert] = (eff, p.backend)
        curves = {}
        for key, per_tokens in best.items():
            tokens = sorted(per_tokens)
            curves[key] = EfficiencyCurve(
                model=key[0], gemm=key[1], dtype=key[2], tokens=tuple(float(t) for t in tokens),
                efficiency=tuple(per_tokens[t][0] for t in tokens),
                best_backend=tuple(per_tokens[t][1] for t in tokens),
            )
        return curves

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({k[2] for k in self.curves}))

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted({k[0] for k in self.curves}))

    def _select(self, dtype: str, model: str | None, gemm: str | None, backend: str | None) -> list[EfficiencyCurve]:
        curves = self.curves if backend is None else self._build_curves(self._timed, backend)
        if backend is not None and not curves:
            raise UnknownNameError("kernel backend", backend, sorted({p.backend for p in self._timed}))
        chosen = [c for (m, g, d), c in curves.items()
                  if d == dtype and (model is None or m == model) and (gemm is None or g == gemm)]
        if not chosen:
            if dtype not in self.dtypes:
                raise UnknownNameError("calibrated dtype", dtype, self.dtypes)
            if model is not None and model not in self.models:
                raise UnknownNameError("calibrated model", model, self.models)
            raise ConfigError(f"no {dtype} points for model={model!r} gemm={gemm!r} backend={backend!r} in "
                              f"{self.source or 'the results'}")
        return chosen

    def efficiency(self, dtype: str, tokens_per_expert: float, *, model: str | None = None, gemm: str | None = None,
                   backend: str | None = None) -> float:
        """Fraction (0, 1] of the ideal roofline rate the best correct backend reaches at this point.

        With several models or GEMMs in the file and none named, the mean over them (the curves of
        different expert shapes on one GPU are close; the mean is the estimate for an unmeasured shape).
        ``backend`` restricts to one backend instead of the best.
        """
        if tokens_per_expert <= 0:
            raise ConfigError(f"tokens per expert must be > 0, got {tokens_per_expert}")
        chosen = self._select(dtype, model, gemm, backend)
        value = sum(c.at(tokens_per_expert) for c in chosen) / len(chosen)
        return max(min(value, 1.0), 1e-9)

    def best_backend(self, dtype: str, tokens_per_expert: float, *, model: str | None = None) -> str:
        """Name of the backend that was best at the nearest measured point (first matching curve)."""
        return self._select(dtype, model, None, None)[0].backend_at(tokens_per_expert)


def load_calibration(path: str | Path) -> Calibration:
    """Read a results file, or the directory ``servescope kernels --out DIR`` wrote, into a Calibration."""
    results = read_results(path)
    return Calibration(results, source=str(path))
