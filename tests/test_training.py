"""Training: the loss learns, resume is exact, a killed run leaves a usable checkpoint, DDP matches."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import DynamicCache

from hf_dflash2.modeling_dflash2 import DFlash2DraftModel
from hf_dflash2.training.blocks import sample_anchors, sequence_blocks
from hf_dflash2.training.regenerate import RegenerationConfig, decode_batch, read_regenerated, regenerate
from hf_dflash2.training.trainer import Trainer, TrainingConfig, feature_scale

from .conftest import REPO, tiny_drafter, tiny_target


def toy_sequences(n=8, length=40, vocab=64, seed=0):
    """Sequences from a simple deterministic rule, so a drafter can learn them quickly."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = int(torch.randint(2, vocab, (1,), generator=generator))
        ids = [(start + 3 * i) % (vocab - 2) + 2 for i in range(length)]
        out.append({"input_ids": ids, "response_start": 8})
    return out


def make_trainer(tmp_path, steps=6, dflash2=True, sequences=None, layers=2, target_layer_ids=None, selector_rank=16,
                 **overrides):
    target = tiny_target(vocab_size=64)
    with torch.no_grad():  # a random tiny LM head has tiny weights; a real one's logits span tens of nats
        target.lm_head.weight.mul_(25.0)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=4, randomize=False, layers=layers,
                           target_layer_ids=target_layer_ids, selector_rank=selector_rank)
    settings = dict(
        output_dir=str(tmp_path),
        steps=steps,
        batch_size=2,
        anchors_per_sequence=6,
        checkpoint_every=2,
        learning_rate=3e-3,
    )
    config = TrainingConfig(**{**settings, **overrides})
    return Trainer(target, drafter, sequences or toy_sequences(), config)


def test_blocks_and_anchors():
    seq = {"input_ids": list(range(10, 30)), "response_start": 5}
    anchors = sample_anchors(20, 5, 100, torch.Generator().manual_seed(0))
    assert anchors.min() >= 5 and anchors.max() <= 18 and len(anchors) == 14
    block_ids, labels, predecessors = sequence_blocks(
        torch.tensor(seq["input_ids"]), 4, torch.tensor([5, 17]), mask_token_id=1
    )
    assert block_ids.tolist() == [[15, 1, 1, 1], [27, 1, 1, 1]]
    assert labels.tolist() == [[16, 17, 18], [28, 29, -100]]
    assert predecessors.tolist() == [[15, 16, 17], [27, 28, 29]]


@pytest.mark.parametrize("dflash2", [True, False])
def test_loss_decreases_and_accuracy_rises(tmp_path, dflash2):
    trainer = make_trainer(tmp_path, steps=100, dflash2=dflash2, vocab_subset="full")
    history = trainer.train()
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert sum(h["top1_position1"] for h in history[-5:]) / 5 > 0.3  # chance is 1/62
    if dflash2:
        assert "selector_loss" in history[-1]


def test_resume_gives_identical_weights(tmp_path):
    full = make_trainer(tmp_path / "a", steps=6)
    full.train()
    interrupted = make_trainer(tmp_path / "b", steps=6)
    interrupted.train(stop_after=3)  # checkpoint at step 2 and at the stop (step 3)
    del interrupted
    resumed = make_trainer(tmp_path / "b", steps=6)
    resumed.train(resume=True)
    assert resumed.step == 6
    a = full.accelerator.unwrap_model(full.drafter).state_dict()
    b = resumed.accelerator.unwrap_model(resumed.drafter).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [h["loss"] for h in full.history] == [h["loss"] for h in resumed.history]


def test_resume_with_another_head_shape_is_refused_by_name(tmp_path):
    make_trainer(tmp_path, steps=4).train(stop_after=2)
    for changed, message in (({"layers": 3}, "num_hidden_layers=3 (trained with 2)"),
                             ({"selector_rank": 8}, "selector_rank=8 (trained with 16)"),
                             ({"dflash2": False}, "selector_rank=None (trained with 16)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            make_trainer(tmp_path, steps=4, **changed).train(resume=True)


def test_init_from_takes_weights_and_scale_but_starts_a_fresh_schedule(tmp_path):
    source = make_trainer(tmp_path / "a", steps=4, logit_ramp_steps=2)
    source.train()
    other_data = toy_sequences(seed=5, length=48)  # with a feature scale of its own
    fine_tune = make_trainer(tmp_path / "b", steps=3, seed=1, logit_ramp_steps=2, sequences=other_data)
    assert not torch.equal(fine_tune.feature_scale, source.feature_scale)
    assert fine_tune.logit_scale(0) < 1.0  # a fresh head's damped start
    fine_tune.initialize_from(tmp_path / "a")
    assert fine_tune.logit_scale(0) == 1.0  # a trained head is not damped again
    a = source.accelerator.unwrap_model(source.drafter).state_dict()
    b = fine_tune.accelerator.unwrap_model(fine_tune.drafter).state_dict()
    for name in a:  # the training-space weights, fc included (not the folded copy in state["drafter"])
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(fine_tune.feature_scale, source.feature_scale)
    assert fine_tune.step == 0 and fine_tune.history == []
    fine_tune.train()
    assert fine_tune.step == 3 and len(fine_tune.history) == 3
    mismatched = make_trainer(tmp_path / "c", steps=3, dflash2=False)  # no conv, no selector
    before = {k: v.clone() for k, v in mismatched.accelerator.unwrap_model(mismatched.drafter).state_dict().items()}
    with pytest.raises(ValueError, match="does not match this run's shape"):
        mismatched.initialize_from(tmp_path / "a")
    raw = make_trainer(tmp_path / "d", steps=3, standardize_features=False)
    with pytest.raises(ValueError, match="standardize_features"):
        raw.initialize_from(tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        raw.initialize_from(tmp_path / "nowhere")
    after = mismatched.accelerator.unwrap_model(mismatched.drafter).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # a refused source changes nothing


def scaled_norms(target, seed: int = 3) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in target.named_parameters():
            if name.endswith("norm.weight"):
                parameter.mul_(0.5 + torch.rand(parameter.shape, generator=generator))


def test_head_layers_start_as_copies_of_the_targets_layers_and_train(tmp_path):
    """``--init-layers-from-target``: each head layer starts as the named target layer (attention, MLP, both
    norms); the q/k norms a Llama target lacks and the conv keep their fresh values; the run trains from
    there. A wrong count, a layer outside the target, a shape the target layer lacks, a parameter the head
    would drop or another MLP activation is refused by name with nothing copied."""
    from hf_dflash2.training.starting_points import copy_target_layers

    trainer = make_trainer(tmp_path, steps=3)
    drafter = trainer.accelerator.unwrap_model(trainer.drafter)
    fresh = {k: v.clone() for k, v in drafter.state_dict().items()}
    scaled_norms(trainer.target)  # so that a copied norm differs from a fresh one
    trainer.initialize_layers_from_target([5, 3])
    target_layers = trainer.target.get_decoder().layers
    copied = 0
    for i, (head_layer, index) in enumerate(zip(drafter.layers, [5, 3])):
        theirs = dict(target_layers[index].named_parameters())
        for name, parameter in head_layer.named_parameters():
            if name in theirs:
                assert torch.equal(parameter, theirs[name]), name
                copied += 1
            else:  # the q/k norms and the conv: as the fresh head had them
                assert torch.equal(parameter, fresh[f"layers.{i}.{name}"]), name
    assert copied == 2 * 9  # q, k, v, o, gate, up, down and the two layer norms, per layer
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, fresh["layers.0.mlp.up_proj.weight"])
    assert torch.equal(drafter.fc.weight, fresh["fc.weight"])  # the rest of the head is a fresh head's
    assert trainer.initialized_from == {"target_layers": [5, 3]}
    last = make_trainer(tmp_path / "last", steps=3)
    last_head = last.accelerator.unwrap_model(last.drafter)
    with torch.no_grad():  # layer 4's input norm unlike a fresh hidden_norm (the taps below it stay as cached)
        last.target.get_decoder().layers[4].input_layernorm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    untouched = {k: v.clone() for k, v in last_head.state_dict().items()}
    with pytest.raises(ValueError, match="target layer 3 reads tap 2"):  # checked before the layers are copied
        last.initialize_layers_from_target([3, 5], context=True)
    with pytest.raises(ValueError, match="target layer 0 reads the embeddings"):
        last.initialize_layers_from_target([0, 5], context=True)
    assert all(torch.equal(untouched[k], v) for k, v in last_head.state_dict().items())
    last.initialize_layers_from_target("last", context=True)  # the target's last layers, as many as the head has
    assert last.initialized_from["target_layers"] == [4, 5] and last.initialized_from["target_context"] == 4
    # fc trains on standardized features (features / scale): what it passes on is still layer 4's own input
    assert last.feature_scale is not None
    item = last.sequence_item(0)
    with torch.no_grad():
        context = last_head.project_context(item["features"].float() / last.feature_scale)
        states = last.target(torch.as_tensor(last.sequences[0]["input_ids"])[None], output_hidden_states=True)
        expected = last.target.get_decoder().layers[4].input_layernorm(states.hidden_states[4])
    torch.testing.assert_close(context, expected, rtol=1e-3, atol=1e-3)
    query, key = last.initialized_from["query_key_scales"]["4"]  # a Llama target: the q/k norms calibrated
    assert last_head.layers[0].self_attn.q_norm.weight[0].item() == pytest.approx(query)
    assert last_head.layers[0].self_attn.k_norm.weight[0].item() == pytest.approx(key)
    too_deep = make_trainer(tmp_path / "deep", steps=3, layers=7)
    with pytest.raises(ValueError, match="'last': the head's 7 layers exceed the target's 6"):
        too_deep.initialize_layers_from_target("last")
    assert torch.equal(last.accelerator.unwrap_model(last.drafter).layers[1].mlp.up_proj.weight,
                       last.target.get_decoder().layers[5].mlp.up_proj.weight)
    trainer.train()
    assert trainer.step == 3 and all(math.isfinite(h["loss"]) for h in trainer.history)

    other = make_trainer(tmp_path / "b", steps=3)
    head = other.accelerator.unwrap_model(other.drafter)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    with pytest.raises(ValueError, match=r"names 1 target layers, the head has 2"):
        other.initialize_layers_from_target([5])
    with pytest.raises(ValueError, match="layer 6 is outside the target's 6 layers"):
        other.initialize_layers_from_target([5, 6])
    wider = tiny_target(vocab_size=64, intermediate_size=96)  # another MLP width: no counterpart
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight \(128, 64\) has no counterpart in target layer 5 "
                                         r"\(shape \(96, 64\)\)"):
        copy_target_layers(head, wider, [5, 4])
    biased = tiny_target(vocab_size=64, attention_bias=True)  # biases the head has no place for
    with pytest.raises(ValueError, match=r"target layer 5 has \['self_attn.k_proj.bias', 'self_attn.o_proj.bias', "
                                         r"'self_attn.q_proj.bias', 'self_attn.v_proj.bias'\]"):
        copy_target_layers(head, biased, [5, 4])
    gelu = tiny_target(vocab_size=64, hidden_act="gelu")
    with pytest.raises(ValueError, match="the target's MLP activation is 'gelu', the head's 'silu'"):
        copy_target_layers(head, gelu, [5, 4])
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())


