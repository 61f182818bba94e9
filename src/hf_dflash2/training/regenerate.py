"""Regenerate responses with the target itself, so the drafter learns the target's own distribution.

Output is an append-only JSONL of ``{"id", "prompt_ids", "response_ids"}`` (plus ``"repetition_penalty"``
when one was set: a head that serves a penalized decode should learn from penalized text, since a penalty
halves what a head trained on plain text gets right; ``docs/benchmarks.md``). Each batch is
appended with one write followed by fsync; a line cut short by a crash is dropped on the next
start (the file is rewritten atomically without it), and finished prompt ids are skipped.

Batches are decoded by ``decode_batch``, not ``generate``: ``generate`` keeps every row of a batch until
the longest one ends, and most answers end well before the token budget, so most
of its row-steps were spent on rows that had already ended. ``decode_batch`` drops a row
from the KV cache as soon as it ends. Prompts are length-sorted within chunks (less left padding).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..generation import apply_repetition_penalty
from ..speculative_dflash2 import last_position


@dataclass
class RegenerationConfig:
    max_prompt_tokens: int = 256
    max_new_tokens: int = 192
    batch_size: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0  # 1.0: none; else as generate's, on the prompt and the response so far


def read_regenerated(path: str | Path) -> list[dict]:
    """All complete records of a regeneration file (a torn last line is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # only the last line can be torn: appends are whole lines
    return records


def other_penalties(records: list[dict], repetition_penalty: float) -> set[float]:
    """The repetition penalties ``records`` were decoded with, other than ``repetition_penalty`` (one file, one
    decode: records made under another penalty would mix two texts' laws in one store)."""
    return {r.get("repetition_penalty", 1.0) for r in records} - {repetition_penalty}


def _drop_partial_records(path: Path) -> list[dict]:
    records = read_regenerated(path)
    if path.exists() and len(path.read_text(encoding="utf-8").splitlines()) != len(records):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    return records


def encode_prompts(tokenizer, prompts: list[dict], max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    encoded = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if len(ids) <= max_prompt_tokens:
            encoded.append((prompt["id"], list(ids)))
    return encoded


def response_eos_ids(target, tokenizer) -> set[int]:
    """The ids that end a response: the target's generation config's EOS ids and the tokenizer's."""
    ids = target.generation_config.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    return {i for i in [*ids, tokenizer.eos_token_id] if i is not None}


@torch.no_grad()
def decode_batch(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    do_sample: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    repetition_penalty: float = 1.0,
) -> list[list[int]]:
    """Greedy (or sampled) decoding of left-padded prompts [N, P] that drops each row once it ends.

    Returns each row's new tokens, up to and including its first EOS (or ``max_new_tokens`` of them).
    Greedy, it is token for token ``generate``'s output: a row's logits never depend on the other rows
    (masked padding, per-row positions), so removing finished rows changes nothing else. Sampling is
    plain temperature sampling (no top-k / top-p from the target's generation config).
    ``repetition_penalty`` (1.0: none) acts as ``generate``'s on one unpadded row: every token of the row's
    prompt and of its response so far gets its logit divided by it (multiplied where negative). Padding is
    not text, so a batched row decodes as it would alone (``generate`` would also penalize the pad token).
    Needs a cache that supports ``batch_select_indices`` (attention KV caches; not linear-attention layers).
    """
    if do_sample and not temperature > 0:
        raise ValueError(f"do_sample needs temperature > 0, got {temperature}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0: none), got {repetition_penalty}")
    device = input_ids.device
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    cache = DynamicCache(config=target.config)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                    use_cache=True, logits_to_keep=last_position(input_ids.shape[1], device)).logits[:, -1]
    rows = torch.arange(input_ids.shape[0], device=device)  # output row of each live cache row
    next_position = positions[:, -1] + 1
    mask = attention_mask.long()
    outputs: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
    seen = None  # [n, V] the tokens each live row's text holds, when a penalty reads them
    if repetition_penalty != 1.0:
        seen = torch.zeros(input_ids.shape[0], logits.shape[-1] + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, torch.where(attention_mask.bool(), input_ids, logits.shape[-1]).clamp(max=logits.shape[-1]),
                      True)  # padding (and ids past the logits) land in the spare last column
        seen = seen[:, :-1]
    for step in range(max_new_tokens):
        if seen is not None:  # in float32, where generate applies its processors
            logits = apply_repetition_penalty(logits.float(), seen, repetition_penalty)
        if do_sample:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            tokens = logits.argmax(-1)
        ended = torch.isin(tokens, eos)
        for row, token in zip(rows.tolist(), tokens.tolist()):  # the one host read per step
            outputs[row].append(token)
        if step == max_new_tokens - 1:
            break
        if bool(ended.any()):
            keep = (~ended).nonzero().flatten()
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            rows, tokens, next_position, mask = rows[keep], tokens[keep], next_position[keep], mask[keep]
            seen = None if seen is None else seen[keep]
        if seen is not None:
            seen[torch.arange(tokens.shape[0], device=device), tokens] = True
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = target(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                        cache=cache, use_cache=True).logits[:, -1]
        next_position = next_position + 1
    return outputs


@torch.no_grad()
def regenerate(
    target,
    tokenizer,
    prompts: list[dict],
    output_path: str | Path,
    config: RegenerationConfig = RegenerationConfig(),
    max_records: int | None = None,
) -> Path:
    """Write the target's responses to ``prompts`` into ``output_path``, resuming where it stopped."""
    if config.batch_size < 1 or config.max_new_tokens < 1:
        raise ValueError(f"batch_size ({config.batch_size}) and max_new_tokens ({config.max_new_tokens}) must be >= 1")
    if not config.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0: none), got {config.repetition_penalty}")
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    existing = _drop_partial_records(output_path)
    if other_penalties(existing, config.repetition_penalty):
        penalties = {r.get("repetition_penalty", 1.0) for r in existing}
        raise ValueError(f"{output_path} holds responses decoded with repetition_penalty {sorted(penalties)}; "
                         f"resuming it with {config.repetition_penalty} would mix them (use another --output)")
    done = {r["id"] for r in existing}
    todo = [p for p in encode_prompts(tokenizer, prompts, config.max_prompt_tokens) if p[0] not in done]
    if max_records is not None:
        todo = todo[: max(0, max_records - len(done))]
    # Sorting by length inside chunks keeps padding low while an early stop still covers all lengths.
    chunk = config.batch_size * 16
    todo = [item for i in range(0, len(todo), chunk) for item in sorted(todo[i : i + chunk], key=lambda x: len(x[1]))]
    pad_id = tokenizer.pad_token_id
    eos_ids = response_eos_ids(target, tokenizer)
    device = next(target.parameters()).device
    progress = tqdm(total=len(todo), desc="regenerate", unit="prompt", initial=0)
    started, new_tokens = time.perf_counter(), 0
    for start in range(0, len(todo), config.batch_size):
        batch = todo[start : start + config.batch_size]
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (_, ids) in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        generator = torch.Generator(device=device).manual_seed(config.seed + start)
        out = decode_batch(target, input_ids.to(device), attention_mask.to(device), config.max_new_tokens, eos_ids,
                           config.do_sample, config.temperature, generator, config.repetition_penalty)
        penalty = {} if config.repetition_penalty == 1.0 else {"repetition_penalty": config.repetition_penalty}
        lines = []
        for (prompt_id, prompt_ids), response in zip(batch, out):
            record = {"id": prompt_id, "prompt_ids": prompt_ids, "response_ids": response, **penalty}
            lines.append(json.dumps(record) + "\n")
        with open(output_path, "a", encoding="utf-8") as handle:
            handle.write("".join(lines))
            handle.flush()
            os.fsync(handle.fileno())
        new_tokens += sum(len(r) for r in out)
        progress.update(len(batch))
        progress.set_postfix(tok_per_s=f"{new_tokens / (time.perf_counter() - started):.0f}")
    progress.close()
    return output_path
