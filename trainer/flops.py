"""Model FLOPs and device peaks, for model FLOPs utilization (MFU). Stdlib only.

MFU = (tokens per second x training FLOPs per token) / (ranks x peak FLOP/s per rank).

Training FLOPs per token follow the PaLM paper's count: ``6 N + 12 L d T``, where N is
the parameters that take part in matrix multiplies (every weight but the embedding
table, which is a lookup), L the layers, d the attention width (heads x head dim) and T
the sequence length; the second term is attention's score and value products (forward
and backward, causal masking not subtracted, as is the convention). Recomputed
activations (activation checkpointing) are not counted: MFU counts the model's work,
not the hardware's.

The peak is the device maker's stated dense peak for the compute dtype, per rank (one
GPU; the Neuron backend reports no MFU yet). A CPU has no stated peak; it is modelled as
threads x clock x FLOPs per cycle (two fused multiply-add units of the widest vector
extension the CPU has), which is optimistic, so a CPU's MFU reads low. ``peak_tflops``
in the config overrides all of this.
"""

from __future__ import annotations

from pathlib import Path

from trainer.shapes import ModelShape

# Stated dense peaks in TFLOP/s per device: (name fragment, bf16, fp32). The first
# fragment found in the device's name wins, so longer names come first. fp32 is the
# plain (non-tensor-core) rate.
_GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),  # SXM
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L40", 181.0, 90.5),
    ("A10G", 70.0, 31.2),
    ("L4", 121.0, 30.3),
)


def training_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Forward plus backward FLOPs per token (see the module docstring)."""
    matmul_params = shape.parameter_count() - shape.vocab_size * shape.hidden_size  # no embedding
    attention_width = shape.n_heads * shape.head_dim
    return 6.0 * matmul_params + 12.0 * shape.n_layers * attention_width * seq_len


def gpu_peak_tflops(device_name: str, dtype: str) -> float | None:
    """The stated peak of a GPU by its name (torch.cuda.get_device_name); None if unknown."""
    for fragment, bf16, fp32 in _GPU_PEAKS:
        if fragment in device_name:
            return bf16 if dtype == "bfloat16" else fp32
    return None


def cpu_peak_tflops(threads: int, cpuinfo: str | None = None) -> float | None:
    """A modelled fp32 peak for ``threads`` cores of this CPU (None if /proc/cpuinfo says
    too little): clock x FLOPs per cycle x threads."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    mhz = flags = None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "cpu MHz" and mhz is None:
            mhz = float(value)
        elif key == "flags" and flags is None:
            flags = set(value.split())
    if mhz is None or flags is None:
        return None
    # Two FMA units; an FMA is 2 FLOPs per fp32 lane: 512-bit = 16 lanes, 256-bit = 8, 128-bit = 4.
    lanes = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 4
    return threads * mhz * 1e6 * 2 * 2 * lanes / 1e12


def mfu(tokens_per_s: float, flops_per_token: float, ranks: int, peak_tflops_per_rank: float) -> float:
    """The fraction of the ranks' peak that the model's FLOPs used (NaN without a peak)."""
    if peak_tflops_per_rank <= 0 or ranks <= 0:
        return float("nan")
    return tokens_per_s * flops_per_token / (ranks * peak_tflops_per_rank * 1e12)
