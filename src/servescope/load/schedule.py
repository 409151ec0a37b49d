"""Load patterns: when each request should go out. Pure; knows nothing about HTTP or APIs.

- Closed loop (the seed's mode, sglang/vLLM ``--max-concurrency`` with unlimited rate):
  ``concurrency`` requests in flight; each finish releases the next.
- Open loop: arrivals at ``rate`` requests/s with gamma-distributed gaps (shape
  ``burstiness``; 1.0 is Poisson), as vLLM's ``--burstiness`` (shape k, scale
  1/(rate*k), vllm/benchmarks/serve.py). The whole schedule is computed up front as
  ABSOLUTE offsets from the point start, so a late send never shifts later ones: sglang's
  ``asyncio.sleep(expovariate)`` accumulates drift (vllm#21104: 200 req/s asked, 183.5
  delivered); vLLM fixed it the same way (vLLM PR #21108).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """A fixed number of requests in flight."""

    concurrency: int

    @property
    def label(self) -> str:
        return f"c={self.concurrency}"


@dataclass(frozen=True, slots=True)
class OpenLoop:
    """Requests at ``rate``/s (inf = all at once), optionally capped at ``max_concurrency`` in flight."""

    rate: float
    burstiness: float = 1.0
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        cap = f",cap={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={self.rate:g}{cap}"


def arrival_offsets_ns(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                       duration_s: float | None = None) -> list[int]:
    """Absolute send offsets (ns from the point start) for ``n`` requests.

    With ``duration_s`` the list stops at the first arrival past it (``n`` is then an
    upper bound). The first request goes at offset 0. Deterministic for a given seed.
    """
    if rate <= 0 or math.isnan(rate):
        raise ValueError("request rate must be > 0")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(rate):
        return [0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    out: list[int] = []
    t = 0.0
    limit = duration_s if duration_s is not None else math.inf
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        if t > limit:
            break
        out.append(round(t * 1e9))
    return out