def test_a_qwen3_targets_query_and_key_norms_are_copied_too():
    from hf_dflash2.training.starting_points import copy_target_layers

    target = tiny_target("qwen3", vocab_size=64)
    scaled_norms(target)
    drafter = tiny_drafter(target, randomize=False)
    copied = copy_target_layers(drafter, target, [4, 5])
    assert "self_attn.q_norm.weight" in copied and "self_attn.k_norm.weight" in copied
    for head_layer, index in zip(drafter.layers, [4, 5]):
        theirs = dict(target.get_decoder().layers[index].named_parameters())
        for name in copied:
            assert torch.equal(head_layer.get_parameter(name), theirs[name]), name
    # a norm that applies 1 + w (Gemma's) is copied as the scale it applies, which the head's norms take as w
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from hf_dflash2.training.starting_points import _norm_scale

    gemma_norm = Gemma3RMSNorm(8)
    with torch.no_grad():
        gemma_norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    torch.testing.assert_close(_norm_scale(gemma_norm, gemma_norm.weight.detach()), 1 + torch.linspace(-0.5, 0.5, 8))


def test_a_gemma3_head_layer_copied_from_the_target_computes_the_target_layer():
    """A Gemma head (sandwich norms, the target's tanh GELU) takes every parameter of a Gemma 3 decoder layer,
    norms as the 1 + w they apply, and then computes that layer: on one token (attention to itself only, so
    RoPE and the context drop out) the head layer maps the layer's input to its output."""
    from hf_dflash2.training.starting_points import copy_target_layers

    target = trained_like_gemma3_layers()
    drafter = tiny_drafter(target, randomize=False)
    assert drafter.config.sandwich_norms and drafter.config.hidden_act == "gelu_pytorch_tanh"
    copied = copy_target_layers(drafter, target, [3, 4])
    assert {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
            "self_attn.q_norm.weight"} <= set(copied)
    with torch.no_grad():
        states = target(torch.tensor([[7]]), output_hidden_states=True).hidden_states
        for head_layer, index in zip(drafter.layers, [3, 4]):
            x = states[index].view(1, 1, 1, -1)
            heads, dim = drafter.config.num_key_value_heads, drafter.config.head_dim
            empty = torch.zeros(1, heads, 0, dim)
            out = head_layer(x, torch.ones(1, 1, dim), torch.zeros(1, 1, dim), empty, empty,
                             torch.ones(1, 1, 1, 1, dtype=torch.bool))
            torch.testing.assert_close(out.view(-1), states[index + 1].view(-1), rtol=1e-4, atol=1e-4)


def trained_like_gemma3_layers():
    """A tiny Gemma 3 whose norms are far from their init (1 + w with w != 0), so a copy that ignored the
    offset or dropped a norm would compute something else."""
    target = tiny_target("gemma3", vocab_size=64)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in target.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) - 0.5)
    return target


