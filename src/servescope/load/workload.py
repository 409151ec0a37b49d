"""Prompts: built before a sweep point starts, so no tokenisation ever runs on the hot path.

(inference-perf#648: tokenising on the event loop capped a client at 1.47 req/s.)

Datasets, by ``--dataset``:
- ``random``: prompts of an exact token length made from random token IDs of the
  tokenizer's vocabulary (special tokens excluded; when the vocabulary has enough of them,
  only space-led whole-word tokens, which re-encode to themselves), decoded to text and
  re-encoded until the length is exact (vLLM aligns its random prompts the same way); for sglang's native
  API the IDs themselves are sent, so the length is exact by construction. Needs a
  tokenizer: ``--tokenizer PATH`` (a local Hugging Face tokenizer) or a server offering
  vLLM-style ``/tokenize`` and ``/detokenize`` (then random words are cut to length).
- ``text:PROMPT``: the same prompt every time.
- ``sharegpt:PATH``: ShareGPT-format JSON (first human turn is the prompt; with no
  ``--output-len`` the answer's token length, which needs a tokenizer).
- ``jsonl:PATH``: one prompt per line, ``{"prompt": ..., "output_len": ...}`` or a JSON string.

Length ranges, named explicitly because the two peers disagree (sglang#7253):
- ``sglang:R`` draws from [max(1, L*R), L] (sglang's ``--random-range-ratio``; its default
  R=0 means lengths from 1 to L, mean ~L/2);
- ``vllm:R`` draws from [L(1-R), L(1+R)] (vLLM's ``--random-range-ratio``; default fixed).
Everything is deterministic for a given ``--seed``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from servescope.errors import ConfigError, TargetError
from servescope.load.backends import Prompt

log = logging.getLogger(__name__)

RANGE_CONVENTIONS = ("fixed", "sglang", "vllm")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A Hugging Face tokenizer from a local directory (``transformers.AutoTokenizer``)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer  # heavy import: only when asked for
        except ImportError as err:
            raise ConfigError("--tokenizer needs the 'transformers' package; pip install transformers") from err
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"--tokenizer {path}: no such directory; pass a local Hugging Face tokenizer folder")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(p))
        except (OSError, ValueError) as err:
            raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer there ({err})") from err
        special = set(self._tok.all_special_ids or ())
        ids = [i for i in range(len(self._tok)) if i not in special]
        self.allowed_ids = _stable_ids(self, ids) or ids
        self.name = str(p)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


#: Fewer stable word tokens than this and random prompts draw from the whole vocabulary.
MIN_STABLE_TOKENS = 64


def _stable_ids(tok: Tokenizer, ids: list[int]) -> list[int]:
    """Token IDs that decode to one space-led word and re-encode to themselves.

    Random IDs from a byte-level BPE vocabulary decode to byte soup that re-encodes to a
    different length; a sequence of space-led whole-word tokens re-encodes to exactly the
    same IDs (the pre-tokenizer splits at each space), so prompt lengths are exact.
    """
    out = []
    for i in ids:
        s = tok.decode([i])
        if len(s) > 1 and s[0] == " " and s[1:].isalpha() and tok.encode(s) == [i]:
            out.append(i)
    return out if len(out) >= MIN_STABLE_TOKENS else []


class ServerTokenizer:
    """The server's own ``/tokenize`` + ``/detokenize`` (vLLM, sglang): exact for that server."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key
        self.timeout_s = timeout_s
        self.allowed_ids: list[int] | None = None
        self.name = f"{self.base_url}/tokenize"

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                out = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise TargetError(self.base_url + path, f"tokenizer call failed ({err})") from err
        if not isinstance(out, dict):
            raise TargetError(self.base_url + path, "tokenizer reply is not a JSON object")
        return out

    def available(self) -> bool:
        try:
            return isinstance(self.encode("hello"), list)
        except TargetError:
            return False

    def encode(self, text: str) -> list[int]:
        out = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        toks = out.get("tokens")
        if not isinstance(toks, list):
            raise TargetError(self.base_url + "/tokenize", "reply has no 'tokens' list")
        return [int(t) for t in toks]

    def decode(self, ids: list[int]) -> str:
        out = self._post("/detokenize", {"model": self.model, "tokens": ids})
        text = out.get("prompt", out.get("text"))
        if not isinstance(text, str):
            raise TargetError(self.base_url + "/detokenize", "reply has no 'prompt' text")
        return text


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What to send. ``range_ratio`` applies to input and output lengths, as in both peers."""

    dataset: str = "random"
    input_len: int = 128
    output_len: int | None = 128
    range_convention: str = "fixed"
    range_ratio: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        kind = self.dataset.split(":", 1)[0]
        if kind not in ("random", "text", "sharegpt", "jsonl"):
            raise ConfigError(f"--dataset {self.dataset!r}: use random, text:PROMPT, sharegpt:PATH or jsonl:PATH")
        if kind in ("text", "sharegpt", "jsonl") and ":" not in self.dataset:
            raise ConfigError(f"--dataset {kind} needs a value: {kind}:...")
        if self.range_convention not in RANGE_CONVENTIONS:
            raise ConfigError(f"range convention {self.range_convention!r}: use sglang:R or vllm:R")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ConfigError(f"range ratio {self.range_ratio} must be within [0, 1]")
        if self.input_len < 1:
            raise ConfigError("--input-len must be >= 1")
        if self.output_len is not None and self.output_len < 1:
            raise ConfigError("--output-len must be >= 1")


def parse_range(spec: str | None) -> tuple[str, float]:
    """``"sglang:0.5"`` -> ("sglang", 0.5); None -> ("fixed", 0.0)."""
    if not spec:
        return "fixed", 0.0
    conv, _, ratio = spec.partition(":")
    if conv not in ("sglang", "vllm") or not ratio:
        raise ConfigError(f"--range {spec!r}: write sglang:R (lengths in [L*R, L]) or vllm:R ([L(1-R), L(1+R)])")
    try:
        r = float(ratio)
    except ValueError as err:
        raise ConfigError(f"--range {spec!r}: {ratio!r} is not a number") from err
    return conv, r


def draw_length(rng: random.Random, length: int, convention: str, ratio: float) -> int:
    """One length under the named convention (see module docstring)."""
    if convention == "sglang" and ratio < 1.0:
        return rng.randint(max(1, int(length * ratio)), length)
    if convention == "vllm" and ratio > 0.0:
        lo = max(1, math.floor(length * (1 - ratio)))
        hi = max(lo, math.ceil(length * (1 + ratio)))
        return rng.randint(lo, hi)
    return length


def _exact_text(tok: Tokenizer, rng: random.Random, ids: list[int], length: int,
                allowed: list[int] | None) -> tuple[str, int]:
    """Decode ``ids`` and trim/extend until re-encoding gives exactly ``length`` tokens."""
    text = tok.decode(ids)
    n = len(ids)
    for _ in range(8):
        re_ids = tok.encode(text)
        n = len(re_ids)
        if n == length:
            return text, n
        if n > length:
            text = tok.decode(re_ids[:length])
        else:
            extra = rng.choices(allowed, k=length - n) if allowed else []
            text = text + " " + " ".join(_words(rng, length - n)) if not extra else tok.decode(re_ids + extra)
    return text, n


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choices(_LETTERS, k=rng.randint(2, 7))) for _ in range(n)]


def make_prompts(cfg: WorkloadConfig, n: int, tokenizer: Tokenizer | None, want_ids: bool = False) -> list[Prompt]:
    """``n`` prompts for the workload, deterministic for ``cfg.seed`` (cycled if the source is shorter)."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    kind, _, arg = cfg.dataset.partition(":")
    if kind == "random":
        return _random_prompts(cfg, n, tokenizer, rng, want_ids)
    if kind == "text":
        out_len = _need_output_len(cfg)
        pt = len(tokenizer.encode(arg)) if tokenizer else None
        return [Prompt(arg, draw_length(rng, out_len, cfg.range_convention, cfg.range_ratio), pt) for _ in range(n)]
    base = _sharegpt(Path(arg), cfg, tokenizer, rng) if kind == "sharegpt" else _jsonl(Path(arg), cfg, tokenizer, rng)
    if not base:
        raise ConfigError(f"--dataset {cfg.dataset}: no usable prompts in the file")
    return [base[i % len(base)] for i in range(n)]


