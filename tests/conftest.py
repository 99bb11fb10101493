"""Shared fixtures: a tiny random Llama directory (fast tests) and the real SmolLM2 model (`real` tests)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# One intra-op thread: tiny tensors on a loaded machine otherwise pay milliseconds of OpenMP barrier waits per op,
# far more than the op itself. Real-model tests raise it where they need it.
torch.set_num_threads(1)

# Kernel timings measured under the suite's load stay out of the user's cache (kernels/timing_store.py): one file per
# run, inherited by the Ray workers the serve tests start.
os.environ.setdefault("S2D_KERNEL_TIMES", str(Path(tempfile.mkdtemp(prefix="s2d-kernel-times-")) / "times.json"))

# Tests import `helpers` and other modules in tests/ by plain name, whatever the pytest import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from helpers import save_tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Back to one thread before every test: a test that runs the CLI (set_threads: all cores) must not leave the
    next tests on several OpenMP threads, which on a loaded machine slows a seconds-long test to minutes."""
    torch.set_num_threads(1)


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    """A fresh HF directory with a tiny random LlamaForCausalLM + byte-level BPE tokenizer (vocab 320)."""
    return save_tiny_llama(tmp_path / "tiny-llama")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (converted once into $S2D_CACHE_DIR or ~/.cache/s2d_ray, then loaded as is)."""
    from s2d_ray.models import load_model

    return load_model("smollm2-135m-instruct")
