"""How many tokens each expert (and each GPU) gets in one MoE decode step.

Why it matters: a decode step of B sequences sends B tokens through each MoE layer and
each token to ``top_k`` of ``n_experts`` experts. The expert GEMMs' arithmetic intensity
grows with the tokens per expert, and the step waits for the slowest GPU, whose load is
set by how the router happens to spread tokens. Three routing models:

- ``balanced``: every expert gets B*k/E tokens (the remainder spread one each, round
  robin over GPUs). Exact. The best case, and what back-of-envelope maths assumes.
- ``uniform``: each token picks k DISTINCT experts uniformly at random, independently.
  Each expert's count is Binomial(B, k/E) (marginally exact), so the expected number of
  active experts is E(1-(1-k/E)^B) and the mean tokens per active expert is
  (Bk/E)/(1-(1-k/E)^B): closed forms. The expected MAXIMUM (the straggler) has none and
  is estimated by seeded Monte Carlo.
- ``zipf:S``: expert popularity proportional to rank^-S (a power law, like
  aiconfigurator's ``power_law`` routing); each token picks k distinct experts by
  weighted sampling without replacement (Gumbel-top-k, i.e. Plackett-Luce). The ranks are
  shuffled over experts per trial, so hot experts land on random GPUs. Monte Carlo only.

Expert placement for EP: expert e lives on EP rank e // (E/ep), as sglang and vLLM lay
experts out. TP inside an EP group only narrows each expert (handled in ``roofline``).

Monte Carlo samples every token's choice when B*E*trials is small enough
(``EXACT_WORK_LIMIT``); above it, counts are drawn as independent Binomial(B, p_e) with
each expert's exact (uniform) or estimated (zipf) inclusion probability p_e. That keeps
the marginals right and drops the weak negative correlation between experts' counts;
``RoutingStats.method`` says which was used.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from servescope.errors import ConfigError

#: Above this many random draws (B * E * trials) per call, sample counts, not every token.
EXACT_WORK_LIMIT = 1 << 24
#: Tokens used to estimate zipf inclusion probabilities in the counts approximation.
_ZIPF_PROBE_TOKENS = 1 << 15
DEFAULT_TRIALS = 32


@dataclass(frozen=True, slots=True)
class Routing:
    """A parsed routing model: ``kind`` is "balanced", "uniform" or "zipf" (with ``exponent``)."""

    kind: str
    exponent: float | None = None

    @property
    def label(self) -> str:
        return f"zipf:{self.exponent:g}" if self.kind == "zipf" else self.kind


def parse_routing(text: str | Routing) -> Routing:
    """Parse "balanced", "uniform" or "zipf:S" (S > 0); anything else is a ``ConfigError``."""
    if isinstance(text, Routing):
        return text
    t = text.strip().lower()
    if t in ("balanced", "uniform"):
        return Routing(t)
    m = re.fullmatch(r"zipf:([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)", t)
    if m:
        s = float(m.group(1))
        if s > 0 and math.isfinite(s):
            return Routing("zipf", s)
    raise ConfigError(f"routing {text!r} not understood; use balanced, uniform or zipf:S with S > 0 (e.g. zipf:1.2)")


@dataclass(frozen=True, slots=True, eq=False)
class LoadSamples:
    """Per trial and per EP rank: active experts, routed tokens, and the busiest expert's tokens.

    Arrays of shape (trials, ep). The roofline evaluates each GPU's expert time per trial
    and takes the max over GPUs: the expected straggler, not the straggler of the means.
    """

    active_experts: np.ndarray
    tokens: np.ndarray
    max_expert_tokens: np.ndarray
    expert_max_global: np.ndarray = field(repr=False)


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """Expected expert load of one decode step (all values are expectations over routings).

    ``tokens_per_expert_mean`` is per ACTIVE expert (experts with no token do no GEMM);
    ``tokens_per_expert_max`` is the expected largest count on any one expert;
    ``gpu_*`` are per EP rank, ``*_max`` the expected maximum over ranks.
    """

    routing: str
    method: str
    batch_tokens: int
    top_k: int
    n_experts: int
    ep: int
    experts_per_gpu: int
    assignments: int
    active_experts_mean: float
    active_experts_closed_form: float | None
    tokens_per_expert_mean: float
    tokens_per_expert_max: float
    gpu_active_experts_mean: float
    gpu_active_experts_max: float
    gpu_tokens_mean: float
    gpu_tokens_max: float
    trials: int
    seed: int

    def to_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def expected_active_experts(batch_tokens: int, top_k: int, n_experts: int) -> float:
    """E(1-(1-k/E)^B): each expert is missed by one token with probability 1-k/E."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch_tokens)