def _need_output_len(cfg: WorkloadConfig) -> int:
    if cfg.output_len is None:
        raise ConfigError(f"--dataset {cfg.dataset.split(':', 1)[0]} needs --output-len")
    return cfg.output_len


def _random_prompts(cfg: WorkloadConfig, n: int, tokenizer: Tokenizer | None, rng: random.Random,
                    want_ids: bool) -> list[Prompt]:
    if tokenizer is None:
        raise ConfigError("random prompts of exact token length need a tokenizer: pass --tokenizer PATH "
                          "(a local Hugging Face tokenizer folder) or use a server that offers /tokenize")
    out_len = _need_output_len(cfg)
    allowed = getattr(tokenizer, "allowed_ids", None)
    prompts: list[Prompt] = []
    inexact = 0
    for _ in range(n):
        length = draw_length(rng, cfg.input_len, cfg.range_convention, cfg.range_ratio)
        olen = draw_length(rng, out_len, cfg.range_convention, cfg.range_ratio)
        if allowed:
            ids = rng.choices(allowed, k=length)
            if want_ids:
                prompts.append(Prompt(tokenizer.decode(ids), olen, length, tuple(ids)))
                continue
            text, got = _exact_text(tokenizer, rng, ids, length, allowed)
        else:
            text, got = _from_words(tokenizer, rng, length)
        inexact += got != length
        prompts.append(Prompt(text, olen, got))
    if inexact:
        log.warning("%d of %d random prompts could not be made exactly the asked length", inexact, n)
    return prompts


