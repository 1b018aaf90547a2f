"""The model digest: one sha256 that identifies a model's exact weights.

Two runs end with equal digests exactly when every persistent tensor of their models is
bit-identical (same names, dtypes, shapes and bytes). The supervisor and the tests use
it to prove that a resumed run ended where a fault-free run would have.

Canonical form, for each entry of the model's state dict in sorted name order::

    name  NUL  dtype (e.g. "torch.float32")  NUL  shape ("64,176")  NUL  byte count  NUL
    the tensor's raw bytes, C-contiguous, in the host's byte order

Non-persistent buffers (the RoPE tables) are derived data and not included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def digest_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 (hex) of full, unsharded tensors; the caller supplies the sorted order."""
    h = hashlib.sha256()
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        shape = ",".join(str(d) for d in t.shape)
        h.update(f"{name}\0{t.dtype}\0{shape}\0{len(raw)}\0".encode())
        h.update(raw)
    return h.hexdigest()


def model_digest(model: nn.Module, *, is_main: bool) -> str | None:
    """The digest of a (possibly FSDP2-sharded) model; rank 0 gets it, others None.

    Collective: every rank must call it. Each sharded tensor is all-gathered one at a
    time, so the memory cost is one full tensor, not the whole model.
    """
    state = model.state_dict()

    def gathered() -> Iterable[tuple[str, torch.Tensor]]:
        for name in sorted(state):
            tensor = state[name]
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    if is_main:
        return digest_tensors(gathered())
    for _ in gathered():  # take part in each all-gather, discard the result
        pass
    return None
