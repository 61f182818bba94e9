"""Greedy identity under random cases: speculative output equals the target's own greedy output.

Each case draws an architecture (Llama / Qwen3 / Mistral / Gemma3), a block size 2-16, a batch of 1-4
prompts of 1-12 tokens (left-padded together), a budget of 1-40 new tokens and, mostly, an EOS token taken
from the true continuation, so that it lands inside blocks. The drafter is a noisy oracle: it proposes the
true continuation up to a random cut and noise after it, so every acceptance length occurs. Each row of
the batched fast loop, and ``generate(assistant_model=...)`` on one row, must equal plain greedy decoding of
that row alone.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from collections import Counter

import pytest
import torch

from hf_dflash2 import DFlash2DraftModel, speculative_generate

from .conftest import tiny_target

ARCHS = ("llama", "qwen3", "mistral", "gemma3")
VOCAB = 96


class NoisyOracleDrafter(DFlash2DraftModel):
    """Proposes the true greedy continuation up to a random cut, then random tokens.

    ``continuations`` maps (position, token at that position) to the tokens that truly follow it.
    """

    def draft_block(self, anchor_ids, anchor_positions, *args, **kwargs):
        draft = super().draft_block(anchor_ids, anchor_positions, *args, **kwargs)
        tokens = draft.tokens.clone()
        drafted = tokens.shape[1]
        for row, (token, position) in enumerate(zip(anchor_ids.tolist(), anchor_positions.tolist())):
            truth = self.continuations.get((position, token), [])[:drafted]
            cut = self.rng.randint(0, drafted) if self.rng.random() < 0.7 else drafted  # whole blocks too
            noise = [self.rng.randrange(2, VOCAB) for _ in range(drafted)]
            if cut < len(truth):
                noise[cut] = truth[cut] % (VOCAB - 2) + 2 if noise[cut] == truth[cut] else noise[cut]
            proposal = truth[:cut] + noise[len(truth[:cut]):]
            tokens[row] = torch.tensor(proposal[:drafted], dtype=tokens.dtype)
        return dataclasses.replace(draft, tokens=tokens)


_TARGETS: dict = {}
_DRAFTERS: dict = {}
# The fuzz checks identity for every acceptance length, so every drafted token is verified (the adaptive
# verify length, where the loop has one, is the loop's own tests' business).
FIXED_VERIFY = {"adaptive": False} if "adaptive" in inspect.signature(speculative_generate).parameters else {}


def target_for(arch: str):
    if arch not in _TARGETS:
        target = tiny_target(arch, vocab_size=VOCAB, seed=ARCHS.index(arch)).to(torch.float64)
        with torch.no_grad():  # sharper logits: no near-ties between batched and single-row arithmetic
            target.get_output_embeddings().weight.mul_(8.0)
        _TARGETS[arch] = target
    return _TARGETS[arch]


def greedy_alone(target, prompt: list[int], budget: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=False,
                          eos_token_id=None, top_k=None, top_p=None, temperature=None)
    return out[0, len(prompt):].tolist()


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def run_case(seed: int, arch: str, histogram: Counter) -> None:
    rng = random.Random(seed)
    target = target_for(arch)
    block_size, budget, batch = rng.randint(2, 16), rng.randint(1, 40), rng.randint(1, 4)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(batch)]
    free = [greedy_alone(target, p, budget) for p in prompts]
    eos = rng.choice(rng.choice(free)) if rng.random() < 0.8 else None
    expected = [until_eos(f, eos) for f in free]

    if (arch, block_size) not in _DRAFTERS:
        _DRAFTERS[arch, block_size] = NoisyOracleDrafter.for_target(
            target, block_size=block_size, mask_token_id=1, selector_rank=8, selector_top_k=4, seed=block_size
        ).eval()
    drafter = _DRAFTERS[arch, block_size]
    drafter.rng = random.Random(seed + 1)
    drafter.continuations = {}
    for prompt, continuation in zip(prompts, free):
        sequence = prompt + continuation
        for position, token in enumerate(sequence):
            drafter.continuations.setdefault((position, token), sequence[position + 1 :])

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    result = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=budget, eos_token_id=eos,
                                  pad_token_id=0, **FIXED_VERIFY)
    case = dict(seed=seed, arch=arch, block_size=block_size, budget=budget, eos=eos, prompts=prompts)
    for row, want in enumerate(expected):
        n = int(result.num_generated[row])
        assert result.sequences[row, width : width + n].tolist() == want, case
    for accepted, count in enumerate(result.stats.accepted_histogram):
        histogram[accepted] += int(count)

    row = rng.randrange(batch)
    single = torch.tensor([prompts[row]])
    out = target.generate(single, attention_mask=torch.ones_like(single), assistant_model=drafter,
                          max_new_tokens=budget, eos_token_id=eos, do_sample=False, top_k=None, top_p=None,
                          temperature=None)
    assert out[0, len(prompts[row]):].tolist() == expected[row], {**case, "path": "generate", "row": row}


def run_cases(arch: str, count: int, first_seed: int) -> Counter:
    torch.manual_seed(0)
    histogram: Counter = Counter()
    with torch.no_grad():
        for seed in range(first_seed, first_seed + count):
            run_case(seed, arch, histogram)
    return histogram


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identity_fuzz_quick(arch):
    """6 cases per architecture (the inner-loop subset of the fuzz below)."""
    histogram = run_cases(arch, 6, first_seed=1000 * (ARCHS.index(arch) + 1))
    assert sum(histogram.values()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identity_fuzz(arch):
    """80 Llama cases, in which every acceptance length 0..15 occurs, and 30 per other architecture (the
    suite's time budget: the cases are the same generator, only the target's modeling code differs)."""
    count = 80 if arch == "llama" else 30
    histogram = run_cases(arch, count, first_seed=100_000 * (ARCHS.index(arch) + 1))
    lengths = [k for k, count in histogram.items() if count]
    if arch == "llama":
        assert set(range(16)) <= set(lengths), sorted(histogram.items())
    else:
        assert len(lengths) >= 4, sorted(histogram.items())