def test_gradient_checkpointing_trains_as_the_plain_run(tmp_path):
    """``--gradient-checkpointing``: the same losses step for step as without it (only memory and time differ)."""
    plain = make_trainer(tmp_path / "plain", steps=3)
    checkpointed = make_trainer(tmp_path / "checkpointed", steps=3, gradient_checkpointing=True)
    layers = checkpointed.accelerator.unwrap_model(checkpointed.drafter).layers
    assert all(layer.gradient_checkpointing for layer in layers)
    losses = [h["loss"] for h in plain.train()], [h["loss"] for h in checkpointed.train()]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_a_context_from_the_target_gives_the_copied_layer_the_targets_own_keys_and_values():
    """``--init-context-from-target``: fc passes the tap that the first copied layer reads and hidden_norm takes
    that layer's input norm, so the head layer's context keys (before RoPE) and values equal the target
    layer's own on the same text. A layer whose input is not tapped is refused with nothing written."""
    from hf_dflash2.training.starting_points import copy_target_context, copy_target_layers

    target = tiny_target("qwen3", vocab_size=64)
    scaled_norms(target)
    drafter = tiny_drafter(target, randomize=False, target_layer_ids=[1, 3])
    copy_target_layers(drafter, target, [4, 5])
    assert copy_target_context(drafter, target, 4) == 1
    attention = target.get_decoder().layers[4].self_attn
    seen = {}
    hooks = [attention.k_norm.register_forward_hook(lambda m, i, o: seen.setdefault("k", o)),
             attention.v_proj.register_forward_hook(lambda m, i, o: seen.setdefault("v", o))]
    ids = torch.randint(2, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        for hook in hooks:
            hook.remove()
        context = drafter.project_context(torch.cat([hidden[i + 1] for i in (1, 3)], dim=-1))
        mine = drafter.layers[0].self_attn
        k = mine.k_norm(mine.k_proj(context).unflatten(-1, (mine.num_kv_heads, mine.head_dim)))
        v = mine.v_proj(context)
    torch.testing.assert_close(k, seen["k"].reshape(k.shape), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, seen["v"], rtol=1e-4, atol=1e-4)

    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    with pytest.raises(ValueError, match=r"target layer 3 reads tap 2, which is not among the head's taps \[1, 3\]"):
        copy_target_context(drafter, target, 3)
    with pytest.raises(ValueError, match="layer 6 is outside the target's 6 layers"):
        copy_target_context(drafter, target, 6)
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())


