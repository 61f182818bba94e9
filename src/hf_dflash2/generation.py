"""The fast speculative loop: batch > 1, acceptance on the device, one small host read per round.

Per round: the drafter proposes ``B - 1`` tokens per row in one pass; the target verifies
``[anchor, drafts]`` in one forward; acceptance (greedy match or lossless rejection sampling), EOS and
budget handling, output writes and the drafter's context bookkeeping all stay on the device. The host
reads one 2-element tensor per round (any row still running, and how many trailing cache slots no
running row needs) - the bounded stop check - and, only when rows finish, which rows to drop.

Rows accept different numbers of tokens, so slots rejected by one row but kept by another stay in the
caches as masked holes; the trailing slots that no row needs are cropped every round (at batch 1 there
are never holes). Finished rows are removed from the batch so they stop costing compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .speculative_dflash2 import (
    SpeculativeStats,
    accept_greedy,
    accept_sampling,
    dense_proposal,
    process_logits,
    tapped_features,
)


@dataclass
class SpeculativeOutput:
    """sequences: [N, prompt + generated] (prompt as given, right-padded with ``pad_token_id`` after
    each row's end); num_generated: [N]; stats: acceptance statistics over all rows and rounds."""

    sequences: torch.Tensor
    num_generated: torch.Tensor
    stats: SpeculativeStats


def _eos_tensor(target, eos_token_id, device) -> torch.Tensor:
    if eos_token_id is None:
        eos_token_id = target.generation_config.eos_token_id
    if eos_token_id is None:
        return torch.empty(0, dtype=torch.long, device=device)
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    return torch.tensor(ids, dtype=torch.long, device=device)


def validate_generation_inputs(target, drafter, input_ids, attention_mask, max_new_tokens, block_size) -> None:
    """Raise a clear ``ValueError`` before any forward pass."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D LongTensor [batch, length], got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): a prompt needs at least one token")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        empty_rows = (attention_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty_rows:
            raise ValueError(f"rows {empty_rows} of the batch have an empty prompt (attention_mask all zero)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not 2 <= block_size:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    limit = target.config.get_text_config().max_position_embeddings
    needed = input_ids.shape[1] + max_new_tokens + block_size
    if limit is not None and needed > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} + block_size {block_size} = {needed} "
            f"exceeds the target's context of {limit} positions"
        )


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.LongTensor | None = None,
    max_new_tokens: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
    streamer=None,
) -> SpeculativeOutput:
    """Generate with the target, drafted by a dFlash 2 / DFlash 1 head. Output equals the target's own.

    input_ids / attention_mask: [N, P], left-padded for N > 1. Greedy by default; ``do_sample`` with
    ``temperature`` / ``top_k`` / ``top_p`` uses lossless speculative sampling with the drafter's q.
    ``streamer`` (batch 1; a Transformers ``TextStreamer`` or anything with ``put``/``end``) receives the
    prompt, then each round's committed tokens - one extra host read per round, only when streaming.
    """
    block_size = block_size or drafter.config.block_size
    validate_generation_inputs(target, drafter, input_ids, attention_mask, max_new_tokens, block_size)
    if do_sample and not temperature > 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}")
    drafter.bind_target(target)
    device = input_ids.device
    n_rows, prompt_width = input_ids.shape
    pad_token_id = pad_token_id if pad_token_id is not None else (target.generation_config.pad_token_id or 0)
    if isinstance(pad_token_id, list):
        pad_token_id = pad_token_id[0]
    stats = SpeculativeStats(block_size)
    if streamer is not None and n_rows != 1:
        raise ValueError(f"streamer needs batch size 1, got {n_rows} rows")
    if max_new_tokens == 0:
        return SpeculativeOutput(input_ids.clone(), torch.zeros(n_rows, dtype=torch.long, device=device), stats)

    eos = _eos_tensor(target, eos_token_id, device)
    layer_ids = drafter.config.target_layer_ids
    capture = [i + 1 for i in layer_ids]  # only the tapped layers' hidden states are kept
    draft_temperature = temperature if do_sample else 0.0
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    slot_valid = attention_mask.bool()
    slot_pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def pick(logits):  # [N, V] -> [N]
        if not do_sample:
            return logits.argmax(-1)
        probs = process_logits(logits, temperature, top_k, top_p).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # lets sliding-window layers be cropped
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=slot_pos,
        cache=cache,
        use_cache=True,
        output_hidden_states=capture,
        logits_to_keep=1,
    )
    draft_kv = drafter.context_kv(drafter.project_context(tapped_features(out.hidden_states, layer_ids)), slot_pos)
    anchor = pick(out.logits[:, -1].float())
    anchor_pos = attention_mask.long().sum(-1)

    generated = torch.full((n_rows, max_new_tokens + block_size), pad_token_id, dtype=torch.long, device=device)
    generated[:, 0] = anchor
    num_generated = torch.ones(n_rows, dtype=torch.long, device=device)
    finished = torch.isin(anchor, eos) | (num_generated >= max_new_tokens)
    if streamer is not None:
        streamer.put(input_ids[0].cpu())
        streamer.put(anchor.cpu())
    rows = torch.arange(n_rows, device=device)  # batch row -> output row
    offsets = torch.arange(block_size, device=device)

    any_running, all_running = (~finished).any().item(), (~finished).all().item()
    while any_running:
        if not all_running:
            keep = (~finished).nonzero().flatten()  # rows finished: drop them, they stop costing
            cache.batch_select_indices(keep)
            draft_kv = [(k[keep], v[keep]) for k, v in draft_kv]
            slot_valid, slot_pos = slot_valid[keep], slot_pos[keep]
            anchor, anchor_pos, rows, finished = anchor[keep], anchor_pos[keep], rows[keep], finished[keep]

        draft = drafter.draft_block(
            anchor, anchor_pos, draft_kv, slot_valid, slot_pos, draft_temperature, generator, block_size
        )
        verify_ids = torch.cat([anchor[:, None], draft.tokens], dim=1)
        verify_pos = anchor_pos[:, None] + offsets
        verify_mask = torch.cat([slot_valid, torch.ones_like(verify_ids, dtype=torch.bool)], dim=1)
        out = target(
            input_ids=verify_ids,
            attention_mask=verify_mask.long(),
            position_ids=verify_pos,
            cache=cache,
            use_cache=True,
            output_hidden_states=capture,
        )
        logits = out.logits.float()
        if do_sample:
            p = process_logits(logits, temperature, top_k, top_p).softmax(-1)
            q = dense_proposal(draft.q_ids, draft.q_probs, logits.shape[-1])
            accepted, tokens = accept_sampling(draft.tokens, q, p, generator)
        else:
            accepted, tokens = accept_greedy(draft.tokens, logits)
        commit = accepted + 1

        # Stop inside the block at EOS or at the token budget.
        within = offsets[None] < commit[:, None]
        is_eos = torch.isin(tokens, eos) & within
        eos_cut = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, commit)
        budget = max_new_tokens - num_generated[rows]
        count = torch.minimum(eos_cut, budget)
        stats.record(accepted, count)
        write_at = num_generated[rows][:, None] + offsets
        current = generated[rows[:, None], write_at]
        generated[rows[:, None], write_at] = torch.where(offsets[None] < count[:, None], tokens, current)
        if streamer is not None:
            streamer.put(tokens[0, : int(count[0])].cpu())
        num_generated[rows] += count
        finished = is_eos.any(-1) | (num_generated[rows] >= max_new_tokens)

        # The anchor and the accepted drafts become the drafter's context; the bonus is the next anchor.
        new_kv = drafter.context_kv(drafter.project_context(tapped_features(out.hidden_states, layer_ids)), verify_pos)
        draft_kv = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(draft_kv, new_kv)]
        slot_valid = torch.cat([slot_valid, within], dim=1)
        slot_pos = torch.cat([slot_pos, verify_pos], dim=1)
        anchor = tokens.gather(1, accepted[:, None]).squeeze(1)
        anchor_pos = anchor_pos + commit

        # The one host read per round: any row running, all rows running, trailing slots no running row needs.
        unused_tail = torch.where(finished, block_size, block_size - commit).min()
        any_running, all_running, crop = torch.stack(
            [(~finished).any().long(), (~finished).all().long(), unused_tail.long()]
        ).tolist()
        if crop > 0 and any_running:
            cache.crop(-crop)
            draft_kv = [(k[:, :, :-crop], v[:, :, :-crop]) for k, v in draft_kv]
            slot_valid, slot_pos = slot_valid[:, :-crop], slot_pos[:, :-crop]

    if streamer is not None:
        streamer.end()
    width = int(num_generated.max())
    return SpeculativeOutput(torch.cat([input_ids, generated[:, :width]], dim=1), num_generated, stats)
