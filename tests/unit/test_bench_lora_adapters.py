"""`s2d bench lora --adapter`: the real adapters given come first, then seeded noisy copies of them (another adapter
of the same shapes, readable by the serving reader), and a directory that is no peft adapter is refused by name."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file

from core_fixtures import tiny_target
from helpers import save_random_lora
from s2d_ray.bench.lora import adapters
from s2d_ray.models.adapters import read_peft_adapter


def test_given_adapters_then_noisy_copies_of_them(tmp_path):
    base = tiny_target(seed=0)
    real = [save_random_lora(base, tmp_path / "x", seed=1), save_random_lora(base, tmp_path / "y", seed=2, r=2)]
    args = argparse.Namespace(adapter=[str(p) for p in real], rank=8, scale=0.002)
    paths = adapters(base, tmp_path / "bench", 5, args)
    assert paths[:2] == [p.resolve() for p in real]
    for copy, src in zip(paths[2:], [real[0], real[1], real[0]]):
        got, want = (load_file(str(p / "adapter_model.safetensors")) for p in (copy, src))
        assert got.keys() == want.keys() and all(got[k].shape == want[k].shape for k in got)
        assert not all(torch.equal(got[k], want[k]) for k in got)  # a different adapter, not the same one again
        assert read_peft_adapter(copy).rank == read_peft_adapter(src).rank
    first, third = (load_file(str(p / "adapter_model.safetensors")) for p in (paths[2], paths[4]))
    assert not all(torch.equal(first[k], third[k]) for k in first)  # two copies of x differ by their seeds


def test_a_directory_without_an_adapter_is_refused(tmp_path):
    args = argparse.Namespace(adapter=[str(tmp_path)], rank=8, scale=0.002)
    with pytest.raises(ValueError, match="not a peft adapter directory"):
        adapters(tiny_target(seed=0), tmp_path / "bench", 2, args)
