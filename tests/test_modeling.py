"""Drafter internals: conv identity, path selector vs a plain reference, binding, architectures."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from hf_dflash2 import DFlash2Config

from .conftest import tiny_drafter, tiny_target


def _context(drafter, n_rows=2, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    taps = len(drafter.config.target_layer_ids)
    features = torch.randn(n_rows, length, taps * drafter.config.hidden_size, generator=generator)
    positions = torch.arange(length)[None].expand(n_rows, -1)
    kv = drafter.context_kv(drafter.project_context(features), positions)
    return kv, torch.ones(n_rows, length, dtype=torch.bool), positions


def test_fresh_conv_is_exact_identity():
    """A freshly initialised dFlash 2 drafter equals the same weights with the conv removed."""
    target = tiny_target()
    with_conv = tiny_drafter(target, randomize=False)
    without = copy.deepcopy(with_conv)
    for layer in without.layers:
        layer.attention_conv = layer.mlp_conv = None
    with torch.no_grad():
        a = with_conv.draft_block(torch.tensor([3, 5]), torch.tensor([9, 9]), *_context(with_conv))
        b = without.draft_block(torch.tensor([3, 5]), torch.tensor([9, 9]), *_context(without))
    assert torch.equal(a.hidden, b.hidden)
    # ...and a trained (perturbed) conv is not a no-op, so the comparison above has teeth.
    perturbed = tiny_drafter(target, randomize=True)
    with torch.no_grad():
        c = perturbed.draft_block(torch.tensor([3, 5]), torch.tensor([9, 9]), *_context(perturbed))
    assert not torch.allclose(c.hidden, a.hidden)


def test_conv_taps_stay_inside_each_block():
    target = tiny_target()
    drafter = tiny_drafter(target)
    conv = drafter.layers[0].attention_conv
    x = torch.randn(1, 2, 4, 64)
    kernels = conv.kernels(torch.randn(1, 2, 4, 64))
    out = conv(x, kernels, side=0)
    x2 = x.clone()
    x2[:, 0, -1] += 100.0  # last token of block 0 must not reach block 1's first token
    out2 = conv(x2, kernels, side=0)
    assert torch.equal(out[:, 1], out2[:, 1])
    assert not torch.equal(out[:, 0, -1], out2[:, 0, -1])
    # two taps: position i depends on i and i-1 only
    x3 = x.clone()
    x3[:, 1, 1] += 1.0
    changed = (conv(x3, kernels, side=0) != out).any(-1)[0, 1]
    assert changed.tolist() == [False, True, True, False]


def reference_selector(selector, hidden, logits, anchor_ids, temperature, gumbel):
    """Slow, plain path selector: one row and one position at a time."""
    n, s, _ = logits.shape
    k = selector.top_k
    tokens, qs = torch.zeros(n, s, dtype=torch.long), torch.zeros(n, s, k)
    for row in range(n):
        previous_token = int(anchor_ids[row])
        for t in range(s):
            unary, candidates = logits[row, t].float().topk(k)
            projected = selector.hidden_projection(hidden[row, t])
            scores = torch.empty(k)
            for b in range(k):
                pair = (selector.predecessor_codebook[previous_token] * projected * selector.successor_codebook[candidates[b]]).sum()
                scores[b] = unary[b] + pair
            if temperature > 0:
                choice = int((scores / temperature + gumbel[row, t]).argmax())
                qs[row, t] = torch.softmax(scores / temperature, -1)
            else:
                choice = int(scores.argmax())
                qs[row, t, choice] = 1.0
            tokens[row, t] = candidates[choice]
            previous_token = int(candidates[choice])
    return tokens, qs


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_batched_selector_matches_plain_reference(temperature):
    target = tiny_target(vocab_size=200)
    drafter = tiny_drafter(target, block_size=6, selector_top_k=5)
    selector = drafter.candidate_selector
    with torch.no_grad():
        selector.successor_codebook.normal_(0, 1.0)
        selector.predecessor_codebook.normal_(0, 1.0)
        generator = torch.Generator().manual_seed(3)
        hidden = torch.randn(4, 5, 64, generator=generator)
        logits = torch.randn(4, 5, 200, generator=generator) * 3
        anchors = torch.tensor([7, 0, 150, 42])
        seeded = torch.Generator().manual_seed(11)
        out = selector(hidden, logits, anchors, temperature=temperature, generator=seeded)
        # the same seeded draws: the batched op takes all Gumbel noise in one call, shape [N, S, K]
        gumbel = -torch.empty(4, 5, 5).exponential_(generator=torch.Generator().manual_seed(11)).log()
        tokens, qs = reference_selector(selector, hidden, logits, anchors, temperature, gumbel)
    assert torch.equal(out.tokens, tokens)
    assert torch.allclose(out.q, qs, atol=1e-5)
    assert torch.equal(out.candidate_ids.gather(-1, out.choice[..., None]).squeeze(-1), out.tokens)
    # the selector really changes the choice away from the unary argmax somewhere
    assert not torch.equal(out.tokens, logits.argmax(-1))


def test_fresh_selector_picks_unary_argmax():
    target = tiny_target(vocab_size=200)
    drafter = tiny_drafter(target, randomize=False, block_size=6, selector_top_k=5)
    logits = torch.randn(3, 5, 200)
    out = drafter.candidate_selector(torch.randn(3, 5, 64), logits, torch.tensor([1, 2, 3]))
    assert torch.equal(out.tokens, logits.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("dflash2", [True, False])
def test_bind_and_draft_on_several_architectures(arch, dflash2):
    target = tiny_target(arch)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=5)
    drafter.bind_target(target)
    ids = torch.randint(2, 96, (2, 8))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        from hf_dflash2.speculative_dflash2 import tapped_features

        features = tapped_features(out.hidden_states, drafter.config.target_layer_ids)
        positions = torch.arange(8)[None].expand(2, -1)
        kv = drafter.context_kv(drafter.project_context(features), positions)
        draft = drafter.draft_block(ids[:, -1], torch.tensor([8, 8]), kv, torch.ones(2, 8, dtype=torch.bool), positions)
    assert draft.tokens.shape == (2, 4) and draft.tokens.dtype == torch.long
    assert draft.hidden.shape == (2, 4, 64) and draft.hidden.dtype == torch.float32
    assert draft.logits.shape == (2, 4, 96)
    assert int(draft.tokens.max()) < 96
    if arch == "gemma3":
        assert drafter.config.input_embedding_scale == pytest.approx(8.0)  # sqrt(64)
        raw = target.get_input_embeddings().weight[ids[:, :1]]
        assert torch.allclose(drafter.embed(ids[:, :1]), raw * 8.0)
        assert torch.allclose(target.get_input_embeddings()(ids[:, :1]), drafter.embed(ids[:, :1]), atol=1e-5)


def test_for_target_fills_fields_and_default_layers():
    target = tiny_target(layers=30)
    config = DFlash2Config.for_target(target.config, num_hidden_layers=5)
    assert config.hidden_size == 64 and config.vocab_size == 96 and config.num_target_layers == 30
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 2
    assert config.target_layer_ids == [1, 7, 14, 21, 27]
    assert DFlash2Config.for_target(tiny_target(layers=52).config, num_hidden_layers=5).target_layer_ids == [1, 13, 25, 37, 49]
    assert DFlash2Config.for_target(target.config, num_hidden_layers=1).target_layer_ids == [15]
    v1 = DFlash2Config.for_target(target.config, num_hidden_layers=2, dflash2=False)
    assert not v1.use_conv and not v1.use_selector and v1.architecture_name == "DFlashDraftModel"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: tiny_target(hidden_size=32), "hidden_size=64 does not match the target's hidden_size=32"),
        (lambda t: tiny_target(vocab_size=120), "vocab_size=96 does not match the target's vocab_size=120"),
        (lambda t: tiny_target(layers=4), "num_target_layers=6 does not match the target's num_target_layers=4"),
        (lambda t: t.to(torch.bfloat16), "dtype torch.float32 does not match the target's dtype torch.bfloat16"),
        (lambda t: split_over_two_devices(t), "the target is split over devices ['cuda:0', 'cuda:1'] (device_map)"),
    ],
)
def test_binding_mismatch_raises_before_any_forward(mutate, message):
    target = tiny_target()
    drafter = tiny_drafter(target)
    other = mutate(target)
    calls = []
    other.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=re.escape(message)):
        drafter.bind_target(other)
    with pytest.raises(ValueError):
        other.generate(torch.tensor([[3, 4, 5]]), assistant_model=drafter, max_new_tokens=4)
    assert calls == []


def split_over_two_devices(target):
    """What device_map="auto" records on a machine with two GPUs (the weights stay put: the check reads the map)."""
    target.hf_device_map = {"model.embed_tokens": 0, "model.layers": 0, "model.norm": 1, "lm_head": 1}
    return target


def test_a_target_on_one_accelerator_with_cpu_offload_binds():
    """accelerate's CPU offload runs those layers on the accelerator, and 0 / "cuda:0" name one device."""
    target = tiny_target()
    target.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": "cuda:0", "model.layers.5": "cpu",
                            "lm_head": "disk"}
    tiny_drafter(target).bind_target(target)


def test_bad_layer_ids_and_mask_token_rejected():
    target = tiny_target()
    with pytest.raises(ValueError, match="reach layer 9"):
        DFlash2Config.for_target(target.config, target_layer_ids=[1, 9])
    with pytest.raises(ValueError, match="mask_token_id 500 is outside the vocabulary"):
        DFlash2Config.for_target(target.config, mask_token_id=500)
    drafter = tiny_drafter(target)
    drafter.config.num_target_layers = None  # a config that does not pin the layer count
    drafter.config.dflash_config["target_layer_ids"] = [1, 5]
    with pytest.raises(ValueError, match=r"include layer 5, but the target has 4 layers"):
        drafter.bind_target(tiny_target(layers=4))


def test_unbound_drafter_says_how_to_bind():
    drafter = tiny_drafter(tiny_target())
    drafter.__dict__.pop("_bound_target", None)
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.embed(torch.tensor([1]))
