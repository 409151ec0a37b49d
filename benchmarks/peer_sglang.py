"""Run sglang's own ``bench_serving`` offline and keep each request's start time (run with sglang's venv python).

sglang's package ``__init__`` imports torch, triton and more; the benchmark needs none of it.
We register empty parent packages (shared/reference/local-engine.md) and stub the one
torch-importing module it takes a constant from, then run ``sglang.benchmark.serving``
unchanged. Its request functions are wrapped (per request, never per chunk) to save
``start_time`` (its ``time.perf_counter()``, CLOCK_MONOTONIC on Linux), ``ttft``, ``itl`` and
``generated_text`` to ``--servescope-out``: with the selftest server's stamps in the text,
that gives each chunk's added delay as sglang saw it.

    /work/peers/sglang/bin/python benchmarks/peer_sglang.py --servescope-out X.json -- <bench_serving args>
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path


def _register_empty_packages() -> None:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    root = Path(spec.submodule_search_locations[0])  # type: ignore[index, union-attr]
    for name, sub in (("sglang", ""), ("sglang.srt", "srt"), ("sglang.srt.utils", "srt/utils"),
                      ("sglang.srt.disaggregation", "srt/disaggregation")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / sub) if sub else str(root)]
        sys.modules[name] = mod
    stub = types.ModuleType("sglang.srt.disaggregation.utils")
    stub.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # the constant serving.py imports (sglang/srt/disaggregation/utils.py)
    sys.modules[stub.__name__] = stub
    try:
        import datasets  # noqa: F401  (only sglang's MMMU loader uses it)
    except ImportError:
        ds = types.ModuleType("datasets")

        def load_dataset(*a: object, **kw: object) -> None:
            raise RuntimeError("HF datasets are not available offline")

        ds.load_dataset = load_dataset  # type: ignore[attr-defined]
        sys.modules["datasets"] = ds


def main() -> None:
    argv = sys.argv[1:]
    out = Path(argv[argv.index("--servescope-out") + 1])
    rest = argv[argv.index("--") + 1 :]
    _register_empty_packages()
    import sglang.benchmark.serving as serving

    captured: list[dict] = []

    def wrap(fn):
        async def inner(*a, **kw):
            o = await fn(*a, **kw)
            captured.append({"start_time": o.start_time, "ttft": o.ttft, "itl": list(o.itl),
                             "generated_text": o.generated_text, "success": o.success, "error": o.error[:300]})
            return o

        return inner

    for k, fn in list(serving.ASYNC_REQUEST_FUNCS.items()):
        serving.ASYNC_REQUEST_FUNCS[k] = wrap(fn)
    sys.argv = ["bench_serving", *rest]
    try:
        serving.cli_main()
    finally:
        out.write_text(json.dumps(captured))


if __name__ == "__main__":
    main()