def test_a_llama_targets_query_and_key_scale_is_kept_by_the_heads_norms():
    """A target without q/k norms (Llama): the head's per-head norms would put every copied query and key at
    unit RMS; calibrated, they carry the target layer's mean per-head RMS on the given text, one scale per
    layer. A Qwen3 target keeps the norms it copied."""
    from hf_dflash2.training.starting_points import calibrate_query_key_norms, copy_target_layers

    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, randomize=False)
    copy_target_layers(drafter, target, [4, 5])
    ids = torch.randint(2, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    scales = calibrate_query_key_norms(drafter, target, [4, 5], ids)
    assert sorted(scales) == [4, 5]
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    for head_layer, index in zip(drafter.layers, [4, 5]):
        theirs = target.get_decoder().layers[index]
        x = theirs.input_layernorm(hidden[index])
        for proj, norm, scale in (("q_proj", "q_norm", scales[index][0]), ("k_proj", "k_norm", scales[index][1])):
            out = getattr(theirs.self_attn, proj)(x).unflatten(-1, (-1, head_layer.self_attn.head_dim))
            expected = out.pow(2).mean(-1).sqrt().mean().item()
            assert scale == pytest.approx(expected, rel=1e-4)
            assert torch.allclose(getattr(head_layer.self_attn, norm).weight, torch.tensor(expected), rtol=1e-4)
        assert scales[index][0] != pytest.approx(1.0, abs=0.05)  # a scale the fresh norms did not have

    qwen = tiny_target("qwen3", vocab_size=64)
    scaled_norms(qwen)
    head = tiny_drafter(qwen, randomize=False)
    copy_target_layers(head, qwen, [4, 5])
    copied = head.layers[0].self_attn.q_norm.weight.clone()
    assert calibrate_query_key_norms(head, qwen, [4, 5], ids) == {}
    assert torch.equal(head.layers[0].self_attn.q_norm.weight, copied)


def test_init_layers_from_target_is_checked_before_the_target_loads(tmp_path, monkeypatch):
    from hf_dflash2 import assets
    from hf_dflash2.cli import main

    def no_target(*args, **kwargs):
        raise AssertionError("the target must not load before --init-layers-from-target is checked")

    monkeypatch.setattr(assets, "load_target", no_target)
    (tmp_path / "regen.jsonl").write_text("")
    train = ["train", "--data", str(tmp_path / "regen.jsonl"), "--output", str(tmp_path / "run")]
    with pytest.raises(SystemExit, match="names 3 target layers, the head has --layers 2"):
        main([*train, "--init-layers-from-target", "27,28,29"])
    with pytest.raises(SystemExit, match="'28,x': expected 'last' or comma-separated integers"):
        main([*train, "--init-layers-from-target", "28,x"])
    with pytest.raises(SystemExit, match="give one of them"):
        main([*train, "--init-layers-from-target", "28,29", "--init-from", "heads/smollm2-135m-dflash2"])
    with pytest.raises(SystemExit, match="give --init-layers-from-target too"):
        main([*train, "--init-context-from-target"])
    record = {"prompt_ids": list(range(10, 20)), "response_ids": list(range(20, 40))}
    (tmp_path / "regen.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(AssertionError, match="must not load"):  # 'last' passes the checks: the target loads next
        main([*train, "--init-layers-from-target", "last", "--layers", "3", "--init-context-from-target"])
    assert not (tmp_path / "run").exists()


def test_init_from_a_saved_head_computes_what_the_head_computed(tmp_path):
    source = make_trainer(tmp_path / "a", steps=4)
    source.train()
    head = source.save_head(tmp_path / "head")
    other_data = toy_sequences(seed=5, length=48)  # another feature scale: fc must be unfolded with it
    fine_tune = make_trainer(tmp_path / "b", steps=3, seed=1, sequences=other_data)
    assert not torch.allclose(fine_tune.feature_scale, source.feature_scale)
    fine_tune.initialize_from(head)
    assert fine_tune.initialized_from["head"] == str(head)
    assert fine_tune.logit_scale(0) == 1.0
    assert torch.equal(fine_tune.vocab_subset.cpu(), source.vocab_subset.cpu())
    saved, exported = source.exported_state_dict(), fine_tune.exported_state_dict()
    for name in saved:  # the exported (raw-feature) weights round-trip up to float rounding
        assert torch.allclose(saved[name], exported[name], rtol=1e-5, atol=1e-6), name
    fine_tune.train()
    assert fine_tune.step == 3
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a saved head"):
        fine_tune.initialize_from(tmp_path / "broken")
    wrong = make_trainer(tmp_path / "c", steps=3, dflash2=False)
    with pytest.raises(ValueError, match="does not match this run's shape"):
        wrong.initialize_from(head)


def test_init_from_grows_a_head_that_computes_what_it_computed(tmp_path):
    """A run with more layers than its source starts from the source grown (new layers copy the last with
    their residual outputs zeroed): the same loss on the same blocks, from a run or a saved head; training
    then moves the new layers. Fewer layers than the source are refused."""
    from hf_dflash2.training.starting_points import RESIDUAL_OUTPUTS, grown_drafter_weights

    source = make_trainer(tmp_path / "a", steps=4)
    source.train()
    head = source.save_head(tmp_path / "head")
    reference = source.sequence_loss(0, 1000)[0].item()  # past the logit ramp
    tapped = source.accelerator.unwrap_model(source.drafter).config.target_layer_ids  # a 3-layer default taps 3
    for init in (tmp_path / "a", head):
        grown = make_trainer(tmp_path / f"grown_{init.name}", steps=3, layers=3, target_layer_ids=tapped)
        assert abs(grown.sequence_loss(0, 1000)[0].item() - reference) > 1e-4  # a fresh 3-layer head differs
        grown.initialize_from(init)
        assert grown.sequence_loss(0, 1000)[0].item() == pytest.approx(reference, rel=1e-5, abs=1e-6), init
        weights = grown.accelerator.unwrap_model(grown.drafter).state_dict()
        assert all(not weights[f"layers.2.{name}"].any() for name in RESIDUAL_OUTPUTS)
        assert torch.equal(weights["layers.2.mlp.up_proj.weight"], weights["layers.1.mlp.up_proj.weight"])
    grown.train()
    weights = grown.accelerator.unwrap_model(grown.drafter).state_dict()
    assert all(weights[f"layers.2.{name}"].any() for name in RESIDUAL_OUTPUTS)  # the new layer learns
    shrunk = make_trainer(tmp_path / "c", steps=3, layers=1, target_layer_ids=tapped)
    with pytest.raises(ValueError, match="num_hidden_layers is 2, this run's is 1"):
        shrunk.initialize_from(head)
    with pytest.raises(ValueError, match="cannot grow 3 layers to 2"):
        grown_drafter_weights({}, 3, 2)


def test_init_from_widens_a_heads_taps_and_it_computes_what_it_computed(tmp_path):
    """A run that taps more target layers than its source head starts from the head with the new taps'
    ``fc`` columns at zero: the same loss on the same blocks; training then gives them weight. A run that
    would drop one of the source's taps is refused, and so is widening from a checkpoint (its feature scale
    covers the source's taps only)."""
    source = make_trainer(tmp_path / "a", steps=4, target_layer_ids=[1, 4])
    source.train()
    head = source.save_head(tmp_path / "head")
    reference = source.sequence_loss(0, 1000)[0].item()
    widened = make_trainer(tmp_path / "w", steps=3, target_layer_ids=[1, 2, 4])
    assert abs(widened.sequence_loss(0, 1000)[0].item() - reference) > 1e-4
    widened.initialize_from(head)
    assert widened.sequence_loss(0, 1000)[0].item() == pytest.approx(reference, rel=1e-5, abs=1e-6)
    hidden = widened.accelerator.unwrap_model(widened.drafter).config.hidden_size
    new_columns = slice(hidden, 2 * hidden)  # tap 2 sits between the source's taps 1 and 4
    fc = widened.accelerator.unwrap_model(widened.drafter).fc.weight
    assert not fc[:, new_columns].any() and fc[:, 2 * hidden :].any()
    widened.train()
    assert widened.accelerator.unwrap_model(widened.drafter).fc.weight[:, new_columns].any()  # they learn
    dropping = make_trainer(tmp_path / "d", steps=3, target_layer_ids=[1, 2])
    with pytest.raises(ValueError, match=re.escape(f"--init-from {head}: cannot widen taps [1, 4] to [1, 2]: [4] would "
                                                   "be dropped")):
        dropping.initialize_from(head)
    from_run = make_trainer(tmp_path / "r", steps=3, target_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match=re.escape("its target_layer_ids is [1, 4], this run's is [1, 2, 4] (a head's "
                                                   "taps widen from its exported head folder only)")):
        from_run.initialize_from(tmp_path / "a")


def test_init_from_prunes_the_selector_to_a_smaller_rank(tmp_path):
    """A run with a smaller selector rank keeps the source's strongest coordinates: coordinates whose
    successor column is zero add nothing, so when exactly those are dropped the loss is unchanged, and a
    run that kept them instead would differ. A larger rank than the source's is refused."""
    from hf_dflash2.training.starting_points import SELECTOR_FACTORS, pruned_selector_weights

    source = make_trainer(tmp_path / "a", steps=4)
    source.train()
    drafter = source.accelerator.unwrap_model(source.drafter)
    dead = torch.tensor([1, 4, 6, 9, 13, 15])
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook[:, dead] = 0
    reference = source.sequence_loss(0, 1000)[0].item()
    head = source.save_head(tmp_path / "head")
    pruned = make_trainer(tmp_path / "b", steps=3, selector_rank=10)
    pruned.initialize_from(head)
    assert pruned.sequence_loss(0, 1000)[0].item() == pytest.approx(reference, rel=1e-5, abs=1e-6)
    weights = pruned.accelerator.unwrap_model(pruned.drafter).state_dict()
    assert weights["candidate_selector.successor_codebook"].shape[1] == 10
    assert weights["candidate_selector.successor_codebook"].abs().sum(0).min() > 0  # the dead ones went
    source_weights = drafter.state_dict()
    kept = [r for r in range(16) if r not in dead.tolist()]
    for name in SELECTOR_FACTORS:
        sliced = source_weights[name][kept] if name.endswith("projection.weight") else source_weights[name][:, kept]
        assert torch.equal(weights[name], sliced.to(weights[name].dtype)), name
    same_rank = pruned_selector_weights(source_weights, 16)  # the identity at the source's own rank
    assert all(torch.equal(same_rank[name], source_weights[name]) for name in SELECTOR_FACTORS)
    with pytest.raises(ValueError, match="rank 16 to rank 17"):
        pruned_selector_weights(source_weights, 17)
    larger = make_trainer(tmp_path / "c", steps=3, selector_rank=24)
    with pytest.raises(ValueError, match="does not match this run's shape"):
        larger.initialize_from(head)


def test_standardized_features_fold_into_the_saved_head(tmp_path):
    trainer = make_trainer(tmp_path, steps=3)
    trainer.train()
    drafter = trainer.accelerator.unwrap_model(trainer.drafter)
    raw = trainer.sequence_item(0)["features"]
    assert trainer.feature_scale is not None and trainer.feature_scale.shape == (raw.shape[-1],)
    training_space = drafter.project_context(raw / trainer.feature_scale)
    head = DFlash2DraftModel.from_pretrained(trainer.save_head(tmp_path / "head"))
    assert torch.allclose(head.project_context(raw), training_space, atol=1e-5)
    with trainer.exported_weights() as exported:
        assert torch.allclose(exported.project_context(raw), training_space, atol=1e-5)
    assert torch.equal(drafter.project_context(raw / trainer.feature_scale), training_space)  # restored
    state = torch.load(trainer.checkpoint_path, weights_only=False)
    assert torch.allclose(state["drafter"]["fc.weight"], head.fc.weight)  # what export.py reads is folded
    assert not torch.allclose(state["drafter"]["fc.weight"], drafter.fc.weight)


def test_feature_scale_skips_the_sink_and_evens_out_a_massive_channel():
    features = torch.randn(50, 8)
    features[:, 3] *= 500.0
    features[0] = 1e4  # the attention sink
    scale = feature_scale([features])
    assert scale[3] > 100 * scale[0] and scale.max() < 1e3
    assert (features[1:] / scale).pow(2).mean(0).allclose(torch.ones(8), atol=1e-4)
    with pytest.raises(ValueError, match="at least one sequence"):
        feature_scale([features[:1]])


RUN_SCRIPT = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.test_training import make_trainer
from pathlib import Path
trainer = make_trainer(Path({out!r}), steps={steps}, checkpoint_every=1)
trainer.train(resume=True)
print("DONE")
"""


def test_kill_9_mid_run_loses_at_most_the_last_steps(tmp_path):
    script = RUN_SCRIPT.format(repo=str(REPO), out=str(tmp_path / "killed"), steps=40)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    checkpoint = tmp_path / "killed" / "checkpoint.pt"
    deadline = time.time() + 240
    while time.time() < deadline and not checkpoint.exists():
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert checkpoint.exists()
    state = torch.load(checkpoint, weights_only=False)  # never torn: written to a temp name, then renamed
    assert 1 <= state["step"] <= 40
    leftovers = [p.name for p in (tmp_path / "killed").iterdir() if p.name != "checkpoint.pt"]
    # a kill during the write can leave a temporary file, never a half checkpoint under the real name
    assert all(name.startswith(".checkpoint.") for name in leftovers)
    resumed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "DONE" in resumed.stdout, resumed.stderr[-2000:]
    reference = make_trainer(tmp_path / "reference", steps=40, checkpoint_every=100)
    reference.train()
    final = torch.load(checkpoint, weights_only=False)
    assert final["step"] == 40
    for name, tensor in reference.exported_state_dict().items():  # checkpoints hold the saved (folded) head
        assert torch.equal(tensor, final["drafter"][name]), name
    assert torch.equal(reference.accelerator.unwrap_model(reference.drafter).fc.weight, final["fc_weight_standardized"])


DDP_SCRIPT = """
import json, sys, torch
import torch.distributed
sys.path.insert(0, {repo!r})
torch.set_num_threads(1)
from accelerate import Accelerator
from tests.test_training import make_trainer
from pathlib import Path
accelerator = Accelerator(cpu=True)
trainer = make_trainer(Path({out!r}), steps=4, checkpoint_every=100)
trainer.config.batch_size = {batch}
from hf_dflash2.training.trainer import Trainer
drafter = trainer.accelerator.unwrap_model(trainer.drafter)
t = Trainer(trainer.target, drafter, trainer.sequences, trainer.config, accelerator=accelerator)
history = t.train()
assert accelerator.num_processes == {processes}, accelerator.num_processes
if accelerator.is_main_process:
    print("LOSSES", json.dumps([h["loss"] for h in history]))
"""


def test_two_process_ddp_matches_one_process_same_global_batch(tmp_path):
    """Two gloo processes with 1 sequence each == one process with 2 sequences, within 1e-4 relative."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run(
        [sys.executable, "-c", DDP_SCRIPT.format(repo=str(REPO), out=str(tmp_path / "one"), batch=2, processes=1)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert "LOSSES" in single.stdout, single.stderr[-2000:]
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(repo=str(REPO), out=str(tmp_path / "two"), batch=1, processes=2))
    # torchrun is the launcher `accelerate launch --multi_gpu` drives; accelerate's own multi-CPU mode needs mpirun.
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
        str(script),
    ]
    double = subprocess.run(launcher, capture_output=True, text=True, timeout=600, env=env)
    assert "LOSSES" in double.stdout, double.stderr[-3000:]
    one = json.loads(single.stdout.split("LOSSES", 1)[1].strip().splitlines()[0])
    two = json.loads(double.stdout.split("LOSSES", 1)[1].strip().splitlines()[0])
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-4 * abs(a), (one, two)
    assert one[0] != one[-1]  # steps really changed the weights


class FakeTokenizer:
    pad_token_id = 0
    eos_token_id = 5

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [10 + (ord(c) % 50) for c in messages[0]["content"]][:20]


def test_regeneration_is_resumable_and_repairs_a_torn_line(tmp_path):
    target = tiny_target(vocab_size=64)
    target.generation_config.eos_token_id = 5
    prompts = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i} " * (i % 3 + 1)}]} for i in range(7)
    ]
    out = tmp_path / "regen.jsonl"
    config = RegenerationConfig(batch_size=3, max_new_tokens=6)
    regenerate(target, FakeTokenizer(), prompts, out, config, max_records=4)
    first = read_regenerated(out)
    assert len(first) == 4 and all(1 <= len(r["response_ids"]) <= 6 for r in first)
    with open(out, "a") as handle:
        handle.write('{"id": "torn", "prompt_ids": [1, 2')  # a crash in the middle of a write
    regenerate(target, FakeTokenizer(), prompts, out, config)
    records = read_regenerated(out)
    assert sorted(r["id"] for r in records) == sorted(p["id"] for p in prompts)
    assert records[:4] == first  # finished work is kept, not redone
    assert all(json.loads(line) for line in out.read_text().splitlines())


