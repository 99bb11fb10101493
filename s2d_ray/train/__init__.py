"""Training and calibration of sorted drafts: SoFT (sorted fine-tuning), self-distillation data, per-target profiles.

Kept out of `s2d_ray.core`: training needs data files and optimisers, the core engine needs neither.
"""
