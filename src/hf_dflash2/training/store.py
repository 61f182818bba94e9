"""A feature/label store: the target runs over the training text once, training reads it for many epochs.

A prefill over existing text is many times cheaper per token than generating it, and it yields, at every
position, the target's tapped hidden states (the drafter's context) and the target's own next-token
distribution (labels). The store keeps, per token:

- ``tokens``        int32                      the text itself (data-token labels);
- ``features``      bf16 [taps * H]            tapped target layers, memory-mapped at training time;
- ``topk_ids``      int32 [k]                  the target's top-k next tokens (``[0]`` = its argmax);
- ``topk_logprobs`` fp16 [k]                   their log-probabilities (sparse KL labels);
- ``final``         bf16 [H]  (optional)       what the target's LM head reads at that position (its last,
                                               normed hidden state): a distillation target for the drafter's
                                               own LM-head input, which feeds the same LM head.

Layout: ``meta.json`` (what produced the store, checked on reopen), ``index.jsonl`` (one line per shard:
its sequences and their offsets) and, per shard, one ``.npy`` file per array. A shard's files are written and
fsynced first and its index line is appended last, so the index line is the commit point: a kill at
any moment leaves a readable store (an orphan shard is overwritten by the next append; a torn index
line is dropped on open).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

STORE_VERSION = 1
ARRAYS = ("tokens", "features", "topk_ids", "topk_logprobs")
FINAL_HIDDEN_ARRAY = "final"


@dataclass
class StoreMeta:
    target: str
    target_layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    top_k: int = 32
    version: int = STORE_VERSION
    notes: dict = field(default_factory=dict)  # free-form, for whoever builds a store by hand
    # Stores written by 0.1.0 may lack this field: they keep no final hidden states.
    final_hidden: bool = False

    @property
    def feature_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def arrays(self) -> tuple[str, ...]:
        return ARRAYS + ((FINAL_HIDDEN_ARRAY,) if self.final_hidden else ())


def _bf16_bits(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as bf16, stored as int16 bits (numpy has no bf16)."""
    return tensor.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()


def _from_bf16_bits(array: np.ndarray) -> torch.Tensor:
    """A copy of stored int16 bits (e.g. a memory-mapped slice) as a bf16 tensor."""
    return torch.from_numpy(np.array(array)).view(torch.bfloat16)


