"""``attention.packed_gqa_sdpa``: the same attention as Transformers' ``sdpa``, without per-head K/V copies."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_dflash2 import speculative_generate
from hf_dflash2.cost_model_dflash2 import CostModel
from hf_dflash2.cpu.attention import (
    MAX_PACKED_QUERIES,
    PACKED_GQA_SDPA,
    packed_gqa_attention,
    packed_gqa_sdpa,
    packs_gqa,
)

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


def _spy_on_sdpa(monkeypatch) -> list[int]:
    """The query-head count of every SDPA call: the key/value heads' when packed, all heads' otherwise."""
    heads = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        heads.append(query.shape[1])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return heads


PACKED_LAYOUTS = ["shared_bool", "per_head_bool", "additive", "per_head_additive", "broadcast_batch",
                  "none_one_query", "masked_one_query"]


@pytest.mark.parametrize("mask_kind", [*PACKED_LAYOUTS, "broadcast_queries", "per_head_broadcast_queries"])
def test_packed_attention_equals_transformers_sdpa(mask_kind, monkeypatch):
    """Every mask layout Transformers hands an attention function: the packed result is the same, per query
    head (a mask that differs per head and distinct K/V per group catch a wrong head-to-group order). The
    layouts it packs run SDPA on the key/value heads; a mask broadcast over the queries is handed over."""
    width = 1 if mask_kind.endswith("one_query") else 3
    q, k, v = _qkv(width=width)
    batch, heads, _, _ = q.shape
    total = k.shape[2]
    generator = torch.Generator().manual_seed(1)
    visible = torch.rand(batch, heads, width, total, generator=generator) > 0.3
    visible[..., -1] = True  # every query sees something
    additive = torch.zeros(batch, heads, width, total).masked_fill(~visible, torch.finfo(torch.float32).min)
    mask = {
        "shared_bool": visible[:, :1],
        "per_head_bool": visible,
        "additive": additive[:, :1],
        "per_head_additive": additive,
        "broadcast_batch": visible[:1, :1],
        "none_one_query": None,
        "masked_one_query": visible[:, :1],
        "broadcast_queries": visible[:, :1, :1],
        "per_head_broadcast_queries": visible[:, :, :1],
    }[mask_kind]
    module = _Module(groups=heads // k.shape[1])
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    sdpa_heads = _spy_on_sdpa(monkeypatch)
    got, _ = packed_gqa_sdpa(module, q, k, v, mask, scaling=0.3)
    assert got.shape == expected.shape == (batch, width, heads, q.shape[-1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert sdpa_heads == ([k.shape[1]] if mask_kind in PACKED_LAYOUTS else [heads])
    # a query of one group really reads that group's keys: swap the groups' K/V and the heads' outputs move
    swapped, _ = packed_gqa_sdpa(module, q, k.flip(1), v.flip(1), mask, scaling=0.3)
    assert not torch.allclose(swapped, expected, atol=1e-3)


def test_a_causal_prefill_and_a_long_forward_run_transformers_sdpa():
    q, k, v = _qkv(width=7, total=7)
    module = _Module(groups=3)
    expected, _ = sdpa_attention_forward(module, q, k, v, None)
    got, _ = packed_gqa_sdpa(module, q, k, v, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    width = MAX_PACKED_QUERIES + 1  # the repeated mask would grow with queries x keys x groups
    q, k, v = _qkv(width=width, total=width + 2)
    mask = torch.ones(2, 1, width, width + 2, dtype=torch.bool).tril(2)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask)
    got, _ = packed_gqa_sdpa(module, q, k, v, mask)
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
    # a model type that may branch on the implementation's name is not switched
    other = tiny_target("llama")
    other.config.model_type = "deepseek_v32"
    assert not packs_gqa(other)


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


def test_a_cost_model_measured_under_another_attention_is_named_in_a_warning():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = torch.randint(2, 96, (1, 8), generator=torch.Generator().manual_seed(5))
    measured_on_sdpa = CostModel([0.01 * (1 + k / 16) for k in range(16)], 0.002, {"attention": "sdpa"})
    with torch.no_grad(), pytest.warns(UserWarning, match="measured under 'sdpa' attention"):
        speculative_generate(target, drafter, ids, max_new_tokens=4, cost_model=measured_on_sdpa)
