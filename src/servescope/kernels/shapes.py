"""Expert GEMM shapes: from a model's MoE geometry to the matrices one GPU multiplies.

A routed-expert MLP is two GEMMs per expert: ``gate_up`` ([M, hidden] x [hidden, 2*width], gate and up
projections side by side, as vLLM and sglang store them) and ``down`` ([M, width] x [width, hidden]).
Expert parallelism (EP) splits the experts across GPUs, so one GPU holds ``experts / ep`` of them;
tensor parallelism (TP) splits each expert's width, so each GPU holds ``width / tp`` of every local
expert's columns (gate_up) or rows (down). Those are the numbers a kernel on one GPU sees, and the ones
this module derives. Pure Python, no torch: the CPU tests exercise it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from servescope.errors import ConfigError

#: The two GEMMs of a routed expert, in the order a layer runs them.
GEMMS = ("gate_up", "down")


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """A MoE layer's routed-expert geometry, as a model config states it (before any parallelism).

    ``expert_width`` is ``moe_intermediate_size``; ``experts`` counts routed experts (shared experts run
    as a dense MLP and are not part of the grouped GEMM).
    """

    name: str
    hidden: int
    expert_width: int
    experts: int
    top_k: int | None = None

    def __post_init__(self) -> None:
        for field_name in ("hidden", "expert_width", "experts"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"expert shape {self.name!r}: {field_name} must be a positive integer, got {value!r}")

    def gemm(self, gemm: str, *, tp: int = 1, ep: int = 1) -> GemmShape:
        """The shape of one expert GEMM as one GPU of a TP x EP deployment runs it."""
        if gemm not in GEMMS:
            raise ConfigError(f"unknown expert GEMM {gemm!r}; choose one of {', '.join(GEMMS)}")
        if tp < 1 or ep < 1:
            raise ConfigError(f"--tp and --ep must be >= 1 (got tp={tp}, ep={ep})")
        if self.experts % ep:
            raise ConfigError(
                f"{self.name}: {self.experts} routed experts do not split evenly over ep={ep}; pick a divisor"
            )
        if self.expert_width % tp:
            raise ConfigError(
                f"{self.name}: expert width {self.expert_width} does not split evenly over tp={tp}; pick a divisor"
            )
        width = self.expert_width // tp
        local = self.experts // ep
        if gemm == "gate_up":
            return GemmShape(model=self.name, gemm=gemm, n=2 * width, k=self.hidden, local_experts=local)
        return GemmShape(model=self.name, gemm=gemm, n=self.hidden, k=width, local_experts=local)


@dataclass(frozen=True, slots=True)
class GemmShape:
    """One grouped GEMM on one GPU: ``local_experts`` independent [M, k] x [k, n] products.

    Weights are stored [local_experts, n, k] with k contiguous (an ``nn.Linear`` weight per expert),
    which is the layout every backend here reads without a copy.
    """

    model: str
    gemm: str
    n: int
    k: int
    local_experts: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.gemm} [{self.local_experts} x {self.k}x{self.n}]"


def expert_shape(model: str) -> ExpertShape:
    """Look a model up in servescope's model catalog and return its routed-expert geometry.

    The catalog (``servescope.models``) is imported lazily so that this module stays importable while it
    is absent; a missing catalog is a ``ConfigError`` naming the way around it (explicit dimensions).
    """
    try:
        models = importlib.import_module("servescope.models")
    except ModuleNotFoundError as err:
        raise ConfigError(
            "the model catalog (servescope.models) is not available in this install; "
            "give the shape with --hidden, --expert-width and --experts instead"
        ) from err
    spec = models.get_model(model)  # raises UnknownNameError with suggestions
    experts = getattr(spec, "n_routed_experts", None) or 0
    width = getattr(spec, "moe_intermediate_size", None) or 0
    if experts <= 0 or width <= 0:
        raise ConfigError(f"model {model!r} has no routed experts (a dense model); kernels probes MoE expert GEMMs")
    top_k = getattr(spec, "top_k", None)
    name = getattr(spec, "name", None) or model
    return ExpertShape(name=name, hidden=int(spec.hidden_size), expert_width=int(width), experts=int(experts),
                       top_k=int(top_k) if top_k else None)


def tokens_per_expert_for_batch(batch_tokens: int, shape: ExpertShape) -> float:
    """Mean tokens each local expert sees when ``batch_tokens`` tokens are routed top-k with balanced load.

    Each token picks ``top_k`` of ``experts``; across the EP group the ``batch_tokens * top_k`` assignments
    spread evenly over all experts, so one expert gets ``batch_tokens * top_k / experts``. EP does not change
    the per-expert count, only how many experts one GPU holds. This links a server's concurrency to the x axis
    of every kernel curve.
    """
    if shape.top_k is None:
        raise ConfigError(f"{shape.name}: top_k unknown; cannot convert a batch size to tokens per expert")
    return batch_tokens * shape.top_k / shape.experts
