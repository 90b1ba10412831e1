"""Benchmarks on one harness: the seed-table bench, the queue-delay tuner, chaos, the stack comparison, Locust.

No extra is checked here: loadtest/gpu/ runs on a bare GPU host with numpy only. Each entry point
checks the `loadtest` extra itself (bge_triton.extras.require names what to install).
"""
