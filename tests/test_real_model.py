"""SmolLM2-135M-Instruct (the real target, installed offline) with a freshly initialised head:
greedy output through both paths equals plain greedy generate token for token."""

from __future__ import annotations

import pytest
import torch

from hf_dflash2 import DFlash2DraftModel, speculative_generate

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for staying focused while studying.",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from hf_dflash2.assets import load_target

    try:
        return load_target()
    except FileNotFoundError as error:
        pytest.skip(str(error))


def encode(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])


def test_real_model_greedy_identity_both_paths(smollm2):
    target, tokenizer = smollm2
    assert target.config.num_hidden_layers == 30 and target.config.hidden_size == 576 and target.config.vocab_size == 49152
    drafter = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=16, selector_rank=32, target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0)
    drafter.eval().bind_target(target)
    for text in PROMPTS:
        ids = encode(tokenizer, text)
        expected = target.generate(ids, max_new_tokens=24, do_sample=False, top_k=None, top_p=None, temperature=None)
        fast = speculative_generate(target, drafter, ids, max_new_tokens=24)
        assert torch.equal(fast.sequences, expected), text
        hf = target.generate(ids, assistant_model=drafter, max_new_tokens=24, do_sample=False, top_k=None, top_p=None, temperature=None)
        assert torch.equal(hf, expected), text
        assert fast.stats.rounds > 0 and drafter.last_speculative_stats.rounds > 0


def test_real_model_batched_rows_equal_single(smollm2):
    target, tokenizer = smollm2
    drafter = DFlash2DraftModel.for_target(target, num_hidden_layers=1, block_size=8, dflash2=False, mask_token_id=0).eval().bind_target(target)
    rows = [encode(tokenizer, t) for t in PROMPTS[:2]]
    width = max(r.shape[1] for r in rows)
    ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1]:] = r[0]
        mask[i, width - r.shape[1]:] = 1
    out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=16)
    for i, r in enumerate(rows):
        alone = target.generate(r, max_new_tokens=16, do_sample=False, top_k=None, top_p=None, temperature=None)[0, r.shape[1]:]
        n = int(out.num_generated[i])
        assert torch.equal(out.sequences[i, width:width + n], alone[:n])


def test_text_generation_pipeline_takes_the_committed_head_as_its_assistant(smollm2):
    """``pipeline("text-generation", assistant_model=head)``: chat messages in, the same reply as the plain
    pipeline out (fp32 greedy is exact), and the head did draft (its rounds are counted)."""
    from pathlib import Path

    from transformers import pipeline

    from hf_dflash2.prompts import load_head

    target, tokenizer = smollm2
    folder = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-dflash2"
    if not folder.exists():
        pytest.skip("no committed head in this checkout")
    head = load_head(str(folder), target)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    greedy = dict(max_new_tokens=24, do_sample=False, top_k=None, top_p=None, temperature=None)
    head.last_speculative_stats = None
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=head)(messages, **greedy)
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)(messages, **greedy)
    assert assisted[0]["generated_text"][-1]["role"] == "assistant"
    assert assisted[0]["generated_text"] == plain[0]["generated_text"]
    assert head.last_speculative_stats is not None and head.last_speculative_stats.rounds > 0
