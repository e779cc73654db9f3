"""Benchmarks, checks and data writers of lit_grpo; run each from the repository root as ``python -m tools.NAME``
(``tools.harness`` holds what they share)."""