def _validate(batch_tokens: int, top_k: int, n_experts: int, ep: int, trials: int) -> None:
    for name, v in (
        ("batch_tokens", batch_tokens),
        ("top_k", top_k),
        ("n_experts", n_experts),
        ("ep", ep),
        ("trials", trials),
    ):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if top_k > n_experts:
        raise ConfigError(f"top_k {top_k} exceeds the number of experts {n_experts}")
    if n_experts % ep:
        raise ConfigError(f"ep {ep} does not divide the {n_experts} experts; pick an ep that divides {n_experts}")


def _balanced_counts(batch_tokens: int, top_k: int, n_experts: int, ep: int) -> np.ndarray:
    q, r = divmod(batch_tokens * top_k, n_experts)
    per_gpu = n_experts // ep
    # Order experts round robin over GPUs (e0 of gpu0, e0 of gpu1, ...) so the r extra tokens spread evenly.
    order = np.arange(n_experts).reshape(ep, per_gpu).T.reshape(-1)
    counts = np.full(n_experts, q, dtype=np.int64)
    counts[order[:r]] += 1
    return counts[None, :]


def _gumbel_topk_counts(
    rng: np.random.Generator, batch_tokens: int, top_k: int, log_w: np.ndarray | None, n_experts: int
) -> np.ndarray:
    """Counts per expert for one trial: every token picks top_k distinct experts (weighted by exp(log_w))."""
    counts = np.zeros(n_experts, dtype=np.int64)
    chunk = max(1, (1 << 20) // n_experts)
    done = 0
    while done < batch_tokens:
        b = min(chunk, batch_tokens - done)
        keys = rng.gumbel(size=(b, n_experts)) if log_w is not None else rng.random((b, n_experts))
        if log_w is not None:
            keys += log_w
        if top_k == n_experts:
            picked = np.broadcast_to(np.arange(n_experts), (b, n_experts))
        else:
            # top_k largest keys = top_k smallest of -keys
            picked = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        counts += np.bincount(picked.reshape(-1), minlength=n_experts)
        done += b
    return counts


def _zipf_log_weights(n_experts: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    ranks = rng.permutation(n_experts) + 1
    return -exponent * np.log(ranks.astype(np.float64))


def sample_loads(
    batch_tokens: int,
    top_k: int,
    n_experts: int,
    ep: int = 1,
    routing: str | Routing = "balanced",
    seed: int = 0,
    trials: int = DEFAULT_TRIALS,
) -> tuple[LoadSamples, str]:
    """Draw expert counts for ``trials`` decode steps and fold them per EP rank.

    Returns the samples and the method used ("exact", "monte-carlo per token", or
    "monte-carlo binomial counts").
    """
    _validate(batch_tokens, top_k, n_experts, ep, trials)
    r = parse_routing(routing)
    rng = np.random.default_rng(seed)
    if r.kind == "balanced":
        counts = _balanced_counts(batch_tokens, top_k, n_experts, ep)
        method = "exact"
    elif batch_tokens * n_experts * trials <= EXACT_WORK_LIMIT:
        rows = []
        for _ in range(trials):
            log_w = _zipf_log_weights(n_experts, r.exponent or 0.0, rng) if r.kind == "zipf" else None
            rows.append(_gumbel_topk_counts(rng, batch_tokens, top_k, log_w, n_experts))
        counts = np.stack(rows)
        method = f"monte-carlo per token ({trials} trials, seed {seed})"
    else:
        if r.kind == "uniform":
            p = np.full((trials, n_experts), top_k / n_experts)
        else:
            # Inclusion probability of each popularity rank, estimated once by per-token sampling, then
            # shuffled over experts per trial (placement of hot experts is random).
            ranked = -(r.exponent or 0.0) * np.log(np.arange(1, n_experts + 1, dtype=np.float64))
            probe = _gumbel_topk_counts(rng, _ZIPF_PROBE_TOKENS, top_k, ranked, n_experts) / _ZIPF_PROBE_TOKENS
            p = np.stack([probe[rng.permutation(n_experts)] for _ in range(trials)])
        counts = rng.binomial(batch_tokens, np.clip(p, 0.0, 1.0))
        method = f"monte-carlo binomial counts ({trials} trials, seed {seed})"
    per_gpu = counts.reshape(counts.shape[0], ep, n_experts // ep)
    samples = LoadSamples(
        active_experts=(per_gpu > 0).sum(axis=2),
        tokens=per_gpu.sum(axis=2),
        max_expert_tokens=per_gpu.max(axis=2),
        expert_max_global=counts.max(axis=1),
    )
    return samples, method


def summarize(
    samples: LoadSamples,
    method: str,
    *,
    batch_tokens: int,
    top_k: int,
    n_experts: int,
    ep: int,
    routing: str | Routing,
    seed: int,
) -> RoutingStats:
    """Turn samples into expectations, using closed forms where they exist."""
    r = parse_routing(routing)
    trials = samples.tokens.shape[0]
    assignments = batch_tokens * top_k
    active_total = samples.active_experts.sum(axis=1).astype(np.float64)
    closed = None
    if r.kind == "balanced":
        active_mean = float(min(n_experts, assignments))
        tpe_mean = assignments / active_mean
        gpu_active_mean = active_mean / ep
    elif r.kind == "uniform":
        closed = expected_active_experts(batch_tokens, top_k, n_experts)
        active_mean = closed
        tpe_mean = assignments / closed
        gpu_active_mean = closed / ep
    else:
        active_mean = float(active_total.mean())
        tpe_mean = float((samples.tokens.sum(axis=1) / np.maximum(active_total, 1)).mean())
        gpu_active_mean = float(samples.active_experts.mean())
    return RoutingStats(
        routing=r.label,
        method=method,
        batch_tokens=batch_tokens,
        top_k=top_k,
        n_experts=n_experts,
        ep=ep,
        experts_per_gpu=n_experts // ep,
        assignments=assignments,
        active_experts_mean=active_mean,
        active_experts_closed_form=closed,
        tokens_per_expert_mean=tpe_mean,
        tokens_per_expert_max=float(samples.expert_max_global.mean()),
        gpu_active_experts_mean=gpu_active_mean,
        gpu_active_experts_max=float(samples.active_experts.max(axis=1).mean()),
        gpu_tokens_mean=assignments / ep,
        gpu_tokens_max=float(samples.tokens.max(axis=1).mean()),
        trials=trials,
        seed=seed,
    )


def tokens_per_expert(
    batch_tokens: int,
    top_k: int,
    n_experts: int,
    ep: int = 1,
    routing: str | Routing = "balanced",
    seed: int = 0,
    trials: int = DEFAULT_TRIALS,
) -> RoutingStats:
    """Expected expert load for B tokens, top-k of E experts, spread over ``ep`` GPUs.

    >>> tokens_per_expert(1024, 8, 256).tokens_per_expert_mean
    32.0
    """
    samples, method = sample_loads(batch_tokens, top_k, n_experts, ep, routing, seed, trials)
    return summarize(
        samples, method, batch_tokens=batch_tokens, top_k=top_k, n_experts=n_experts, ep=ep, routing=routing, seed=seed
    )
