"""A tiny random Qwen3-MoE model, built locally and cached, for the embedded engine.

No model hub is reachable from the machines servescope must run on, so the embedded engine serves a model built here:
a ``Qwen3MoeConfig`` with random weights (fixed seed) and a byte-level BPE tokenizer trained with the ``tokenizers``
library on a text shipped in the package (``servescope/data/tokenizer-corpus.txt``; Python's own sources would differ
between Python versions). Source for the recipe: ``shared/reference/local-engine.md``.

Exact output lengths. A random model samples an end-of-sequence token about once per vocabulary-size tokens, which
would make "N requests x output-len tokens" false. We make every special token (EOS, pad, chat markers) and every id the
tokenizer does not have *unsampleable in the weights*, so it holds in any engine (transformers, vLLM) and under greedy
or random sampling, without relying on per-request options:

- residual channel ``c`` (the last one) holds a constant ``K``: every embedding row has ``K`` there, and every layer's
  writes into the residual (``o_proj`` rows and expert ``down_proj`` rows for ``c``) are zero, so it stays ``K``;
- no layer reads it: the input/post-attention RMSNorm weights for ``c`` are zero (it still enlarges the RMS, which only
  rescales the other channels);
- the final norm keeps it, so after the norm channel ``c`` is ``K / rms > 0`` at every position;
- only the suppressed lm_head rows read it, with weight ``-SUPPRESS_WEIGHT``; all other rows have 0 there.

With ``K = 1`` and hidden 128 the suppressed logits sit near ``-100 * 11 = -1100``; ordinary logits are within about
+-1 of 0, so ``exp`` of the difference is 0 even in bf16. ``build_tiny_moe`` checks this on a forward pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from servescope.errors import EngineError

logger = logging.getLogger(__name__)

# Bump when the builder's output changes for the same spec (weights, tokenizer, files): it is part of the cache key.
BUILDER_VERSION = 1

# The residual value and lm_head weight of the suppression channel (see the module docstring).
SUPPRESS_RESIDUAL = 1.0
SUPPRESS_WEIGHT = 100.0
# A forward-pass check fails the build if a suppressed logit is not at least this far below the best logit.
MIN_SUPPRESSION_MARGIN = 50.0

# Special tokens, in id order (ids 0, 1, 2). Qwen's names, so chat templates and engines recognise them.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# A ChatML template (Qwen's format, without tools or thinking) so /v1/chat/completions works.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS_RESOURCE = "tokenizer-corpus.txt"
MARKER_FILE = "servescope-model.json"
ENV_CACHE = "SERVESCOPE_CACHE"


@dataclass(frozen=True, slots=True)
class TinyMoeSpec:
    """Shape of the random Qwen3-MoE model. Hashable: the cache key is derived from it.

    The defaults are the CPU model of ``local-engine.md`` (hidden 128, 2 layers, 8 experts, top-2, vocab 4096, ~6 MB):
    it builds in seconds and serves ~1,000 tok/s on 2 cores. ``TinyMoeSpec.gpu()`` is for ``--device cuda``.
    """

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    # Dense MLP width: unused by Qwen3-MoE unless some layers are dense (decoder_sparse_step > 1), kept for the config.
    intermediate_size: int = 256
    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    # Saved weight dtype ("float32" on CPU: bf16 matmuls are slow there; "bfloat16" on GPU).
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.02
    name: str = "servescope-tiny-moe"
    # Where random init runs. Part of the spec (and the key) because CPU and CUDA random streams differ: the same spec
    # always gives the same weights. The GPU preset builds on the GPU (seconds there, minutes and ~30 GB on a CPU).
    build_device: str = "cpu"

    @classmethod
    def gpu(cls, num_hidden_layers: int = 8) -> TinyMoeSpec:
        """Qwen3-30B-A3B's per-layer shapes with fewer layers (48 in the real model), in bf16.

        Shapes from Qwen/Qwen3-30B-A3B ``config.json``: hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8,
        expert width 768, dense width 6144, 40,960 positions. The vocabulary stays at 151,936 rows so the lm_head GEMM
        costs what it does in the real model; ids the 4,096-token tokenizer lacks are unsampleable (module docstring).
        With 8 layers it is ~4.9B parameters (~10 GB), as in ``h200-measurements.md``.
        """
        return cls(
            hidden_size=2048,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            vocab_size=151_936,
            max_position_embeddings=40_960,
            dtype="bfloat16",
            name="servescope-qwen3-30b-a3b-shapes",
            build_device="cuda",
        )

    @property
    def tokenizer_vocab_size(self) -> int:
        """Tokens the BPE tokenizer is trained to (the model may have more rows; the rest are unsampleable)."""
        return min(self.vocab_size, 4096)

    def cache_key(self) -> str:
        """Hex digest over the spec, the builder version and the shipped corpus: a change in any rebuilds."""
        payload = {
            "spec": dataclasses.asdict(self),
            "builder_version": BUILDER_VERSION,
            "corpus_sha256": hashlib.sha256(_corpus_text().encode("utf-8")).hexdigest(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$SERVESCOPE_CACHE`` if set, else ``~/.cache/servescope/models``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "servescope" / "models"


def model_dir_for(spec: TinyMoeSpec, cache_dir: Path | None = None) -> Path:
    """Where ``build_tiny_moe`` puts (or finds) the model for ``spec``, without building it."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"{spec.name}-{spec.cache_key()}"


