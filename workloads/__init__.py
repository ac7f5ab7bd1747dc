"""Workloads that produce real torch.profiler traces for trace_roofline.

The only package of the project that imports torch, and only inside the modules that need it
(`workloads.cli` stays importable without torch so `trace-roofline --help` works anywhere).

- `layer`: a Qwen2 decoder layer (HF architecture, random seeded weights, static KV cache).
- `reference`: an independent float32 computation of the same layer, for correctness checks.
- `runner`: profile decode/prefill steps and export a gzipped Chrome trace.
- `sweep`: the M-knob GEMM lab (CUDA events, medians) plus its profiled trace.
- `calibrate`: measured copy bandwidth and matmul peaks as a hardware JSON.
- `hf_capture`: unannotated fixtures from HF transformers' Qwen2ForCausalLM.
"""
