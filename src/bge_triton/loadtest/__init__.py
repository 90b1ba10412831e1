"""Benchmarks on one harness (bge-triton bench / tune / chaos, Locust). No extra is checked here: loadtest/gpu/
runs on a bare GPU host with numpy only; each entry point checks the `loadtest` extra itself."""
