"""Run ``transformers serve`` with a wider request schema: ``python -m servescope.engine.hf_serve_entry [ARGS]``.

``transformers serve`` (5.24.0) answers HTTP 422 to any request field it does not know
(``BaseHandler._validate_request`` in ``transformers/cli/serving/utils.py`` checks the body's keys against the OpenAI
params TypedDict of each endpoint). sglang's and vLLM's benchmark clients always send ``ignore_eos`` and often
``min_tokens`` and other extras, so they cannot drive the stock server. This entry point patches, in this process only,
before the real CLI starts:

1. ``BaseHandler._validate_request``: fields outside the endpoint's schema are *ignored* (logged once per name)
   instead of rejected; the stock check still runs on the known fields, so wrong types of known fields still fail.
2. ``_build_generation_config`` of the completions, chat-completions and responses handlers: ``ignore_eos: true`` is
   honoured (under continuous batching the request's ``eos_token_id`` becomes -1, CB's own "no EOS" value, which is
   passed per request to ``add_request``; without CB ``min_new_tokens`` is set to ``max_new_tokens``).
   ``min_tokens`` is honoured without CB only (CB takes no per-request logits processors) and ignored with it.
3. With ``--served-model-name NAME`` (our flag, consumed here), requests may name the model ``NAME`` instead of the
   model path the server is pinned to, and ``/v1/models`` and replies use ``NAME``, as vLLM's flag of that name does.

All other arguments go unchanged to ``transformers serve``. The patch targets 5.24.0's names and fails loudly (exit 3,
one line on stderr) if they are missing, so a transformers upgrade cannot silently restore the 422s.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger("servescope.engine.hf_serve_entry")

# Exit status when the installed transformers does not have the functions we patch.
EXIT_PATCH_FAILED = 3
SERVED_NAME_FLAG = "--served-model-name"
# Extra fields the patch acts on (see the module docstring); every other unknown field is accepted and ignored.
HONOURED_FIELDS = frozenset({"ignore_eos", "min_tokens"})


def split_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Take our own ``--served-model-name`` out of ``argv``; the rest is for ``transformers serve``."""
    served: str | None = None
    rest: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        arg = items[i]
        if arg == SERVED_NAME_FLAG and i + 1 < len(items):
            served = items[i + 1]
            i += 2
            continue
        if arg.startswith(SERVED_NAME_FLAG + "="):
            served = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return served, rest


def install_patches(served_model_name: str | None = None) -> None:
    """Patch transformers' serving handlers in this process (module docstring); raises AttributeError if absent."""
    from transformers.cli.serving import chat_completion, completion, model_manager, response, utils

    base = utils.BaseHandler
    original_validate = base._validate_request
    warned: set[str] = set()

    def _validate_request(self: Any, body: dict) -> None:
        allowed = set(getattr(self._valid_params_class, "__mutable_keys__", set())) | set(self._unused_fields)
        extra = [key for key in body if key not in allowed] if self._valid_params_class is not None else []
        for key in extra:
            if key not in warned:
                warned.add(key)
                what = "honoured by servescope's patch" if key in HONOURED_FIELDS else "ignored"
                logger.warning("servescope: accepting request field %r outside transformers' schema (%s)", key, what)
        original_validate(self, {k: v for k, v in body.items() if k not in extra})

    base._validate_request = _validate_request

    for handler_cls in (completion.CompletionHandler, chat_completion.ChatCompletionHandler, response.ResponseHandler):
        handler_cls._build_generation_config = _with_eos_options(handler_cls._build_generation_config)

    if served_model_name:
        _install_served_name(base, model_manager.ModelManager, served_model_name)


def _with_eos_options(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a handler's ``_build_generation_config`` so ``ignore_eos`` / ``min_tokens`` take effect."""

    def _build_generation_config(self: Any, body: dict, model_generation_config: Any, use_cb: bool = False) -> Any:
        config = original(self, body, model_generation_config, use_cb=use_cb)
        if body.get("ignore_eos"):
            if use_cb:
                config.eos_token_id = -1  # CB: -1 disables the EOS check for this request (requests.py)
            else:
                config.min_new_tokens = config.max_new_tokens
        min_tokens = body.get("min_tokens")
        if min_tokens and not use_cb:
            config.min_new_tokens = max(int(min_tokens), config.min_new_tokens or 0)
        return config

    return _build_generation_config


def _install_served_name(base: Any, manager_cls: Any, served: str) -> None:
    original_resolve = base._resolve_model
    original_list = manager_cls.list_models

    def _resolve_model(self: Any, body: dict) -> Any:
        forced = self.model_manager.force_model
        if forced is not None and body.get("model") == served:
            body["model"] = forced
        _model_id, model, processor = original_resolve(self, body)
        return served, model, processor

    def list_models(self: Any, cache_dir: str | None = None) -> list[dict]:
        entries = original_list(self, cache_dir)
        if self.force_model is not None:
            for entry in entries:
                if entry.get("id") == self.force_model:
                    entry["id"] = served
        return entries

    base._resolve_model = _resolve_model
    manager_cls.list_models = list_models


def main(argv: Sequence[str] | None = None) -> int:
    """Patch, then run ``transformers serve`` with the remaining arguments (blocks until the server exits)."""
    served, rest = split_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        install_patches(served)
    except (ImportError, AttributeError) as err:
        sys.stderr.write(f"servescope: cannot patch transformers serve ({err}); needs transformers[serving]==5.24.0\n")
        return EXIT_PATCH_FAILED
    # The CLI's own main() first checks PyPI for a newer version; calling its typer app directly skips that.
    from transformers.cli.transformers import app

    app(args=["serve", *rest], prog_name="transformers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
