"""GPU and server telemetry on the run clock.

- ``nvml``: the only module that imports pynvml; probes counters, converts units, maps errors.
- ``fake_nvml``: the recorder of real NVML responses and the fake that replays them (tests, CPU machines).
- ``sampler``: the background NVML sampler (``gpu_samples.csv``) and zeus-style measurement windows.
- ``prometheus``: scrapers of inference-server ``/metrics`` (vLLM, sglang) and DCGM exporters.
- ``session``: ``TelemetryConfig`` and ``TelemetrySession``, which run all of the above around a benchmark.
- ``timeline``: ``summarize(run)``, per point and per GPU, a pure function of the run directory.

See ``docs/telemetry.md``.
"""