def test_decode_batch_drops_ended_rows_and_matches_generate(monkeypatch):
    """Row-dropping decoding equals Transformers' ``generate``, row by row, with rows ending at
    different steps; a broken cache selection or position bookkeeping would change later tokens."""
    target = tiny_target(vocab_size=64, seed=1)
    generator = torch.Generator().manual_seed(3)
    lengths = [5, 9, 3, 7]
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        input_ids[row, width - n :] = torch.randint(2, 64, (n,), generator=generator)
        attention_mask[row, width - n :] = 1
    free = target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, pad_token_id=0)[:, width:]
    eos = int(free[0, 2])  # row 0 ends by its third token; others end wherever this token shows up, or run out
    target.generation_config.eos_token_id = eos
    reference = target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12,
                                do_sample=False, pad_token_id=0)[:, width:].tolist()
    selected = []
    original = DynamicCache.batch_select_indices

    def spy(cache, indices):
        selected.append(indices.tolist())
        return original(cache, indices)

    monkeypatch.setattr(DynamicCache, "batch_select_indices", spy)
    ours = decode_batch(target, input_ids, attention_mask, 12, {eos})
    assert selected and len(selected[0]) < len(lengths)  # ended rows really left the cache
    ends = []
    for row, tokens in enumerate(reference):
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert ours[row] == tokens[:cut], row
        ends.append(cut)
    assert ends[0] <= 3 and max(ends) > ends[0] + 3  # rows really ended at different steps, and decoding went on


def test_decode_batch_with_a_repetition_penalty_decodes_as_generate_does():
    """Each row, batched and left-padded, equals generate(repetition_penalty=...) on that row alone (prompt
    and response so far penalized, padding not); and the penalty really changes the text."""
    target = tiny_target(vocab_size=64, seed=2)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 64, (n,), generator=generator) for n in (4, 9, 6)]
    width = max(len(p) for p in prompts)
    # padding holds the token row 0 says first: a penalty that read the padding would change that token
    first = target.generate(prompts[0][None], attention_mask=torch.ones_like(prompts[0][None]), max_new_tokens=1,
                            do_sample=False, repetition_penalty=1.5, pad_token_id=0)[0, -1]
    input_ids = torch.full((len(prompts), width), int(first), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :], attention_mask[row, width - len(p) :] = p, 1
    free = decode_batch(target, input_ids, attention_mask, 16, {1}, repetition_penalty=1.5)
    eos = free[1][3]  # row 1 ends at its 4th token (or sooner); the others end there too or run on
    target.generation_config.eos_token_id = eos
    ours = decode_batch(target, input_ids, attention_mask, 16, {eos}, repetition_penalty=1.5)
    plain_text = decode_batch(target, input_ids, attention_mask, 16, {eos})
    for row, p in enumerate(prompts):
        alone = target.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=16,
                                do_sample=False, repetition_penalty=1.5, pad_token_id=0)[0, len(p):]
        assert ours[row] == alone.tolist(), row
    assert len(ours[1]) <= 4 and max(len(r) for r in ours) > 8  # rows left the batch while others went on
    assert ours != plain_text
    with pytest.raises(ValueError, match="repetition_penalty must be > 0.*got 0.0"):
        decode_batch(target, input_ids, attention_mask, 4, {1}, repetition_penalty=0.0)


