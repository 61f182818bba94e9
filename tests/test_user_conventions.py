"""What a Transformers user does routinely with a model and an assistant, each found broken in 0.1.0 by an
audit: every layer's hidden states from generate, loading info, subfolders, sharded heads, the embedding
accessors, copies, padding side, and the same text from the same seed."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_dflash2 import DFlash2DraftModel, speculative_generate
from hf_dflash2.modeling_dflash2 import HeadFileError

from .conftest import tiny_drafter, tiny_target

IDS = torch.tensor([[3, 4, 5, 9, 11]])


@pytest.fixture
def pair():
    target = tiny_target()
    return target, tiny_drafter(target)


def test_generate_can_return_every_layers_hidden_states_with_the_head(pair):
    target, drafter = pair
    options = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_hidden_states=True)
    plain = target.generate(IDS, **options)
    assisted = target.generate(IDS, assistant_model=drafter, **options)
    assert torch.equal(assisted.sequences, plain.sequences)
    assert drafter.last_speculative_stats.rounds > 0
    layers = target.config.num_hidden_layers + 1
    assert all(len(step) == layers and all(h is not None for h in step) for step in assisted.hidden_states)
    # the positions covered by the steps' hidden states add up to the sequence, as without the head
    covered = sum(step[0].shape[1] for step in assisted.hidden_states)
    assert covered == sum(step[0].shape[1] for step in plain.hidden_states)


def test_right_padded_rows_are_refused_by_row(pair):
    target, drafter = pair
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"rows \[0\] of the batch end in padding.*padding_side = 'left'"):
        speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=4)


def _head_with_vocab(tmp_path, **save_kwargs):
    target = tiny_target()
    drafter = tiny_drafter(target).set_draft_vocab(list(range(2, 60)))
    drafter.save_pretrained(tmp_path, **save_kwargs)
    return drafter


def test_output_loading_info_and_subfolder_keep_the_draft_vocabulary(tmp_path):
    drafter = _head_with_vocab(tmp_path / "root" / "head")
    model, info = DFlash2DraftModel.from_pretrained(tmp_path / "root" / "head", output_loading_info=True)
    assert torch.equal(model.draft_vocab, drafter.draft_vocab) and not info["missing_keys"]
    nested = DFlash2DraftModel.from_pretrained(tmp_path / "root", subfolder="head")
    assert nested.draft_vocab is not None and torch.equal(nested.draft_vocab, drafter.draft_vocab)


def test_a_truncated_shard_is_a_named_error(tmp_path):
    _head_with_vocab(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    DFlash2DraftModel.from_pretrained(tmp_path)  # whole: loads
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[:-64])
    with pytest.raises(HeadFileError, match=f"{shards[1].name}: truncated"):
        DFlash2DraftModel.from_pretrained(tmp_path)


def test_embedding_accessors_answer_and_copies_share_the_target(pair):
    target, drafter = pair
    assert drafter.get_input_embeddings() is None and drafter.get_output_embeddings() is None  # it owns neither
    assert drafter.num_parameters() == sum(p.numel() for p in drafter.parameters())
    twin = copy.deepcopy(drafter)
    assert twin.bound_target.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    for mine, theirs in zip(twin.parameters(), drafter.parameters()):
        assert mine.data_ptr() != theirs.data_ptr()  # the head's own weights are copied
    first = speculative_generate(target, drafter, IDS, max_new_tokens=8, do_sample=False)
    assert torch.equal(speculative_generate(target, twin, IDS, max_new_tokens=8, do_sample=False).sequences,
                       first.sequences)


def test_the_same_seed_gives_the_same_sample_with_the_adaptive_policy(pair):
    """Both paths, default (adaptive) policy: the verify lengths must not depend on wall-clock time or on the
    previous call, or the number of random draws per round, and so the text, changes from call to call."""
    target, drafter = pair
    prompts = IDS.repeat(3, 1)

    def fast(seed):
        return speculative_generate(target, drafter, prompts, max_new_tokens=40, do_sample=True, temperature=1.5,
                                    generator=torch.Generator().manual_seed(seed)).sequences

    def transformers_path(seed):
        torch.manual_seed(seed)
        return target.generate(IDS, assistant_model=drafter, max_new_tokens=40, do_sample=True, temperature=1.5)

    for run in (fast, transformers_path):
        first = run(7)
        assert all(torch.equal(run(7), first) for _ in range(3)), run.__name__
        assert not torch.equal(run(8), first), run.__name__  # the seed is what decides


def test_resizing_the_heads_embedding_is_refused_and_leaves_the_target_alone(pair):
    target, drafter = pair
    before = target.get_input_embeddings().weight.clone()
    with pytest.raises(NotImplementedError, match="resize or replace it on the target"):
        drafter.resize_token_embeddings(200)
    assert torch.equal(target.get_input_embeddings().weight, before)
    assert target.get_input_embeddings().weight.shape[0] == 96
