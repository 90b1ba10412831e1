"""Benchmarks on one harness (bge-triton bench / tune / chaos, Locust); each entry point checks its extra itself."""