def test_regeneration_records_its_penalty_and_never_resumes_under_another(tmp_path, monkeypatch):
    target = tiny_target(vocab_size=64)
    target.generation_config.eos_token_id = 5
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(4)]
    out = tmp_path / "regen.jsonl"
    regenerate(target, FakeTokenizer(), prompts, out, RegenerationConfig(batch_size=2, max_new_tokens=4,
                                                                        repetition_penalty=1.3), max_records=2)
    records = read_regenerated(out)
    assert len(records) == 2 and all(r["repetition_penalty"] == 1.3 for r in records)
    before = out.read_text()
    with pytest.raises(ValueError, match=r"repetition_penalty \[1.3\]; resuming it with 1.0"):
        regenerate(target, FakeTokenizer(), prompts, out, RegenerationConfig(batch_size=2, max_new_tokens=4))
    assert out.read_text() == before  # nothing written
    regenerate(target, FakeTokenizer(), prompts, out, RegenerationConfig(batch_size=2, max_new_tokens=4,
                                                                        repetition_penalty=1.3))
    assert len(read_regenerated(out)) == 4

    import hf_dflash2.assets
    from hf_dflash2.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hf_dflash2.assets, "load_target", no_load)
    with pytest.raises(SystemExit, match=r"repetition_penalty \[1.3\], not 1.0"):
        main(["regenerate", "--output", str(out)])
    with pytest.raises(SystemExit, match="--repetition-penalty -1.0 must be > 0"):
        main(["regenerate", "--output", str(tmp_path / "new.jsonl"), "--repetition-penalty", "-1"])
    assert out.read_text() != before and not (tmp_path / "new.jsonl").exists()


def test_sharegpt_style_loader_reports_what_it_skipped(tmp_path):
    from hf_dflash2.assets import load_sharegpt_prompts

    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": []},
        {"id": "c", "conversations": [{"from": "gpt", "value": "first"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "   "}]},
    ]
    text = json.dumps(records)[:-1] + ', {"id": "e", "conversations": [{"from": "hu'
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    prompts, report = load_sharegpt_prompts(path)
    assert [p["id"] for p in prompts] == ["a"]
    assert report.skipped == {
        "conversation with no turns": 1,
        "conversation not opened by a human": 1,
        "empty first turn": 1,
        "truncated record at end of file": 1,
    }
    assert "loaded 1" in str(report)