def _fsync_write(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as handle:
        np.save(handle, array)
        handle.flush()
        os.fsync(handle.fileno())


# What a store was built with; appending with any other value would mix two kinds of rows.
_BUILD_FIELDS = ("target", "target_layer_ids", "hidden_size", "vocab_size", "top_k", "final_hidden")


def read_store_meta(root: str | Path) -> StoreMeta:
    """The ``meta.json`` of the store at ``root``; a store of another format version is refused by name before
    its fields are read (a later version may have others)."""
    meta = json.loads((Path(root) / "meta.json").read_text())
    if meta.get("version", STORE_VERSION) != STORE_VERSION:
        raise ValueError(f"{root}: a store of format version {meta['version']}; this version of hf_dflash2 reads "
                         f"version {STORE_VERSION}")
    return StoreMeta(**meta)


def check_store_fields(root: str | Path, stored: StoreMeta | None = None, fields: dict | None = None) -> None:
    """Refuse to append to the store at ``root`` with build ``fields`` other than its own (named in the error).

    ``fields`` may hold only some of the build fields: ``hf-dflash2 store`` checks those its arguments fix
    before it loads the target, and the rest (sizes from the target's config) once the target is loaded.
    A folder without ``meta.json`` (a new store) passes.
    """
    if stored is None:
        meta_path = Path(root) / "meta.json"
        if not meta_path.exists():
            return
        stored = read_store_meta(root)
    for name, value in (fields or {}).items():
        if name not in _BUILD_FIELDS:
            raise KeyError(f"{name!r} is not a store build field; those are {_BUILD_FIELDS}")
        if value != getattr(stored, name):
            raise ValueError(
                f"store {root} was built with {name}={getattr(stored, name)!r}, "
                f"not {value!r}: use another store folder"
            )


class FeatureStore:
    """Append-only, resumable store of target features and labels. Index a sequence with ``store[i]``.

    ``FeatureStore(root, meta)`` opens for writing (creates, or checks ``meta`` and repairs a torn index
    tail); ``FeatureStore(root)`` opens read-only and never modifies the folder, so training can read a
    store that another process is still appending to.
    """

    def __init__(self, root: str | Path, meta: StoreMeta | None = None):
        self.root = Path(root)
        self.writable = meta is not None
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            stored = read_store_meta(self.root)
            if meta is not None:
                check_store_fields(self.root, stored, {name: getattr(meta, name) for name in _BUILD_FIELDS})
            self.meta = stored
        elif meta is None:
            raise FileNotFoundError(
                f"{self.root}: not a feature store (no meta.json); build one with `hf-dflash2 store`"
            )
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(meta), indent=1))
            os.replace(tmp, meta_path)
            self.meta = meta
        self.shards: list[dict] = self._read_index()
        self._rows: list[tuple[int, int]] = [
            (s, j) for s, shard in enumerate(self.shards) for j in range(len(shard["ids"]))
        ]
        self._arrays: dict[int, dict[str, np.ndarray]] = {}

    # ------------------------------------------------------------------ index
    def _read_index(self) -> list[dict]:
        path = self.root / "index.jsonl"
        if not path.exists():
            return []
        raw = path.read_bytes()
        shards, good = [], 0
        for line in raw.split(b"\n"):
            if not line:
                break
            try:
                shards.append(json.loads(line))
            except json.JSONDecodeError:
                break
            good += len(line) + 1
        if good != len(raw) and self.writable:  # a torn last line from a kill mid-append: drop it, atomically
            logger.warning("%s: dropping a torn index line (%d bytes)", path, len(raw) - good)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(raw[:good])
            os.replace(tmp, path)
        return shards

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def num_tokens(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)

    @property
    def record_ids(self) -> set[str]:
        return set(self.sequence_ids())

    # ------------------------------------------------------------------ writing
    def append(
        self,
        sequences: list[dict],
        features: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_logprobs: torch.Tensor,
        final_hidden: torch.Tensor | None = None,
    ) -> None:
        """Add one shard. ``sequences``: ``{"id", "input_ids", "response_start"}`` in order; the tensors are
        the concatenation over their tokens: features [T, taps*H], topk_ids / topk_logprobs [T, k] and,
        exactly when the store keeps them (``meta.final_hidden``), final_hidden [T, H]."""
        if not self.writable:
            raise PermissionError(f"store {self.root} was opened read-only; open it with its StoreMeta to append")
        total = sum(len(s["input_ids"]) for s in sequences)
        width, k = self.meta.feature_width, self.meta.top_k
        if features.shape != (total, width) or topk_ids.shape != (total, k) or topk_logprobs.shape != (total, k):
            raise ValueError(
                f"shard shapes features {tuple(features.shape)}, topk {tuple(topk_ids.shape)} do not match "
                f"{total} tokens x {width} features / top-{k}"
            )
        if (final_hidden is not None) != self.meta.final_hidden:
            raise ValueError(
                f"store {self.root} has final_hidden={self.meta.final_hidden}, but the shard "
                f"{'has' if final_hidden is not None else 'lacks'} final hidden states"
            )
        if final_hidden is not None and final_hidden.shape != (total, self.meta.hidden_size):
            raise ValueError(
                f"shard final_hidden {tuple(final_hidden.shape)} does not match "
                f"{total} tokens x {self.meta.hidden_size}"
            )
        number = len(self.shards)
        arrays = {
            "tokens": np.concatenate([np.asarray(s["input_ids"], dtype=np.int32) for s in sequences]),
            "features": _bf16_bits(features),
            "topk_ids": topk_ids.to(torch.int32).cpu().numpy(),
            "topk_logprobs": topk_logprobs.to(torch.float16).cpu().numpy(),
        }
        if final_hidden is not None:
            arrays[FINAL_HIDDEN_ARRAY] = _bf16_bits(final_hidden)
        for name, array in arrays.items():
            _fsync_write(self.root / f"shard{number:05d}.{name}.npy", array)
        offsets = np.cumsum([0] + [len(s["input_ids"]) for s in sequences]).tolist()
        entry = {
            "shard": number,
            "tokens": total,
            "ids": [str(s["id"]) for s in sequences],
            "offsets": offsets,
            "response_starts": [int(s["response_start"]) for s in sequences],
        }
        with open(self.root / "index.jsonl", "ab") as handle:  # the commit point
            handle.write((json.dumps(entry) + "\n").encode())
            handle.flush()
            os.fsync(handle.fileno())
        self.shards.append(entry)
        self._rows.extend((number, j) for j in range(len(sequences)))

    # ------------------------------------------------------------------ reading
    def _shard_arrays(self, number: int) -> dict[str, np.ndarray]:
        if number not in self._arrays:
            self._arrays[number] = {
                name: np.load(self.root / f"shard{number:05d}.{name}.npy", mmap_mode="r") for name in self.meta.arrays
            }
        return self._arrays[number]

    def __getitem__(self, index: int) -> dict:
        """``{"id", "input_ids" [T] long, "response_start", "features" [T, F] bf16, "topk_ids" [T, k] long,
        "topk_logprobs" [T, k] float}`` of one sequence (the features are a copy of the mapped slice), and
        ``"final_hidden"`` [T, H] bf16 when the store keeps it."""
        number, j = self._rows[index]
        shard = self.shards[number]
        start, end = shard["offsets"][j], shard["offsets"][j + 1]
        arrays = self._shard_arrays(number)
        item = {
            "id": shard["ids"][j],
            "input_ids": torch.from_numpy(np.array(arrays["tokens"][start:end], dtype=np.int64)),
            "response_start": shard["response_starts"][j],
            "features": _from_bf16_bits(arrays["features"][start:end]),
            "topk_ids": torch.from_numpy(np.array(arrays["topk_ids"][start:end], dtype=np.int64)),
            "topk_logprobs": torch.from_numpy(np.array(arrays["topk_logprobs"][start:end], dtype=np.float32)),
        }
        if self.meta.final_hidden:
            item["final_hidden"] = _from_bf16_bits(arrays[FINAL_HIDDEN_ARRAY][start:end])
        return item

    def sequence_ids(self) -> list[str]:
        """Every sequence's record id (``regen/...``, ``sharegpt/...``), in index order."""
        return [record_id for shard in self.shards for record_id in shard["ids"]]

    def sequence_lengths(self) -> list[tuple[int, int]]:
        """(length, response_start) of every sequence, without touching the arrays."""
        out = []
        for shard in self.shards:
            offsets = shard["offsets"]
            out.extend((offsets[j + 1] - offsets[j], shard["response_starts"][j]) for j in range(len(shard["ids"])))
        return out

    def response_vocabulary(self, size: int | None = None) -> torch.Tensor:
        """Sorted token ids that occur as a response token or as the target's argmax in a response; with
        ``size``, only the ``size`` most frequent of them (a draft vocabulary: cheaper LM head)."""
        seen = np.zeros(self.meta.vocab_size, dtype=np.int64)
        for number, shard in enumerate(self.shards):
            arrays = self._shard_arrays(number)
            offsets = shard["offsets"]
            for j, response_start in enumerate(shard["response_starts"]):
                start, end = offsets[j] + response_start, offsets[j + 1]
                np.add.at(seen, np.asarray(arrays["tokens"][start:end]), 1)
                np.add.at(seen, np.asarray(arrays["topk_ids"][max(start - 1, 0) : end, 0]), 1)
        present = np.nonzero(seen)[0]
        if size is not None and size < len(present):
            present = np.sort(present[np.argsort(-seen[present], kind="stable")[:size]])
        return torch.from_numpy(present.astype(np.int64))


