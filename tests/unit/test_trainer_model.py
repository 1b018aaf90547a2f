"""trainer.model: parameter counts of the named shapes, GQA, RoPE, init, causality."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from trainer.digest import digest_tensors
from trainer.model import Transformer, apply_rope, rope_tables
from trainer.shapes import SHAPES, ModelShape


def meta_model(shape: ModelShape) -> Transformer:
    with torch.device("meta"):
        return Transformer(shape, rope_len=16)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_count_matches_the_formula(name: str) -> None:
    assert meta_model(SHAPES[name]).parameter_count() == SHAPES[name].parameter_count()


def test_published_sizes() -> None:
    # Llama 2 7B is "6.74 B" and Llama 3.1 8B "8.03 B" in Meta's model cards.
    assert meta_model(SHAPES["llama2-7b"]).parameter_count() == 6_738_415_616
    assert meta_model(SHAPES["llama3.1-8b"]).parameter_count() == 8_030_261_248
    assert round(SHAPES["llama2-70b"].parameter_count() / 1e9, 1) == 69.0


def test_fused_projections_and_gqa_shapes() -> None:
    model = meta_model(SHAPES["llama3.1-8b"])
    block = model.blocks()[0]
    # 32 query heads + 2 x 8 kv heads, 128 wide each.
    assert block.attn.qkv.weight.shape == (4096 + 2 * 1024, 4096)
    assert block.attn.out.weight.shape == (4096, 4096)
    assert block.mlp.gate_up.weight.shape == (2 * 14336, 4096)
    assert block.mlp.down.weight.shape == (4096, 14336)
    assert model.output.weight is not model.embed.weight  # untied head


def test_gqa_attention_equals_attention_with_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 8, 16
    q = torch.randn(batch, heads, seq, dim)
    k = torch.randn(batch, kv_heads, seq, dim)
    v = torch.randn(batch, kv_heads, seq, dim)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeat = heads // kv_heads
    expanded = F.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1),
        is_causal=True)
    torch.testing.assert_close(grouped, expanded)


def test_rope_scores_depend_only_on_relative_position() -> None:
    torch.manual_seed(0)
    dim, length = 16, 32
    cos, sin = rope_tables(length, dim, theta=10000.0)
    q, k = torch.randn(dim), torch.randn(dim)
    # The same vectors at every position: (1, 1, length, dim).
    qs = apply_rope(q.expand(1, 1, length, dim), cos, sin)[0, 0]
    ks = apply_rope(k.expand(1, 1, length, dim), cos, sin)[0, 0]
    scores = qs @ ks.T  # scores[m, n] = <q at m, k at n>
    for offset in (0, 3, 11):
        diagonal = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), atol=1e-4,
                                   rtol=1e-4)
    # A rotation: lengths are kept, and position 0 is left as it was.
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(length))
    torch.testing.assert_close(qs[0], q)


def test_scaled_init_of_residual_output_projections() -> None:
    shape = dataclasses.replace(SHAPES["tiny"], hidden_size=256, intermediate_size=512,
                                n_layers=8, n_heads=4, n_kv_heads=2)
    model = Transformer(shape, rope_len=8)
    model.init_weights(seed=3)
    scaled = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks():
        assert block.attn.out.weight.std().item() == pytest.approx(scaled, rel=0.05)
        assert block.mlp.down.weight.std().item() == pytest.approx(scaled, rel=0.05)
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert block.mlp.gate_up.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert torch.all(block.attn_norm.weight == 1)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_init_depends_only_on_the_seed() -> None:
    def digest(seed: int) -> str:
        model = Transformer(SHAPES["tiny"], rope_len=8)
        model.init_weights(seed)
        return digest_tensors(sorted(model.state_dict().items()))

    assert digest(1) == digest(1)
    assert digest(1) != digest(2)


def test_meta_model_materializes_like_an_eager_one() -> None:
    eager = Transformer(SHAPES["tiny"], rope_len=16)
    eager.init_weights(5)
    lazy = meta_model(SHAPES["tiny"])
    lazy.to_empty(device="cpu")
    lazy.init_weights(5)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(lazy(tokens), eager(tokens), rtol=0, atol=0)


def test_forward_is_causal() -> None:
    model = Transformer(SHAPES["tiny"], rope_len=16)
    model.init_weights(0)
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (1, 16, 256)
    torch.testing.assert_close(logits[:, :10], logits_changed[:, :10])
    assert not torch.allclose(logits[:, 10:], logits_changed[:, 10:])


@pytest.mark.parametrize(("mode", "runs_per_block"), [("none", [1, 1]), ("selective", [2, 1]), ("full", [2, 2])])
def test_activation_checkpointing_recomputes_the_chosen_blocks_in_the_backward_pass(
        mode: str, runs_per_block: list[int]) -> None:
    """Each block's body runs once in the forward pass, and once more in the backward pass
    where it is checkpointed; the gradients are the same either way."""
    def grads_and_runs(mode: str) -> tuple[list[torch.Tensor], list[int]]:
        model = Transformer(SHAPES["tiny"], rope_len=16)
        model.init_weights(seed=3)
        model.prepare_blocks(activation_checkpointing=mode, compile=False)
        runs = [0] * len(model.blocks())
        for i, block in enumerate(model.blocks()):
            body = block._forward

            def counted(*args: torch.Tensor, i: int = i, body=body) -> torch.Tensor:  # type: ignore[no-untyped-def]
                runs[i] += 1
                return body(*args)

            block._forward = counted  # type: ignore[method-assign]
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        return [p.grad for p in model.parameters()], runs  # type: ignore[misc]

    grads, runs = grads_and_runs(mode)
    assert runs == runs_per_block
    plain, _ = grads_and_runs("none")
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))


def test_compile_wraps_each_block_not_the_whole_model() -> None:
    """Where compile is applied (the blocks, as FSDP2 wraps each); that the compiled blocks
    run and learn what the plain ones do is tests/integration/test_trainer_options.py's."""
    model = meta_model(SHAPES["tiny"])
    model.prepare_blocks(activation_checkpointing="none", compile=True)
    assert all(block._compiled_call_impl is not None for block in model.blocks())
    assert model._compiled_call_impl is None  # the blocks, not the whole model (FSDP2 wraps each)
