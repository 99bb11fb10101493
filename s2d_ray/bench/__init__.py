"""Benchmarks: Spec-Bench side by side with the baselines users would pick, per-step costs, and served load curves.

Every figure is a ratio against a baseline measured in the same run on the same prompts; the engine methods go
through `build_engine` (one decode loop), the baselines through plain transformers `generate`.
"""