# ---------------------------------------------------------------------- building
@torch.no_grad()
def target_labels(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layer_ids: list[int],
    top_k: int,
    final_hidden: bool = False,
):
    """One target prefill -> (features [N, T, taps*H], topk_ids [N, T, k], topk_logprobs [N, T, k],
    final [N, T, H] or None). ``final`` is the LM head's input, read by a hook on the output embeddings,
    which holds for any causal LM whatever its ``hidden_states`` convention."""
    from ..speculative_dflash2 import tapped_features

    captured = []
    hook = None
    if final_hidden:
        hook = target.get_output_embeddings().register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    try:
        out = target(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=[i + 1 for i in layer_ids],
            use_cache=False,
        )
    finally:
        if hook is not None:
            hook.remove()
    features = tapped_features(out.hidden_states, layer_ids)
    # top-k of the logits equals top-k of the log-probabilities; one float logsumexp per row chunk
    # avoids materialising a float log-softmax over the whole vocabulary.
    values, ids = out.logits.topk(top_k, dim=-1)
    logprobs = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    for row in range(out.logits.shape[0]):
        logprobs[row] = values[row].float() - out.logits[row].float().logsumexp(-1, keepdim=True)
    return features, ids, logprobs, (captured[0] if final_hidden else None)


def build_store(
    target,
    records: list[dict],
    store: FeatureStore,
    tokens_per_batch: int = 4096,
    tokens_per_shard: int = 65536,
    max_tokens: int | None = None,
    pad_token_id: int = 0,
) -> FeatureStore:
    """Run the target over ``records`` (``{"id", "input_ids", "response_start"}``) not yet in the store.

    Sequences are sorted by length and batched up to ``tokens_per_batch`` padded tokens (right padding:
    the causal target never lets padding change a real position). Stops once the store holds
    ``max_tokens``. Resumable: records already stored are skipped by id.
    """
    done = store.record_ids
    todo = [r for r in records if str(r["id"]) not in done]
    budget = None if max_tokens is None else max_tokens - store.num_tokens
    if budget is not None:
        kept, total = [], 0
        for record in todo:
            if total >= budget:
                break
            kept.append(record)
            total += len(record["input_ids"])
        if len(kept) < len(todo):
            # A cap that cuts the sources short is silent otherwise, and the records left out come last
            # (a source listed last can lose most of itself).
            left_out = todo[len(kept) :]
            logger.warning(
                "store %s: max_tokens=%d leaves out %d of the sources' records (%d tokens); raise it to store them",
                store.root,
                max_tokens,
                len(left_out),
                sum(len(r["input_ids"]) for r in left_out),
            )
        todo = kept
    # Length-sorted inside windows of records: little padding, and a partial store (a run stopped
    # early, or read while it grows) still covers every length in the given order.
    window = 512
    todo = [
        r for i in range(0, len(todo), window) for r in sorted(todo[i : i + window], key=lambda r: len(r["input_ids"]))
    ]
    device = next(target.parameters()).device
    layer_ids, k = store.meta.target_layer_ids, store.meta.top_k
    pending: list[tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    progress = tqdm(total=sum(len(r["input_ids"]) for r in todo), desc="store", unit="tok", unit_scale=True)

    def flush():
        if pending:
            store.append(
                [p[0] for p in pending],
                torch.cat([p[1] for p in pending]),
                torch.cat([p[2] for p in pending]),
                torch.cat([p[3] for p in pending]),
                torch.cat([p[4] for p in pending]) if store.meta.final_hidden else None,
            )
            pending.clear()

    start = 0
    while start < len(todo):
        width = len(todo[start]["input_ids"])
        rows = 1
        while (
            start + rows < len(todo)
            and max(width, len(todo[start + rows]["input_ids"])) * (rows + 1) <= tokens_per_batch
        ):
            width = max(width, len(todo[start + rows]["input_ids"]))
            rows += 1
        batch = todo[start : start + rows]
        width = max(len(r["input_ids"]) for r in batch)
        input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, record in enumerate(batch):
            input_ids[row, : len(record["input_ids"])] = torch.tensor(record["input_ids"])
            attention_mask[row, : len(record["input_ids"])] = 1
        features, ids, logprobs, final = target_labels(
            target, input_ids.to(device), attention_mask.to(device), layer_ids, k, store.meta.final_hidden
        )
        for row, record in enumerate(batch):
            length = len(record["input_ids"])
            pending.append(
                (
                    record,
                    features[row, :length].cpu(),
                    ids[row, :length].cpu(),
                    logprobs[row, :length].cpu(),
                    None if final is None else final[row, :length].cpu(),
                )
            )
        progress.update(sum(len(r["input_ids"]) for r in batch))
        if sum(len(p[0]["input_ids"]) for p in pending) >= tokens_per_shard:
            flush()
        start += rows
    flush()
    progress.close()
    return store


# ---------------------------------------------------------------------- sources
def _normalise(text: str) -> str:
    return " ".join(text.split()).lower()


def evaluation_texts() -> list[str]:
    """The MT-Bench and HumanEval prompts we evaluate on, normalised (training data must not hold them)."""
    from ..assets import load_humaneval_prompts, load_mtbench_prompts

    texts = []
    for prompt in load_mtbench_prompts() + load_humaneval_prompts():
        content = prompt["messages"][-1]["content"]
        # HumanEval prompts are wrapped in our instruction; the problem text itself is what could leak.
        if "```python" in content:
            content = content.split("```python", 1)[1].rsplit("```", 1)[0]
        texts.append(_normalise(content)[:200])
    return [t for t in texts if len(t) >= 20]


def sharegpt_exchanges(path: str | Path | None = None) -> tuple[list[dict], "object"]:
    """First (human, gpt) exchange of each ShareGPT conversation: ``{"id", "messages"}`` with 2 turns."""
    from ..assets import LoadReport, iter_json_array, sharegpt_path

    report = LoadReport()
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    exchanges = []
    for record in iter_json_array(text, report):
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            report.skip("no human-then-gpt opening exchange")
            continue
        question, answer = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
        if not question or not answer:
            report.skip("empty turn")
            continue
        exchanges.append(
            {
                "id": f"sharegpt/{record.get('id', len(exchanges))}",
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            }
        )
        report.loaded += 1
    return exchanges, report


def drop_evaluation_prompts(exchanges: list[dict], report=None) -> list[dict]:
    """Remove exchanges where a user turn contains an evaluation prompt (MT-Bench / HumanEval)."""
    needles = evaluation_texts()
    kept = []
    for exchange in exchanges:
        questions = [_normalise(m["content"]) for m in exchange["messages"] if m.get("role", "user") == "user"]
        if any(needle in question for needle in needles for question in questions):
            if report is not None:
                report.skip("contains an evaluation prompt")
            continue
        kept.append(exchange)
    return kept


def encode_exchange(tokenizer, messages: list[dict], max_length: int) -> dict | None:
    """Chat-encode a (user, assistant) exchange -> ``{"input_ids", "response_start"}`` or None if the
    prompt alone fills ``max_length``. The response is truncated to fit."""
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True)
    full = tokenizer.apply_chat_template(messages, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    if full[: len(prompt)] != prompt or len(prompt) >= max_length - 8:
        return None
    return {"input_ids": full[:max_length], "response_start": len(prompt)}


def regenerated_records(path: str | Path, max_length: int) -> list[dict]:
    """Records of a ``hf-dflash2 regenerate`` file as store records (prompt + the target's response)."""
    from .regenerate import read_regenerated

    records = []
    for record in read_regenerated(path):
        ids = (record["prompt_ids"] + record["response_ids"])[:max_length]
        if len(ids) - len(record["prompt_ids"]) >= 2:
            records.append(
                {"id": f"regen/{record['id']}", "input_ids": ids, "response_start": len(record["prompt_ids"])}
            )
    return records