def build_tiny_moe(spec: TinyMoeSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Build the random model once and return its directory (a HF model folder ``transformers serve`` loads).

    Cached under ``cache_dir`` by ``spec.cache_key()``; a complete folder is reused as-is. The build happens in a
    temporary sibling folder that is renamed into place only when complete, so a crash or Ctrl-C never leaves a half
    model that a later run would trust. Random init runs on ``spec.build_device``; a CUDA build without a usable GPU
    raises ``EngineError``.
    """
    spec = spec if spec is not None else TinyMoeSpec()
    final = model_dir_for(spec, cache_dir)
    if (final / MARKER_FILE).is_file():
        logger.debug("tiny model cache hit: %s", final)
        return final
    if final.exists():
        # Not ours (no marker): refuse rather than delete a folder a user may care about.
        raise EngineError(f"{final} exists but is not a complete servescope model; remove it and retry")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise EngineError(
            f"cannot create model cache {final.parent}: {err}; set ${ENV_CACHE} to a writable folder"
        ) from err

    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    started_s = time.perf_counter()
    try:
        _build_into(spec, tmp, spec.build_device)
        marker = {
            "schema_version": 1,
            "builder_version": BUILDER_VERSION,
            "cache_key": spec.cache_key(),
            "spec": dataclasses.asdict(spec),
            "build_s": round(time.perf_counter() - started_s, 3),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same build first: theirs is as good as ours.
            if not (final / MARKER_FILE).is_file():
                raise
            logger.debug("tiny model built concurrently by another process: %s", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model %s in %.1f s", final, time.perf_counter() - started_s)
    return final


def suppressed_token_ids(model_dir: Path) -> list[int]:
    """Ids the model can never sample (from the build marker's spec): special tokens and ids beyond the tokenizer."""
    marker = json.loads((Path(model_dir) / MARKER_FILE).read_text(encoding="utf-8"))
    spec = TinyMoeSpec(**marker["spec"])
    return _suppressed_ids(spec)


def _suppressed_ids(spec: TinyMoeSpec) -> list[int]:
    return list(range(len(SPECIAL_TOKENS))) + list(range(spec.tokenizer_vocab_size, spec.vocab_size))


def _corpus_text() -> str:
    return resources.files("servescope").joinpath("data").joinpath(CORPUS_RESOURCE).read_text(encoding="utf-8")


def _build_into(spec: TinyMoeSpec, out_dir: Path, build_device: str) -> None:
    """Write config, weights, generation config and tokenizer into ``out_dir``."""
    try:
        with _hub_offline():
            import torch
            from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError as err:
        raise EngineError(
            f"the embedded engine needs torch and transformers ({err}); install with: pip install 'servescope[engine]'"
        ) from err

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(spec.dtype)
    if dtype is None:
        raise EngineError(f"unsupported dtype {spec.dtype!r} in TinyMoeSpec; use float32, bfloat16 or float16")
    try:
        device = torch.device(build_device)
    except RuntimeError as err:
        raise EngineError(f"bad build device {build_device!r} in TinyMoeSpec: {err}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(
            f"model {spec.name!r} is built on a GPU (build_device={build_device!r}) but torch sees none; "
            "use the CPU model (TinyMoeSpec()) or run on a GPU machine"
        )

    tokenizer = _train_tokenizer(spec, PreTrainedTokenizerFast)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)

    config = Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):  # no global RNG state leaks out of the build
        torch.manual_seed(spec.seed)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(spec.seed)
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
        model = model.to(dtype=dtype).eval()
        with torch.no_grad():
            _install_suppression(model, _suppressed_ids(spec))
            _check_suppression(model, spec, device)

    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, pad_id],
        pad_token_id=pad_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    model.config.name_or_path = spec.name
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` while huggingface_hub is first imported (it reads the variable then), restored after.

    Nothing the build calls downloads; this makes sure a stray hub call fails at once instead of waiting on a network.
    """
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def _train_tokenizer(spec: TinyMoeSpec, fast_cls: Any) -> Any:
    """Byte-level BPE trained on the shipped corpus to ``spec.tokenizer_vocab_size`` tokens (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.tokenizer_vocab_size,
        min_frequency=0,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_corpus_text()], trainer=trainer)
    if bpe.get_vocab_size() != spec.tokenizer_vocab_size:
        # The corpus is sized to reach 4096 tokens; fewer would leave model rows no text maps to.
        raise EngineError(
            f"tokenizer trained to {bpe.get_vocab_size()} tokens, expected {spec.tokenizer_vocab_size}; "
            "the shipped corpus is too small for this vocabulary (a servescope bug)"
        )
    tokenizer = fast_cls(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _install_suppression(model: Any, suppressed: list[int]) -> None:
    """Reserve the last residual channel as a constant read only by the suppressed lm_head rows (module docstring)."""
    c = model.config.hidden_size - 1
    inner = model.model
    inner.embed_tokens.weight[:, c] = SUPPRESS_RESIDUAL
    for layer in inner.layers:
        layer.input_layernorm.weight[c] = 0.0
        layer.post_attention_layernorm.weight[c] = 0.0
        layer.self_attn.o_proj.weight[c, :] = 0.0
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is not None and hasattr(experts, "down_proj") and not hasattr(experts, "__getitem__"):
            experts.down_proj[:, c, :] = 0.0  # fused [experts, hidden, width]
        elif experts is not None:
            for expert in experts:
                expert.down_proj.weight[c, :] = 0.0
        else:
            mlp.down_proj.weight[c, :] = 0.0  # a dense layer
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:
            shared.down_proj.weight[c, :] = 0.0
    inner.norm.weight[c] = 1.0
    head = model.lm_head.weight
    head[:, c] = 0.0
    head[suppressed, :] = 0.0
    # Wider models spread the RMS over more channels (and random layers grow the residual), so channel c
    # shrinks after the final norm roughly as 1/sqrt(hidden): scale the weight to keep the same margin.
    # For hidden 128 (the CPU preset) the factor is 1, so those weights are unchanged.
    head[suppressed, c] = -SUPPRESS_WEIGHT * max(1.0, (model.config.hidden_size / 128) ** 0.5)


def _check_suppression(model: Any, spec: TinyMoeSpec, device: Any) -> None:
    """Fail the build unless every suppressed logit is far below the best one on a random batch."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(spec.seed + 1)
    ids = torch.randint(len(SPECIAL_TOKENS), spec.tokenizer_vocab_size, (2, 16), generator=generator).to(device)
    logits = model(input_ids=ids).logits.float()
    suppressed = torch.tensor(_suppressed_ids(spec), device=logits.device)
    mask = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[suppressed] = False
    margin = (logits[..., mask].max(dim=-1).values - logits[..., suppressed].max(dim=-1).values).min().item()
    if not margin >= MIN_SUPPRESSION_MARGIN:
        raise EngineError(f"EOS suppression check failed (margin {margin:.1f} < {MIN_SUPPRESSION_MARGIN}); a bug")
