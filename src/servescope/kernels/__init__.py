"""MoE expert GEMM probes on the local GPU, and servescope's own Triton decode kernel.

Pure modules (no torch, usable anywhere): ``shapes`` (model -> per-GPU GEMM shapes), ``cost`` (FLOPs, minimum
bytes, roofline), ``results`` (kernels.json / kernels.md), ``calibration`` (efficiency curves for the roofline),
``plots``. GPU modules, imported only after a GPU was found: ``probe`` (orchestration, timing, ceilings; its
``require_gpu`` is the gate), ``backends`` (torch-based backends and inputs), ``triton_moe`` (our kernel),
``nvml_window`` (power, clocks and GPM over a steady window). See docs/kernels.md.
"""
