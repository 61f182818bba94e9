"""``attention.packed_gqa_sdpa``: the same attention as Transformers' ``sdpa``, without per-head K/V copies."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_dflash2 import speculative_generate
from hf_dflash2.attention import PACKED_GQA_SDPA, packed_gqa_attention, packed_gqa_sdpa, packs_gqa

from .conftest import tiny_drafter, tiny_target


class _Module(torch.nn.Module):
    """What the attention functions read off the calling layer."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _qkv(batch=2, query_heads=6, kv_heads=2, width=3, total=7, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, query_heads, width, dim, generator=generator)
    k = torch.randn(batch, kv_heads, total, dim, generator=generator)
    v = torch.randn(batch, kv_heads, total, dim, generator=generator)
    return q, k, v


@pytest.mark.parametrize("mask_kind", ["shared_bool", "per_head_bool", "additive", "broadcast_batch", "none_one_query"])
def test_packed_attention_equals_transformers_sdpa(mask_kind):
    """Every mask layout Transformers hands an attention function: the packed result is the same, per query
    head (a mask that differs per head and distinct K/V per group catch a wrong head-to-group order)."""
    width = 1 if mask_kind == "none_one_query" else 3
    q, k, v = _qkv(width=width)
    batch, heads, _, _ = q.shape
    total = k.shape[2]
    generator = torch.Generator().manual_seed(1)
    visible = torch.rand(batch, heads, width, total, generator=generator) > 0.3
    visible[..., -1] = True  # every query sees something
    mask = {
        "shared_bool": visible[:, :1],
        "per_head_bool": visible,
        "additive": torch.zeros(batch, 1, width, total).masked_fill(~visible[:, :1], torch.finfo(torch.float32).min),
        "broadcast_batch": visible[:1, :1],
        "none_one_query": None,
    }[mask_kind]
    module = _Module(groups=heads // k.shape[1])
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = packed_gqa_sdpa(module, q, k, v, mask, scaling=0.3)
    assert got.shape == expected.shape == (batch, width, heads, q.shape[-1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # a query of one group really reads that group's keys: swap the groups' K/V and the heads' outputs move
    swapped, _ = packed_gqa_sdpa(module, q, k.flip(1), v.flip(1), mask, scaling=0.3)
    assert not torch.allclose(swapped, expected, atol=1e-3)


def test_a_causal_prefill_without_a_mask_runs_transformers_sdpa():
    q, k, v = _qkv(width=7, total=7)
    module = _Module(groups=3)
    expected, _ = sdpa_attention_forward(module, q, k, v, None)
    got, _ = packed_gqa_sdpa(module, q, k, v, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_model_under_packed_attention_computes_what_it_computed_and_is_put_back():
    """A left-padded batch through a GQA model with a cache (prefill, then a 3-token verify): the same
    logits under the packed attention; the implementation is restored after the block, errors included."""
    target = tiny_target("llama")
    assert packs_gqa(target)
    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0

    def logits():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
        return target(input_ids=ids[:, 6:], attention_mask=mask, cache=cache, use_cache=True).logits

    with torch.no_grad():
        expected = logits()
        with packed_gqa_attention(target):
            assert target.config._attn_implementation == PACKED_GQA_SDPA
            got = logits()
    assert target.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="inside"):
        with packed_gqa_attention(target):
            raise RuntimeError("inside")
    assert target.config._attn_implementation == "sdpa"
    with packed_gqa_attention(target, enabled=False):
        assert target.config._attn_implementation == "sdpa"
    # no GQA, or not sdpa: nothing to pack, nothing switched
    assert not packs_gqa(tiny_target("llama", num_key_value_heads=4))
    eager = tiny_target("llama", attn_implementation="eager")
    with packed_gqa_attention(eager):
        assert eager.config._attn_implementation == "eager"


def test_the_fast_loop_runs_packed_attention_and_keeps_greedy_exact(monkeypatch):
    """The loop's forwards go through the packed function (counted), its text is plain greedy's, and the
    target is back on sdpa afterwards; ``packed_attention=False`` leaves the target on sdpa throughout."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[1].shape[2])  # query width
        return packed_gqa_sdpa(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_GQA_SDPA, counting)
    ids = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = speculative_generate(target, drafter, ids, max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    assert calls and any(width > 1 for width in calls)
    assert target.config._attn_implementation == "sdpa"
    calls.clear()
    with torch.no_grad():
        plain = speculative_generate(target, drafter, ids, max_new_tokens=24, packed_attention=False)
    assert calls == [] and torch.equal(plain.sequences, expected)


def test_plain_generate_can_run_on_the_packed_attention():
    """``set_attn_implementation(PACKED_GQA_SDPA)`` (what the README offers plain ``generate``) is accepted,
    gives greedy's text, and the fast loop keeps a target already on it as it is."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = target.generate(ids, max_new_tokens=16, do_sample=False)
        target.set_attn_implementation(PACKED_GQA_SDPA)
        assert target.config._attn_implementation == PACKED_GQA_SDPA
        assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False), expected)
        assert torch.equal(speculative_generate(target, drafter, ids, max_new_tokens=16).sequences, expected)
    assert target.config._attn_implementation == PACKED_GQA_SDPA
