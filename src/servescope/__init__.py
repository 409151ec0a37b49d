"""servescope: tells why an LLM server's throughput plateaus below what its GPUs can do.

The package is layered so that data flows one way: ``load`` and ``telemetry`` write a
run directory (``run.py``), and the analysis modules (``roofline``, ``tiles``,
``diagnose``, ``report``) read it without ever talking to a server or to NVML.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
