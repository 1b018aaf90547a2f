"""trainer.digest: the canonical sha256 of a model's tensors."""

from __future__ import annotations

import hashlib

import torch

from trainer.digest import digest_tensors


def test_digest_is_the_documented_canonical_form() -> None:
    t = torch.tensor([[1.0, 2.0]], dtype=torch.float32)
    expected = hashlib.sha256(b"w\0torch.float32\x001,2\x008\0" + t.numpy().tobytes())
    assert digest_tensors([("w", t)]) == expected.hexdigest()


def test_digest_sees_every_bit_name_dtype_and_shape() -> None:
    base = [("a", torch.zeros(4)), ("b", torch.ones(2, 2))]
    reference = digest_tensors(base)
    assert digest_tensors([("a", torch.zeros(4)), ("b", torch.ones(2, 2))]) == reference
    flipped = torch.ones(2, 2)
    flipped[1, 1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert digest_tensors([("a", torch.zeros(4)), ("b", flipped)]) != reference
    assert digest_tensors([("a", torch.zeros(4)), ("c", torch.ones(2, 2))]) != reference
    assert digest_tensors([("a", torch.zeros(4)), ("b", torch.ones(4))]) != reference
    assert digest_tensors([("a", torch.zeros(4, dtype=torch.float64)),
                           ("b", torch.ones(2, 2))]) != reference


def test_digest_handles_bfloat16_and_non_contiguous_tensors() -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert digest_tensors([("t", t.T)]) == digest_tensors([("t", t.T.contiguous())])
    assert digest_tensors([("e", torch.empty(0))]) != digest_tensors([("e", torch.empty(1, 0))])
