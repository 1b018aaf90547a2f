"""Model FLOPs and device peaks (trainer/flops.py), the inputs of MFU."""

from __future__ import annotations

import math

import pytest

from trainer import flops
from trainer.shapes import SHAPES


def test_training_flops_per_token_is_six_n_plus_attention() -> None:
    shape = SHAPES["llama2-7b"]
    n = shape.parameter_count() - shape.vocab_size * shape.hidden_size  # the embedding is a lookup
    per_token = flops.training_flops_per_token(shape, 4096)
    assert per_token == 6 * n + 12 * 32 * 4096 * 4096
    # About 6 x 6.7 B plus attention: the figure MFU papers use for Llama 2 7B at 4k tokens.
    assert 4.5e10 < per_token < 4.8e10


def test_stated_gpu_peaks_by_name_and_dtype() -> None:
    assert flops.gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert flops.gpu_peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert flops.gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    # A longer name is not taken for a shorter one it starts with.
    assert flops.gpu_peak_tflops("NVIDIA L40", "bfloat16") == 181.0
    assert flops.gpu_peak_tflops("NVIDIA L4", "bfloat16") == 121.0
    assert flops.gpu_peak_tflops("NVIDIA H100 NVL", "bfloat16") == 835.0
    assert flops.gpu_peak_tflops("Some Future GPU", "bfloat16") is None


def test_cpu_peak_is_modelled_from_clock_and_vector_width() -> None:
    avx512 = "processor\t: 0\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu avx2 fma avx512f\n"
    avx2 = "cpu MHz\t\t: 3000.0\nflags\t\t: fpu avx2 fma\n"
    assert flops.cpu_peak_tflops(1, avx512) == pytest.approx(2e9 * 2 * 2 * 16 / 1e12)
    assert flops.cpu_peak_tflops(2, avx2) == pytest.approx(2 * 3e9 * 2 * 2 * 8 / 1e12)
    assert flops.cpu_peak_tflops(1, "flags: sse2\n") is None  # no clock: unknown


def test_mfu() -> None:
    assert flops.mfu(1000.0, 1e9, 2, 1.0) == pytest.approx(0.5)
    assert math.isnan(flops.mfu(1000.0, 1e9, 2, 0.0))