def _from_words(tok: Tokenizer, rng: random.Random, length: int) -> tuple[str, int]:
    """Random words, tokenised by the server, cut to ``length`` tokens and checked."""
    text = " ".join(_words(rng, length))
    ids = tok.encode(text)
    while len(ids) < length:
        text += " " + " ".join(_words(rng, length - len(ids)))
        ids = tok.encode(text)
    return _exact_text(tok, rng, ids[:length], length, None)


def _sharegpt(path: Path, cfg: WorkloadConfig, tok: Tokenizer | None, rng: random.Random) -> list[Prompt]:
    data = _load_json(path)
    if not isinstance(data, list):
        raise ConfigError(f"{path}: a ShareGPT file is a JSON list of conversations")
    out: list[Prompt] = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") if isinstance(item, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, answer = str(first.get("value", "")), str(second.get("value", ""))
        if not prompt:
            continue
        if cfg.output_len is not None:
            olen = cfg.output_len
        elif tok is not None:
            olen = max(1, len(tok.encode(answer)))
        else:
            raise ConfigError("--dataset sharegpt without --output-len needs --tokenizer to size each answer")
        out.append(Prompt(prompt, olen, len(tok.encode(prompt)) if tok else None))
    rng.shuffle(out)
    return out


def _jsonl(path: Path, cfg: WorkloadConfig, tok: Tokenizer | None, rng: random.Random) -> list[Prompt]:
    if not path.is_file():
        raise ConfigError(f"--dataset jsonl:{path}: no such file")
    out: list[Prompt] = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{path}:{i}: not JSON ({err})") from err
        if isinstance(obj, str):
            prompt, olen = obj, None
        elif isinstance(obj, dict) and isinstance(obj.get("prompt", obj.get("text")), str):
            prompt = obj.get("prompt", obj.get("text"))
            olen = obj.get("output_len", obj.get("max_tokens"))
        else:
            raise ConfigError(f"{path}:{i}: expected a string or an object with 'prompt'")
        if olen is None:
            olen = _need_output_len(cfg)
        out.append(Prompt(prompt, int(olen), len(tok.encode(prompt)) if tok else None))
    return out


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from err