def test_sharegpt_followups_continue_after_the_targets_own_answer(tmp_path):
    from hf_dflash2.assets import load_mtbench_prompts, load_sharegpt_followups
    from hf_dflash2.training.store import drop_evaluation_prompts

    def turns(*values):
        return [{"from": who, "value": v} for who, v in zip(["human", "gpt"] * 3, values)]

    leak = load_mtbench_prompts()[0]["messages"][0]["content"]
    records = [
        {"id": "a", "conversations": turns("hi", "logged answer", "and then?", "more")},
        {"id": "b", "conversations": turns("one turn only", "answer")},
        {"id": "c", "conversations": turns("not answered by the target", "x", "y")},
        {"id": "d", "conversations": turns("q", "a", "   ")},
        {"id": "e", "conversations": turns("q", "a", "please: " + leak)},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    answers = {"a": "the target's answer", "b": "x", "d": "x", "e": "x"}
    prompts, report = load_sharegpt_followups(answers, path)
    assert [p["id"] for p in prompts] == ["a:2", "e:2"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "the target's answer"},
                                      {"role": "user", "content": "and then?"}]
    assert report.skipped == {"no human turn after the answered ones": 1, "empty turn": 1}
    # an evaluation prompt in a later user turn is dropped like one in the first
    assert [p["id"] for p in drop_evaluation_prompts(prompts)] == ["a:2"]
    # with the target's second answers too, the third turns (a conversation must have one)
    records.append({"id": "f", "conversations": turns("q1", "a1", "q2", "a2", "q3")})
    path.write_text(json.dumps(records))
    answers.update({"a:2": "second answer", "f": "first", "f:2": "second", "f:4": "a gap: never used"})
    prompts, report = load_sharegpt_followups(answers, path)
    assert [p["id"] for p in prompts] == ["e:2", "f:3"]
    assert [m["content"] for m in prompts[1]["messages"]] == ["q1", "first", "q2", "second", "q3"]
    assert [m["role"] for m in prompts[1]["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert report.skipped == {"no human turn after the answered ones": 2, "empty turn": 1}  # a has no 3rd turn


def test_regenerate_cli_names_a_missing_followup_source_before_loading(tmp_path, monkeypatch):
    import hf_dflash2.assets
    from hf_dflash2.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hf_dflash2.assets, "load_target", no_load)
    with pytest.raises(SystemExit, match="not found: .*gone.jsonl"):
        main(["regenerate", "--prompts", f"sharegpt-followups:{tmp_path / 'gone.jsonl'}",
              "--output", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()


def test_exported_history_is_thinned_but_keeps_every_evaluation():
    from hf_dflash2.training.export import thin_history

    history = [{"step": i + 1, "loss": 1.0} for i in range(5000)]
    for i in (999, 1999, 4321):
        history[i]["eval_tau"] = 1.2
    thinned = thin_history(history, keep=800)
    assert len(thinned) <= 810
    assert [h["step"] for h in thinned if "eval_tau" in h] == [1000, 2000, 4322]
    assert thinned[0]["step"] == 1 and thinned[-1]["step"] == 5000
    assert thin_history(history[:50]) == history[:50]


def test_heldout_prompt_slices_are_disjoint_and_a_bad_slice_is_named():
    from hf_dflash2.training.commands import heldout_prompts

    first, second = heldout_prompts(100), heldout_prompts(100, slice_index=1)
    assert len(first) == len(second) == 16  # 8 per set: --prompts above 16 adds nothing
    ids = [p["id"] for p in first], [p["id"] for p in second]
    assert sum(i.startswith("HumanEval") for i in ids[1]) == 8 and not set(ids[0]) & set(ids[1])
    # slice 0 is the set every earlier held-out figure was measured on
    assert ids[0][:4] == ["HumanEval/0", "mtbench/81", "HumanEval/1", "mtbench/91"]
    with pytest.raises(ValueError, match="slice_index 10"):
        heldout_prompts(16, slice_index=10)


def test_moving_average_follows_its_recurrence_resumes_exactly_and_is_checkpointed_folded(tmp_path):
    decay = 0.6
    trainer = make_trainer(tmp_path / "a", steps=5, ema_decay=decay)
    expected = [p.detach().clone() for p in trainer.trainable_parameters()]  # the average starts at step 0
    for _ in range(3):
        trainer.train_step()
        expected = [decay * e + (1 - decay) * p.detach() for e, p in zip(expected, trainer.trainable_parameters())]
    for average, wanted in zip(trainer.ema, expected, strict=True):
        assert torch.allclose(average, wanted, atol=1e-6)
    assert any(not torch.allclose(a, p) for a, p in zip(trainer.ema, trainer.trainable_parameters()))

    before = {k: v.clone() for k, v in trainer.exported_state_dict().items()}
    trainer.save_checkpoint()
    state = torch.load(trainer.checkpoint_path, weights_only=False)
    assert all(torch.equal(before[k], v) for k, v in trainer.exported_state_dict().items())  # put back
    assert all(torch.equal(before[k], v) for k, v in state["drafter"].items())
    with trainer.ema_weights():
        averaged = trainer.exported_state_dict()
    assert all(torch.equal(before[k], v) for k, v in trainer.exported_state_dict().items())
    assert state["drafter_ema"].keys() == averaged.keys()
    assert all(torch.equal(state["drafter_ema"][k], averaged[k]) for k in averaged)
    assert not torch.equal(state["drafter_ema"]["fc.weight"], state["drafter"]["fc.weight"])
    drafter = trainer.accelerator.unwrap_model(trainer.drafter)
    trainable = [name for name, p in drafter.named_parameters() if p.requires_grad]
    fc_average = trainer.ema[trainable.index("fc.weight")]
    assert torch.allclose(state["drafter_ema"]["fc.weight"], fc_average / trainer.feature_scale[None])  # folded

    full = make_trainer(tmp_path / "b", steps=5, ema_decay=decay)
    full.train()
    interrupted = make_trainer(tmp_path / "c", steps=5, ema_decay=decay)
    interrupted.train(stop_after=3)
    resumed = make_trainer(tmp_path / "c", steps=5, ema_decay=decay)
    resumed.train(resume=True)
    assert all(torch.equal(a, b) for a, b in zip(full.ema, resumed.ema))

    for other_decay in (0.0, 0.9):  # the average covers a run from its step 0, or the run is refused
        with pytest.raises(ValueError, match=f"ema_decay={other_decay}, but .* ema_decay=0.6"):
            make_trainer(tmp_path / "c", steps=6, ema_decay=other_decay).train(resume=True)
    with pytest.raises(ValueError, match="ema_decay must be in"):
        make_trainer(tmp_path / "d", ema_decay=1.0)

    fine_tune = make_trainer(tmp_path / "f", steps=2, ema_decay=decay)  # starts at the loaded weights
    fine_tune.initialize_from(tmp_path / "b")
    loaded = [p.detach().clone() for p in fine_tune.trainable_parameters()]
    fine_tune.train_step()
    for average, start, current in zip(fine_tune.ema, loaded, fine_tune.trainable_parameters()):
        assert torch.allclose(average, decay * start + (1 - decay) * current.detach(), atol=1e-6)
    plain = make_trainer(tmp_path / "e", steps=2)
    plain.train()
    assert plain.ema is None and torch.load(plain.checkpoint_path, weights_only=False).get("drafter_ema") is None
    from hf_dflash2.training.export import export_head

    with pytest.raises(ValueError, match="no moving average"):
        export_head(tmp_path / "e", tmp_path / "head", ema=True)
    assert not (tmp_path / "head").exists()


def test_loss_gamma_sets_the_position_decay_of_the_loss(tmp_path):
    from hf_dflash2.training.losses import decay_gamma

    default = make_trainer(tmp_path / "a", steps=1)
    steep = make_trainer(tmp_path / "b", steps=1, loss_gamma=1.0)
    assert default.gamma == decay_gamma(4) and steep.gamma == 1.0
    # Same init, data and seed: the first step's loss differs only through the position weights.
    first_default, first_steep = default.train()[0], steep.train()[0]
    assert first_default["loss"] != pytest.approx(first_steep["loss"], rel=1e-4)
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"loss_gamma must be a finite number > 0 .*got {bad}"):
            TrainingConfig(loss_gamma=bad).validate()
    # A resume keeps the decay the run started with (its checkpoint at step 1 is there).
    with pytest.raises(ValueError, match=r"loss_gamma=3.0, but .* trained with loss_gamma=1.0"):
        make_trainer(tmp_path / "b", steps=2, loss_gamma=3.0).train(resume=True)
    with pytest.raises(ValueError, match=r"loss_gamma=None, but .* trained with loss_gamma=1.0"):
        make_trainer(tmp_path / "b", steps=2).train(resume=True)
    assert make_trainer(tmp_path / "b", steps=2, loss_gamma=1.0).train(resume=True)[-1]["step"] == 2


def test_a_wsd_trunk_cooled_down_from_a_copy_of_its_checkpoint_equals_a_run_planned_to_that_length(tmp_path, caplog):
    import shutil

    wsd = dict(lr_schedule="wsd", warmup_steps=2)
    planned = make_trainer(tmp_path / "planned", steps=8, decay_steps=3, **wsd)
    planned.train()
    peak = planned.config.learning_rate
    expected = [0.5, 1, 1, 1, 1, 1, 1 - math.sqrt(1 / 3), 1 - math.sqrt(2 / 3)]  # the rate each step used
    used = [peak / 2] + [h["lr"] for h in planned.history[:-1]]  # history logs the rate for the next step
    assert used == pytest.approx([peak * f for f in expected])
    # The trunk plans 1,000 steps (a constant rate until step 800); after 5 its checkpoint is copied and the copy
    # resumed with steps=8: it cools down into exactly the planned run's head, and the trunk is untouched.
    trunk = make_trainer(tmp_path / "trunk", steps=1000, **wsd)
    trunk.train(stop_after=5)
    assert [h["lr"] for h in trunk.history[1:]] == [peak] * 4
    (tmp_path / "branch").mkdir()
    shutil.copy(tmp_path / "trunk" / "checkpoint.pt", tmp_path / "branch" / "checkpoint.pt")
    branch = make_trainer(tmp_path / "branch", steps=8, decay_steps=3, **wsd)
    branch.train(resume=True)
    a = planned.accelerator.unwrap_model(planned.drafter).state_dict()
    b = branch.accelerator.unwrap_model(branch.drafter).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # A copy taken later than its plan's cool-down start resumes on its plan's rate, and says so.
    (tmp_path / "late").mkdir()
    shutil.copy(tmp_path / "trunk" / "checkpoint.pt", tmp_path / "late" / "checkpoint.pt")
    late = make_trainer(tmp_path / "late", steps=7, decay_steps=3, **wsd)
    with caplog.at_level(logging.WARNING, logger="hf_dflash2.training.trainer"):
        assert late.load_checkpoint()
    assert late.optimizer.param_groups[0]["lr"] == pytest.approx(peak * (1 - math.sqrt(1 / 3)))
    assert "resuming at step 5 with the rate" in caplog.text
    with pytest.raises(ValueError, match=r"lr_schedule=cosine, but .* trained with lr_schedule=wsd"):
        make_trainer(tmp_path / "trunk", steps=1000).train(resume=True)
    assert make_trainer(tmp_path / "trunk", steps=1000, **wsd).train(resume=True, stop_after=1)[-1]["step"] == 6


def test_a_bad_schedule_is_named_before_training():
    for config, message in ((TrainingConfig(lr_schedule="linear"), "must be 'cosine' or 'wsd', got 'linear'"),
                            (TrainingConfig(decay_steps=10), "decay_steps=10 is the wsd schedule's cool-down"),
                            (TrainingConfig(lr_schedule="wsd", steps=100, warmup_steps=10, decay_steps=91),
                             r"decay_steps must be in \[1, steps - warmup = 90\] \(steps=100\), got 91"),
                            (TrainingConfig(lr_schedule="wsd", decay_steps=0), "decay_steps must be in .* got 0")):
        with pytest.raises(ValueError, match=message):
            config.validate()


def test_copy_weight_finds_the_positions_the_ngram_chain_gets_and_weights_only_those(tmp_path):
    from hf_dflash2.training.blocks import ngram_copied_positions
    from hf_dflash2.training.losses import block_loss

    # "5 6 7 8 9" at 1..5, then "5 6 7" again at 6..8: from the anchor at the second 7 (index 8) the 3-gram
    # match drafts what followed the first one, 8 9 5 6; the labels agree on 8 9, then differ, so only the
    # first two are copies.
    ids = torch.tensor([1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 3, 4, 4])
    anchors = torch.tensor([8, 2])
    labels = torch.tensor([[8, 9, 30, 31], [7, 8, 9, 2]])
    copied = ngram_copied_positions(ids, anchors, labels)
    # anchor 2 ("... 5 6"): "6" occurs nowhere before, so no match and no copy
    assert copied.tolist() == [[True, True, False, False], [False, False, False, False]]
    # a copy run stops at the first miss, even where a later token happens to agree
    run = ngram_copied_positions(ids, anchors[:1], torch.tensor([[8, 0, 2, 6]]))
    assert run.tolist() == [[True, False, False, False]]
    # past the end (-100) is never a copy
    assert not ngram_copied_positions(ids, anchors[:1], torch.tensor([[-100, -100, -100, -100]])).any()

    # label weight 0 is exactly the label left out (-100), for the unary and the selector terms alike
    trainer = make_trainer(tmp_path / "w", steps=1)
    drafter = trainer.accelerator.unwrap_model(trainer.drafter)
    torch.manual_seed(0)
    hidden = torch.randn(3, 3, drafter.config.hidden_size)
    labels = torch.randint(0, 64, (3, 3))
    predecessors = torch.randint(0, 64, (3, 3))
    weights = torch.ones(3, 3)
    weights[0, 1] = weights[2, 0] = 0.0
    dropped = labels.clone()
    dropped[0, 1] = dropped[2, 0] = -100
    weighted, m1 = block_loss(drafter, hidden, labels, predecessors, 4.0, label_weights=weights)
    left_out, m2 = block_loss(drafter, hidden, dropped, predecessors, 4.0)
    assert weighted.item() == pytest.approx(left_out.item(), rel=1e-5)
    assert m1["selector_loss"] == pytest.approx(m2["selector_loss"], rel=1e-5)
    plain, _ = block_loss(drafter, hidden, labels, predecessors, 4.0)
    assert plain.item() != pytest.approx(weighted.item(), rel=1e-4)
    assert block_loss(drafter, hidden, labels, predecessors, 4.0, label_weights=torch.ones(3, 3))[0].item() == (
        pytest.approx(plain.item(), rel=1e-6))

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=f"copy_weight must be in \\[0, 1\\] .*got {bad}"):
            TrainingConfig(copy_weight=bad).validate()


def test_copy_weight_trains_on_repetitive_text_and_a_resume_keeps_it(tmp_path):
    repetitive = [{"input_ids": [3, 4, 5, 6, 7, 8, 9, 10] * 4, "response_start": 2} for _ in range(4)]
    plain = make_trainer(tmp_path / "a", steps=1, sequences=repetitive)
    lighter = make_trainer(tmp_path / "b", steps=1, sequences=repetitive, copy_weight=0.2)
    # Same init, data and seed: the first step's loss differs only through the copies' weight.
    assert plain.train()[0]["loss"] != pytest.approx(lighter.train()[0]["loss"], rel=1e-4)
    with pytest.raises(ValueError, match=r"copy_weight=1.0, but .* trained with copy_weight=0.2"):
        make_trainer(tmp_path / "b", steps=2, sequences=repetitive).train(resume=True)
    resumed = make_trainer(tmp_path / "b", steps=2, sequences=repetitive, copy_weight=0.2).train(resume=True)
    assert resumed[-1]["step"] == 2


def test_the_loops_round_starts_follow_each_rounds_accepted_drafts():
    from hf_dflash2.training.blocks import accepted_drafts, loop_round_starts

    # from 10: 2 accepted -> the next round starts at 13; 0 -> 14; 1 -> 16; 0 -> 17, past the window
    assert loop_round_starts(torch.tensor([2, 0, 5, 0, 1, 0, 0]), 10).tolist() == [10, 13, 14, 16]
    assert loop_round_starts(torch.zeros(4, dtype=torch.long), 3).tolist() == [3, 4, 5, 6]  # nothing accepted
    tokens = torch.tensor([[1, 2, 3], [1, 9, 3], [5, 5, 5]])
    labels = torch.tensor([[1, 2, 3], [1, 2, 3], [-100, -100, -100]])
    assert accepted_drafts(tokens, labels).tolist() == [3, 1, 0]  # leading matches only; past the end never


def test_loop_anchors_start_where_the_loops_rounds_start_and_train(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hf_dflash2.training import trainer as trainer_module

    # token t sits at position t - 3, so a draft can be made right or wrong from its anchor's token alone
    sequences = [{"input_ids": list(range(3, 43)), "response_start": 4} for _ in range(4)]
    trainer = make_trainer(tmp_path / "loop", steps=2, sequences=sequences, loop_anchor_share=0.5)
    drafter = trainer.accelerator.unwrap_model(trainer.drafter)
    item = trainer.sequence_item(0)

    def drafting(right: int):  # the first `right` drafts after each anchor are the text's, the rest wrong
        def propose(hidden, logits, anchor_ids, vocab=None):
            text = anchor_ids[:, None] + torch.arange(1, hidden.shape[1] + 1)
            return SimpleNamespace(tokens=torch.where(torch.arange(hidden.shape[1]) < right, text, 0))
        return propose

    rounds = {}
    for right in (0, 1, 3):
        monkeypatch.setattr(drafter, "propose", drafting(right))
        rounds[right] = trainer.loop_anchors(item, 12, 12, torch.Generator().manual_seed(0))
    first = int(rounds[0][0])
    assert 4 <= first <= 38 - 11  # a window of 12 inside the response
    assert rounds[0].tolist() == list(range(first, first + 12))  # nothing accepted: a round at every position
    assert rounds[1].tolist() == list(range(first, first + 12, 2))  # one draft and the target's token a round
    assert rounds[3].tolist() == list(range(first, first + 12, 4))  # the whole block (anchor + 3 drafts)
    assert trainer.loop_anchors(item, 2, 12, torch.Generator().manual_seed(0)).tolist() == rounds[3][:2].tolist()
    monkeypatch.undo()

    # a step's anchors: half the loop's (ceil of 6 * 0.5), the rest a random subset of the uniform ones
    used = []
    real_block_states = trainer_module.Trainer.block_states
    monkeypatch.setattr(trainer_module.Trainer, "block_states", lambda self, item, anchors, block_ids, module=None:
                        used.append(anchors) or real_block_states(self, item, anchors, block_ids, module))
    history = trainer.train()
    assert history[-1]["step"] == 2 and math.isfinite(history[-1]["loss"])
    assert sum(len(a) == 12 for a in used) == 4  # a window of twice the anchors drafted for each sequence
    trained = [a for a in used if len(a) == 6]  # the loss's anchors
    assert len(trained) == 4 and all(len(set(a.tolist())) == 6 and (a.diff() > 0).all() for a in trained)
    with pytest.raises(ValueError, match=r"loop_anchor_share=0.0, but .* trained with loop_anchor_share=0.5"):
        make_trainer(tmp_path / "loop", steps=3, sequences=sequences).train(resume=True)
    for bad in (-0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"loop_anchor_share must be in \[0, 1\]"):
            TrainingConfig(loop_anchor_share=bad).validate()


@pytest.mark.parametrize("values, message", [
    ({"grad_clip": 0.0}, "grad_clip must be a finite number > 0, got 0.0"),
    ({"grad_clip": float("nan")}, "grad_clip must be a finite number > 0, got nan"),
    ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0, got -0.1"),
    ({"selector_weight": float("inf")}, "selector_weight must be a finite number >= 0, got inf"),
    ({"warmup_ratio": 1.0}, r"warmup_ratio must be in \[0, 1\), got 1.0"),
])
def test_optimizer_settings_are_refused_by_name(values, message):
    with pytest.raises(ValueError, match=message):
        TrainingConfig(**values).validate()


def test_export_refuses_layer_ids_that_are_not_integers_by_name(tmp_path):
    from hf_dflash2.training.export import main as export_main

    with pytest.raises(SystemExit, match="export: --target-layer-ids '1,x': expected comma-separated integers"):
        export_main([str(tmp_path / "run"), str(tmp_path / "head"), "--target-layer-ids", "1,x"])
    assert not (tmp_path / "head").exists()
