"""The embedded engine: a tiny random MoE model built locally, and a launcher for a real server that serves it.

- ``tiny_model``: ``TinyMoeSpec``, ``build_tiny_moe`` (cached, atomic, offline, EOS unsampleable).
- ``launcher``: ``EngineConfig``, ``start_engine`` (context manager yielding an ``EngineHandle``), ``stop_engine``.
- ``hf_serve_entry``: ``transformers serve`` with a request schema wide enough for benchmark clients.
- ``vllm``: how to start vLLM's OpenAI server.

Heavy imports (torch, transformers) happen only when a model is built or a server starts. See docs/engine.md.
"""
