"""Online dFlash 2 training, readable in one sitting.

Each step: take ``batch_size`` regenerated sequences (prompt + the target's own response); the frozen
target runs once over each (no grad) and yields its tapped layers; ``anchors_per_sequence`` random
anchors inside the response each open a block ``[anchor, MASK x (B-1)]``; all blocks of a sequence go
through the drafter in one forward with the sparse block mask; the loss is the position-decayed CE plus
the selector's teacher-forced K-way CE. AdamW, warmup then a cosine decay (or a constant rate and a final
cool-down: ``lr_schedule="wsd"``), gradient clipping.

Accelerate supplies devices, processes (DDP / FSDP via ``accelerate launch``) and mixed precision.
Checkpoints are single files written atomically; ``resume=True`` continues with the same data order,
optimizer state and RNG, so an interrupted run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn
from tqdm.auto import tqdm

from ..modeling_dflash2 import DFlash2DraftModel
from ..speculative_dflash2 import last_position, tapped_features
from .blocks import (
    accepted_drafts,
    final_hidden_for_blocks,
    loop_round_starts,
    ngram_copied_positions,
    sample_anchors,
    sequence_blocks,
    target_labels_for_blocks,
)
from .losses import block_loss, decay_gamma, training_logits
from .starting_points import (
    SELECTOR_FACTORS,
    calibrate_query_key_norms,
    calibrated_output_factor,
    check_context_layer,
    copy_target_context,
    copy_target_layers,
    grown_drafter_weights,
    pruned_selector_weights,
    tap_columns,
    target_decoder_layers,
    widened_fc_weight,
)

logger = logging.getLogger(__name__)


@dataclass
class TrainingConfig:
    output_dir: str = "runs/dflash2"
    steps: int = 1000
    # The defaults are the committed head's recipe (recipes/smollm2-135m-dflash2.yaml), as `distill` uses it.
    batch_size: int = 2  # sequences per step and process
    anchors_per_sequence: int = 64
    loss_positions: int | None = None  # drafted positions that get a loss (None = all B-1)
    max_length: int = 832
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    warmup_steps: int | None = None  # overrides warmup_ratio
    # "cosine": the rate decays over the whole run, so --steps must be known at step 0. "wsd" (warmup, stable,
    # decay): constant until the last ``decay_steps``, then 1 - sqrt down to 0. A run too long for one call trains
    # its trunk at a constant rate with a large --steps; a copy of its checkpoint resumed with
    # ``--steps <now + decay_steps>`` cools down into a finished head while the trunk goes on (Hägele et al. 2024:
    # a cool-down of ~20 % matches cosine at the same budget).
    lr_schedule: str = "cosine"
    decay_steps: int | None = None  # wsd's cool-down; None: 20 % of the steps after warmup
    # Two ways to start a fresh head, in pairs. ``for_target``'s default head is undamped (output_scale 1.0,
    # recorded here), so the Python API ramps its logits up over the first steps, capped at the warmup; without
    # that a first loss can be many times a uniform guess's. `train` and `distill` build the head damped
    # (output_scale 0.1) and ramp nothing: a ramp sharpens what a head has learnt under a rising rate
    # (docs/training.md, lesson 2).
    logit_ramp_steps: int = 20  # a fresh head's logit scale reaches 1 after this many steps (at most the warmup)
    output_scale: float = 1.0  # the fresh head's output norm, as a fraction of the target's (recorded)
    grad_clip: float = 1.0
    selector_weight: float = 1.0
    vocab_subset: str = "data"  # "data": softmax over tokens present in the data; "full": whole vocab
    draft_vocab_size: int | None = None  # keep only the N most frequent label tokens (store only)
    label_source: str = "data"  # "data" tokens, the target's "argmax", or "kl" to its top-k (store only)
    seed: int = 0
    mixed_precision: str = "no"  # accelerate's: "no", "bf16", "fp16" (the CLI resolves "auto")
    checkpoint_every: int = 50
    eval_every: int = 0
    eval_prompts: int = 4
    eval_max_new_tokens: int = 64
    log_every: int = 10
    cache_features: bool = True  # keep each sequence's tapped features after its first target forward
    standardize_features: bool = True  # train ``fc`` on per-channel standardized features (see feature_scale)
    # 0: off. Otherwise an exponential moving average of the weights (from the weights at step 0) is kept
    # and checkpointed beside them; ``export --ema`` saves it as the head.
    ema_decay: float = 0.0
    # Recompute each head layer in the backward pass instead of keeping its activations: memory for time, for
    # large targets on a GPU (a head for an 8B target reads blocks of width 4096 from every anchor).
    gradient_checkpointing: bool = False
    # 0: off. Otherwise the weight of a loss pulling the head's LM-head input at each drafted position
    # towards the target's own (a store built with ``final_hidden``): relative squared error, position-decayed.
    hidden_weight: float = 0.0
    # gamma of the position-decayed loss, w_k = exp(-(k - 1) / gamma). None: the DFlash paper's for the block
    # size (4 at B = 8, 7 at B = 16). A weak head accepts about half of each position, so position k adds
    # about 2^-(k-1) to tau: a smaller gamma spends the head's capacity where acceptance is decided.
    loss_gamma: float | None = None
    # 1: off. Otherwise the weight of the block positions that the fast loop's own n-gram chain (prompt lookup,
    # ``ngram_draft``) drafts and has accepted from the same anchor: the default loop verifies that chain beside
    # the head's tree, so a head that learns those tokens adds little there (a large share of a store's
    # positions are such copies; docs/training.md). Below 1 the head's capacity goes to the
    # text no copy drafts.
    copy_weight: float = 1.0
    # 0: off. Otherwise the share of each sequence's anchors placed where the loop's rounds start under the
    # head being trained (on-policy anchors): drafts for a window of twice ``anchors_per_sequence`` positions
    # are made without gradient, the target's argmax judges them as the loop would, and the anchors are the
    # positions the loop's rounds start at (``loop_round_starts``): after the window's first, each follows a
    # rejected draft or a fully accepted block. Uniform anchors fill the rest. Costs a forward pass without
    # gradient per sequence.
    loop_anchor_share: float = 0.0
    extra: dict = field(default_factory=dict)

    def warmup_length(self) -> int:
        return self.warmup_steps or max(1, int(self.warmup_ratio * self.steps))

    def validate(self) -> None:
        """Named errors before any model is loaded."""
        if self.label_source not in ("data", "argmax", "kl"):
            raise ValueError(f"label_source must be 'data', 'argmax' or 'kl', got {self.label_source!r}")
        if self.lr_schedule not in ("cosine", "wsd"):
            raise ValueError(f"lr_schedule must be 'cosine' or 'wsd', got {self.lr_schedule!r}")
        if self.decay_steps is not None:
            if self.lr_schedule != "wsd":
                raise ValueError(f"decay_steps={self.decay_steps} is the wsd schedule's cool-down: set "
                                 f"lr_schedule='wsd' (got {self.lr_schedule!r})")
            if not 1 <= self.decay_steps <= self.steps - self.warmup_length():
                raise ValueError(f"decay_steps must be in [1, steps - warmup = {self.steps - self.warmup_length()}]"
                                 f" (steps={self.steps}), got {self.decay_steps}")
        if self.vocab_subset not in ("data", "full"):
            raise ValueError(f"vocab_subset must be 'data' or 'full', got {self.vocab_subset!r}")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'fp16' here, got {self.mixed_precision!r}")
        for name in ("steps", "batch_size", "anchors_per_sequence", "max_length", "checkpoint_every", "log_every",
                     "eval_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "eval_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no evaluation during training), got {getattr(self, name)}")
        for name in ("loss_positions", "draft_vocab_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None: all), got {getattr(self, name)}")
        if not 0 < self.output_scale <= 1:
            raise ValueError(f"output_scale must be in (0, 1], got {self.output_scale}")
        if self.logit_ramp_steps < 0:
            raise ValueError(f"logit_ramp_steps must be >= 0 (0: no ramp), got {self.logit_ramp_steps}")
        if self.warmup_steps is not None and self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (or None for warmup_ratio), got {self.warmup_steps}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1) (0: no moving average), got {self.ema_decay}")
        for name in ("selector_weight", "weight_decay"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not (self.grad_clip > 0 and math.isfinite(self.grad_clip)):
            raise ValueError(f"grad_clip must be a finite number > 0, got {self.grad_clip}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not (self.hidden_weight >= 0 and math.isfinite(self.hidden_weight)):
            raise ValueError(f"hidden_weight must be a finite number >= 0 (0: off), got {self.hidden_weight}")
        if self.loss_gamma is not None and not (self.loss_gamma > 0 and math.isfinite(self.loss_gamma)):
            raise ValueError(f"loss_gamma must be a finite number > 0 (or None: by block size), got {self.loss_gamma}")
        if not 0 <= self.copy_weight <= 1:  # also refuses NaN
            raise ValueError(f"copy_weight must be in [0, 1] (1: off), got {self.copy_weight}")
        if not 0 <= self.loop_anchor_share <= 1:
            raise ValueError(f"loop_anchor_share must be in [0, 1] (0: off), got {self.loop_anchor_share}")


def learning_rate_factor(config: TrainingConfig):
    """``step -> factor`` of the peak rate: linear warmup, then cosine to 0 over the rest of ``config.steps``,
    or (``wsd``) 1 until the last ``decay_steps`` and ``1 - sqrt(progress)`` through them."""
    steps, warmup = config.steps, config.warmup_length()
    decay = config.decay_steps or max(1, (steps - warmup) // 5)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.lr_schedule == "wsd":
            progress = (step - (steps - decay)) / decay
            return 1.0 if progress <= 0 else max(0.0, 1 - math.sqrt(min(1.0, progress)))
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def load_sequences(path: str | Path, max_length: int) -> list[dict]:
    """Regenerated records -> ``{"input_ids": [...], "response_start": int}`` with a non-empty response."""
    from .regenerate import read_regenerated

    sequences = []
    for record in read_regenerated(path):
        ids = (record["prompt_ids"] + record["response_ids"])[:max_length]
        start = len(record["prompt_ids"])
        if len(ids) - start >= 2:
            sequences.append({"input_ids": ids, "response_start": start})
    if not sequences:
        raise ValueError(f"{path}: no sequence with a response of at least 2 tokens within max_length={max_length}")
    return sequences


def parse_record_weights(spec: str) -> dict[str, int]:
    """``"regen/python/=3,regen/"`` -> ``{"regen/python/": 3, "regen/": 1}`` (the ``--records`` syntax)."""
    weights: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        prefix, _, count = part.partition("=")
        if not prefix or (count and (not count.isdigit() or int(count) < 1)):
            raise ValueError(f"--records {spec!r}: {part!r} is not PREFIX or PREFIX=N with a whole N >= 1")
        weights[prefix] = int(count or 1)
    if not weights:
        raise ValueError(f"--records {spec!r}: give at least one record id prefix, e.g. regen/")
    return weights


def store_sequences(store, max_length: int, record_weights: dict[str, int] | None = None) -> list[dict]:
    """The store's sequences as ``{"store_index", "num_tokens", "response_start"}`` (arrays stay on disk).

    ``record_weights`` (``parse_record_weights``) keeps only the records whose id starts with one of its
    prefixes (``{"regen/": 1}``: the target's own responses, the text speculative decoding meets), each
    listed as many times as the weight of its longest matching prefix (``{"regen/": 1, "regen/python/": 3}``:
    code three times per epoch, each time with fresh anchors), so a mix can be set without a new store."""
    record_ids = store.sequence_ids()
    if record_weights:
        unmatched = [p for p in record_weights if not any(r.startswith(p) for r in record_ids)]
        if unmatched:
            kinds = sorted({r.split("/", 1)[0] + "/" for r in record_ids})
            raise ValueError(
                f"store {store.root}: no record id starts with {unmatched} (its records start with {kinds})"
            )
        longest_first = sorted(record_weights, key=len, reverse=True)
    sequences = []
    for index, (length, response_start) in enumerate(store.sequence_lengths()):
        copies = 1
        if record_weights:
            prefix = next((p for p in longest_first if record_ids[index].startswith(p)), None)
            if prefix is None:
                continue
            copies = record_weights[prefix]
        length = min(length, max_length)
        if length - response_start >= 2:
            sequences.extend({"store_index": index, "num_tokens": length, "response_start": response_start}
                             for _ in range(copies))
    if not sequences:
        raise ValueError(
            f"store {store.root}: no sequence with a response of at least 2 tokens within max_length={max_length}"
        )
    return sequences


@torch.no_grad()
def feature_scale(feature_batches, sink_positions: int = 1) -> torch.Tensor:
    """Per-channel RMS [taps * H] of tapped target features, skipping each sequence's first position(s).

    Small LMs carry "massive activations": a few channels of the deep layers average two orders of magnitude
    above the median channel, and the first token (the attention sink) more (docs/training.md, lesson 1). A freshly
    initialised ``fc`` then projects every context position onto nearly the same direction, so the
    drafter cannot tell its context slots apart until Adam has shrunk those columns, hundreds of steps.
    The trainer therefore feeds ``fc`` features divided by this scale and folds the scale back into
    ``fc.weight`` for every head it saves or evaluates: the same function, the published format, and
    Adam's steps balanced across channels. Returns ones for channels that are all zero.
    """
    total, count = None, 0
    for features in feature_batches:  # [T, taps * H] each
        body = features[sink_positions:].float()
        if body.shape[0] == 0:
            continue
        squares = body.pow(2).sum(0)
        total = squares if total is None else total + squares
        count += body.shape[0]
    if total is None:
        raise ValueError("feature_scale needs at least one sequence longer than its sink positions")
    rms = (total / count).sqrt()
    floor = rms[rms > 0].median() * 1e-3 if (rms > 0).any() else rms.new_tensor(1.0)
    return torch.where(rms > 0, rms.clamp_min(floor), torch.ones_like(rms))


class Trainer:
    def __init__(
        self,
        target,
        drafter: DFlash2DraftModel,
        sequences: list[dict],
        config: TrainingConfig,
        accelerator=None,
        eval_prompts=None,
        store=None,
    ):
        """``sequences``: regenerated records (``input_ids``, ``response_start``; the target runs online) or,
        with a ``store`` (``training.store.FeatureStore``), ``store_sequences(store)`` entries."""
        from accelerate import Accelerator

        config.validate()
        if store is None and config.label_source != "data":
            raise ValueError(f"label_source={config.label_source!r} needs a feature store (the target's top-k labels)")
        if config.hidden_weight and not (store is not None and store.meta.final_hidden):
            raise ValueError(
                f"hidden_weight={config.hidden_weight} needs a feature store built with final hidden states"
            )
        self.config = config
        self.store = store
        self._store_columns = None if store is None else tap_columns(
            store.meta.target_layer_ids, drafter.config.target_layer_ids, store.meta.hidden_size)
        self.accelerator = accelerator or Accelerator(
            mixed_precision=config.mixed_precision, cpu=not torch.cuda.is_available()
        )
        self.target = target.to(self.accelerator.device).eval().requires_grad_(False)
        drafter = drafter.to(self.accelerator.device)
        drafter.bind_target(self.target)
        self.sequences = sequences
        self.eval_prompts = eval_prompts or []
        self.gamma = decay_gamma(drafter.config.block_size, config.loss_gamma)
        self.vocab_subset = None
        if config.vocab_subset == "data" and store is not None:
            self.vocab_subset = store.response_vocabulary(config.draft_vocab_size).to(self.accelerator.device)
        elif config.vocab_subset == "data":
            tokens = sorted({t for s in sequences for t in s["input_ids"][s["response_start"] :]})
            self.vocab_subset = torch.tensor(tokens, device=self.accelerator.device)
        # The fused kernel matters on CPU: the selector's [V, r] codebooks make the update itself a large
        # share of a step, and the unfused update is several passes over them.
        optimizer = torch.optim.AdamW(
            [p for p in drafter.parameters() if p.requires_grad],
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            betas=(0.9, 0.95),
            fused=True,
        )
        warmup = config.warmup_length()
        self.warmup_steps = warmup
        self.output_factor = calibrated_output_factor(drafter, self.target)

        schedule = learning_rate_factor(config)

        if config.gradient_checkpointing:
            enable = getattr(drafter, "activation_checkpointing_enable", None)
            if enable is not None:
                enable({"use_reentrant": False})
            else:  # Transformers before the rename
                drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.drafter, self.optimizer = self.accelerator.prepare(drafter, optimizer)
        # Not passed to prepare(): accelerate would step it once per process, and our schedule counts
        # optimizer steps of the global batch.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.step = 0
        self.history: list[dict] = []
        self.output_dir = Path(config.output_dir)
        self._features: dict[int, torch.Tensor] = {}
        self.initialized_from = None  # {"checkpoint", "step"} of a fine-tune's source (initialize_from)
        self.feature_scale = None  # [taps * H] while fc trains on standardized features (see feature_scale)
        self.ema: list[torch.Tensor] | None = None  # the trainable weights' moving average (ema_decay > 0)
        if config.standardize_features:
            sample = range(min(len(sequences), 64))
            scale = feature_scale(self.sequence_item(i)["features"][0] for i in sample)
            self.feature_scale = scale.to(self.accelerator.device)

    # ----------------------------------------------------------------- data order
    def sequences_for_step(self, step: int) -> list[int]:
        """Global sequence indices of this process at ``step``: a seeded permutation per epoch."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        global_batch = self.config.batch_size * world
        per_epoch = max(1, len(self.sequences) // global_batch)
        epoch, offset = divmod(step, per_epoch)
        order = torch.randperm(len(self.sequences), generator=torch.Generator().manual_seed(self.config.seed + epoch))
        start = offset * global_batch + rank * self.config.batch_size
        return order[start : start + self.config.batch_size].tolist()

    # ----------------------------------------------------------------- one step
    def block_states(self, item: dict, anchors: torch.Tensor, block_ids: torch.Tensor, module=None) -> torch.Tensor:
        """The head's final-normed states at the drafted positions of each anchor's block, [n, B-1, H], for
        anchors [n] of one sequence (``item``) and their blocks ``block_ids`` [n, B]; under autocast, with
        gradient where it is enabled. ``module``: the head to run (default: the prepared one, which a
        distributed run wraps; a pass without gradient runs the bare head and skips the wrapper's hooks)."""
        drafter = self.accelerator.unwrap_model(self.drafter)
        cfg = drafter.config
        device = self.accelerator.device
        features = item["features"].to(device)
        if self.feature_scale is not None:
            features = features.float() / self.feature_scale
        positions = torch.arange(features.shape[1], device=device)[None]
        anchors = anchors.to(device)[None]
        with self.accelerator.autocast():
            mask = drafter.block_attention_mask(
                torch.ones_like(positions, dtype=torch.bool), positions, anchors, cfg.block_size
            )
            sliding = None
            if cfg.sliding_window is not None:
                sliding = drafter.block_attention_mask(
                    torch.ones_like(positions, dtype=torch.bool), positions, anchors, cfg.block_size, cfg.sliding_window
                )
            block_positions = (anchors[..., None] + torch.arange(cfg.block_size, device=device)).flatten(1)
            embeds = drafter.embed(block_ids.to(device))[None]
            return (module or self.drafter)(
                embeds,
                block_positions,
                mask,
                context_features=features,
                context_positions=positions,
                sliding_attention_mask=sliding,
            )[0, :, 1:]

    @torch.no_grad()
    def loop_anchors(self, item: dict, count: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """Up to ``count`` anchors where the loop's rounds start in a random window of ``width`` positions of
        the response (``TrainingConfig.loop_anchor_share``): the head as it is now drafts each position's
        block greedily (its path selector included), the target's argmax judges it (the text itself with
        ``label_source="data"``), and every round verifies the whole block, as the head-alone loop does."""
        drafter = self.accelerator.unwrap_model(self.drafter)
        cfg = drafter.config
        ids, response_start = item["input_ids"], item["response_start"]
        last = len(ids) - 2  # the last position a block can start at
        width = min(width, last - response_start + 1)
        first = response_start + int(torch.randint(last - response_start - width + 2, (1,), generator=generator))
        window = torch.arange(first, first + width)
        block_ids, labels, _ = sequence_blocks(ids, cfg.block_size, window, cfg.mask_token_id)
        if self.config.label_source != "data":  # the target's argmax judges, as the loop's verify does
            labels, _, _ = target_labels_for_blocks(item, window, cfg.block_size, "argmax")
        hidden = self.block_states(item, window, block_ids, module=drafter)
        with self.accelerator.autocast():  # over the training vocabulary, as the loss reads the head
            logits = training_logits(drafter, hidden, self.vocab_subset, self.head_weight(hidden.dtype))
            anchor_ids = ids[window].to(hidden.device)
            tokens = drafter.propose(hidden, logits, anchor_ids, vocab=self.vocab_subset).tokens.cpu()
        return loop_round_starts(accepted_drafts(tokens, labels), first)[:count]

    def sequence_loss(self, index: int, step: int):
        drafter = self.accelerator.unwrap_model(self.drafter)
        cfg = drafter.config
        device = self.accelerator.device
        item = self.sequence_item(index)
        ids = item["input_ids"]
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 7919 + index)
        count = self.config.anchors_per_sequence
        anchors = sample_anchors(len(ids), item["response_start"], count, generator)
        if self.config.loop_anchor_share > 0:
            share = max(1, math.ceil(count * self.config.loop_anchor_share))
            from_loop = self.loop_anchors(item, share, 2 * count, generator)
            uniform = anchors[torch.randperm(len(anchors), generator=generator)]  # a random subset, not the first
            uniform = uniform[~torch.isin(uniform, from_loop)][: max(0, count - len(from_loop))]
            anchors = torch.cat([from_loop, uniform]).sort().values
        block_ids, labels, predecessors = sequence_blocks(ids, cfg.block_size, anchors, cfg.mask_token_id)
        soft = None
        if self.config.label_source != "data":
            labels, predecessors, soft = target_labels_for_blocks(
                item, anchors, cfg.block_size, self.config.label_source
            )
        hidden = self.block_states(item, anchors, block_ids)  # [n, B-1, H]
        anchors = anchors.to(device)[None]
        with self.accelerator.autocast():
            keep = self.config.loss_positions or hidden.shape[1]
            if self.vocab_subset is not None:  # a token the head can never draft is no label
                labels = torch.where(torch.isin(labels, self.vocab_subset.cpu()), labels, -100)
            if soft is not None:
                soft = tuple(t[:, :keep].to(device) for t in soft)
            label_weights = None
            if self.config.copy_weight != 1:
                copied = ngram_copied_positions(ids, anchors[0].cpu(), labels)[:, :keep]
                label_weights = torch.where(copied, self.config.copy_weight, 1.0).to(device)
            hidden_targets = None
            if self.config.hidden_weight:
                hidden_targets = final_hidden_for_blocks(item, anchors[0].cpu(), cfg.block_size)[:, :keep].to(device)
            return block_loss(
                drafter,
                hidden[:, :keep],
                labels[:, :keep].to(device),
                predecessors[:, :keep].to(device),
                self.gamma,
                self.vocab_subset,
                self.config.selector_weight if cfg.use_selector else 0.0,
                soft_targets=soft,
                head_weight=self.head_weight(hidden.dtype),
                logit_scale=self.logit_scale(step),
                hidden_targets=hidden_targets,
                hidden_weight=self.config.hidden_weight,
                label_weights=label_weights,
            )

    def logit_scale(self, step: int) -> float:
        """Geometric ramp from ``output_factor`` to 1 over the first ``logit_ramp_steps`` steps.

        A fresh head's drafted positions all read the mask token's embedding, so with a tied LM head the
        mask token's own logit towers over the rest and the first loss is many times a uniform guess's.
        Scaling the logits down at the start, instead of the output norm's
        weights, keeps the first loss near uniform without leaving Adam to regrow a tiny norm. The ramp
        is short on purpose: every step of it sharpens what the head has learnt, so a ramp as long as the
        warmup kept the loss rising and spiking until it ended (``docs/training.md``)."""
        ramp = min(self.config.logit_ramp_steps, self.warmup_steps)
        if step >= ramp or self.output_factor >= 1.0:  # ramp == 0: no ramp
            return 1.0
        return self.output_factor ** (1.0 - step / ramp)

    def head_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The frozen LM head restricted to the training vocabulary, in the compute dtype (made once)."""
        if getattr(self, "_head_weight", None) is None or self._head_weight.dtype != dtype:
            weight = self.accelerator.unwrap_model(self.drafter).bound_target.lm_head_weight
            if self.vocab_subset is not None:
                weight = weight[self.vocab_subset]
            self._head_weight = weight.detach().to(dtype)
        return self._head_weight

    def sequence_item(self, index: int) -> dict:
        """``input_ids`` [T], ``response_start``, ``features`` [1, T, taps*H] (+ ``topk_*`` from a store)."""
        sequence = self.sequences[index]
        if self.store is None:
            return {
                "input_ids": torch.tensor(sequence["input_ids"]),
                "response_start": sequence["response_start"],
                "features": self.target_features(index),
            }
        item = self.store[sequence["store_index"]]
        length = sequence["num_tokens"]
        item = {name: value[:length] if torch.is_tensor(value) else value for name, value in item.items()}
        if self._store_columns is not None:
            item["features"] = item["features"].index_select(-1, self._store_columns)
        item["features"] = item["features"][None]
        return item

    @torch.no_grad()
    def target_features(self, index: int) -> torch.Tensor:
        """[1, T, taps * H] tapped target states of a sequence (deterministic, so caching changes nothing)."""
        if index in self._features:
            return self._features[index]
        drafter = self.accelerator.unwrap_model(self.drafter)
        input_ids = torch.tensor([self.sequences[index]["input_ids"]], device=self.accelerator.device)
        out = self.target(input_ids=input_ids, output_hidden_states=True,
                          logits_to_keep=last_position(input_ids.shape[1], input_ids.device))
        features = tapped_features(out.hidden_states, drafter.config.target_layer_ids)
        if self.config.cache_features:
            self._features[index] = features
        return features

    def train_step(self) -> dict:
        self.drafter.train()
        if self.config.ema_decay and self.ema is None:  # started here, after any initialize_from
            self.ema = [p.detach().clone() for p in self.trainable_parameters()]
        indices = self.sequences_for_step(self.step)
        total, metrics = 0.0, []
        for index in indices:
            loss, m = self.sequence_loss(index, self.step)
            self.accelerator.backward(loss / len(indices))
            total += float(loss.detach()) / len(indices)
            metrics.append(m)
        grad_norm = self.accelerator.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            current = [p.detach() for p in self.trainable_parameters()]
            get_ema_multi_avg_fn(self.config.ema_decay)(self.ema, current, None)
        self.step += 1
        total = float(self.accelerator.reduce(torch.tensor(total, device=self.accelerator.device), reduction="mean"))
        record = {
            "step": self.step,
            "loss": total,
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "unary_loss": sum(m["unary_loss"] for m in metrics) / len(metrics),
            "top1_position1": sum(m["top1_by_position"][0] for m in metrics) / len(metrics),
        }
        for name in ("selector_loss", "hidden_loss"):
            if name in metrics[0]:
                record[name] = sum(m[name] for m in metrics) / len(metrics)
        return record

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.accelerator.unwrap_model(self.drafter).parameters() if p.requires_grad]

    @contextmanager
    def ema_weights(self):
        """The drafter with its moving average swapped in (training space), restored on exit."""
        if self.ema is None:
            raise ValueError("no moving average: this run trains with ema_decay=0 or has not taken a step")
        parameters = self.trainable_parameters()
        current = [p.detach().clone() for p in parameters]
        with torch.no_grad():
            for parameter, average in zip(parameters, self.ema, strict=True):
                parameter.copy_(average)
        try:
            yield self.accelerator.unwrap_model(self.drafter)
        finally:
            with torch.no_grad():
                for parameter, value in zip(parameters, current, strict=True):
                    parameter.copy_(value)

    # ----------------------------------------------------------------- checkpoints
    @property
    def checkpoint_path(self) -> Path:
        suffix = f".rank{self.accelerator.process_index}" if self.accelerator.num_processes > 1 else ""
        return self.output_dir / f"checkpoint{suffix}.pt"

    def save_checkpoint(self) -> None:
        """One file, written to a temporary name and renamed: a kill never leaves a torn checkpoint."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step,
            "drafter": self.exported_state_dict(),  # what export.py and the curve scripts read
            "feature_scale": self.feature_scale,
            "fc_weight_standardized": self.accelerator.unwrap_model(self.drafter).fc.weight.detach().clone(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "history": self.history,
            "config": asdict(self.config),
            "drafter_config": self.accelerator.unwrap_model(self.drafter).config.to_dict(),
            "initialized_from": self.initialized_from,
            "vocab_subset": None if self.vocab_subset is None else self.vocab_subset.tolist(),
            "ema": self.ema,
        }
        if self.ema is not None:
            with self.ema_weights():
                state["drafter_ema"] = self.exported_state_dict()  # folded, as "drafter": what export --ema reads
        fd, tmp = tempfile.mkstemp(dir=self.output_dir, prefix=".checkpoint.")
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.checkpoint_path)

    def load_checkpoint(self) -> bool:
        if not self.checkpoint_path.exists():
            return False
        state = torch.load(self.checkpoint_path, map_location=self.accelerator.device, weights_only=False)
        # The average must cover the run from its step 0; one run has one objective (the recipe records one value).
        for name, default in (("ema_decay", 0.0), ("loss_gamma", None), ("lr_schedule", "cosine"),
                              ("copy_weight", 1.0), ("loop_anchor_share", 0.0)):
            trained, asked = state["config"].get(name, default), getattr(self.config, name)
            if trained != asked:
                raise ValueError(
                    f"{name}={asked}, but {self.checkpoint_path} was trained with {name}={trained}: "
                    f"resume with the same --{name.replace('_', '-')}"
                )
        saved = state.get("drafter_config")
        if saved is not None:  # the head's shape is fixed at step 0: a resume with other shape options is refused
            current = self.accelerator.unwrap_model(self.drafter).config.to_dict()
            fields = [(key, saved.get(key), current.get(key))
                      for key in ("num_hidden_layers", "vocab_size", "hidden_size")]
            fields += [(key, saved["dflash_config"].get(key), current["dflash_config"].get(key))
                       for key in sorted(set(saved["dflash_config"]) | set(current["dflash_config"]))]
            changed = [f"{name}={asked} (trained with {trained})"
                       for name, trained, asked in fields if trained != asked]
            if changed:
                raise ValueError(f"{self.checkpoint_path} holds another head: {', '.join(changed)}; resume with the "
                                 "run's own shape options, or train into another --output")
        if (state.get("feature_scale") is not None) != self.config.standardize_features:
            logger.warning("standardize_features=%s, but the checkpoint was trained with %s: its choice wins",
                           self.config.standardize_features, state.get("feature_scale") is not None)
        self._restore_drafter(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The checkpoint holds the rate its own schedule set for the next step; this run's schedule decides it
        # (the same number unless --steps, --lr-schedule or --decay-steps changed).
        planned = [base * self.scheduler.lr_lambdas[0](state["step"]) for base in self.scheduler.base_lrs]
        left = [group["lr"] for group in self.optimizer.param_groups]
        if not all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) for a, b in zip(planned, left)):
            logger.warning("resuming at step %d with the rate %.4g where the run had %.4g: this run's schedule "
                           "(steps=%d, %s) differs there", state["step"], planned[0], left[0], self.config.steps,
                           self.config.lr_schedule)
        for group, rate in zip(self.optimizer.param_groups, planned):
            group["lr"] = rate
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.step = state["step"]
        self.history = state["history"]
        self.initialized_from = state.get("initialized_from")
        self.ema = state.get("ema")  # None exactly when ema_decay is 0 (a differing decay was refused above)
        logger.info("resumed from %s at step %d", self.checkpoint_path, self.step)
        return True

    def _restore_drafter(self, state: dict) -> None:
        """The drafter from a checkpoint state: its saved (folded) weights, then, when it trained on
        standardized features, their scale and the exact training-space ``fc`` (not an unfolded round trip)."""
        drafter = self.accelerator.unwrap_model(self.drafter)
        drafter.load_state_dict(state["drafter"])
        self.feature_scale = state.get("feature_scale")
        if self.feature_scale is not None:
            self.feature_scale = self.feature_scale.to(self.accelerator.device)
            drafter.fc.weight.data.copy_(state["fc_weight_standardized"])

    def initialize_from(self, source: str | Path) -> None:
        """Start from trained weights (a fine-tune, e.g. on new data): another run (its folder or checkpoint
        file) or a saved head folder (``save_head`` / ``save_pretrained``, e.g. the committed head). The
        drafter, its draft vocabulary (when this run restricts the vocabulary) and, from a run, its feature
        scale come from ``source``; optimizer, schedule, step and history start fresh, and there is no logit
        ramp (the head is trained already). Everything is checked before anything changes: the drafter's
        shape, its tapped layers and block size, and (from a run) the feature standardization.

        A run with more layers than ``source`` grows it (``grown_drafter_weights``): the new layers start as
        copies of the last one with their output projections zeroed, so the grown head computes exactly what
        ``source`` computed and training starts from it, not from a fresh head. A run with a smaller selector
        rank keeps the source selector's strongest coordinates (``pruned_selector_weights``)."""
        path = Path(source)
        checkpoint_files = [path / name for name in ("checkpoint.pt", "checkpoint.rank0.pt")]
        if path.is_dir() and (path / "config.json").exists() and not any(f.exists() for f in checkpoint_files):
            self._initialize_from_head(path)
            return
        if path.is_dir():
            path = next((f for f in checkpoint_files if f.exists()), checkpoint_files[0])
        if not path.exists():
            raise FileNotFoundError(f"--init-from {source}: no checkpoint or saved head at {path}")
        try:
            state = torch.load(path, map_location=self.accelerator.device, weights_only=False)
            source_config, weights = state["drafter_config"], state["drafter"]
        except Exception as error:  # a file that is not one of our checkpoints
            kind = type(error).__name__
            raise ValueError(f"--init-from {path}: not a training checkpoint ({kind}: {error})") from None
        weights = state["drafter"] = self._grown(path, source_config, weights)
        self._check_source_shape(path, source_config, weights)
        standardized = state.get("feature_scale") is not None
        if standardized != self.config.standardize_features:
            raise ValueError(f"--init-from {path}: trained with standardize_features={standardized}, "
                             f"this run uses {self.config.standardize_features}")
        self._restore_drafter(state)
        if state.get("vocab_subset") is not None and self.vocab_subset is not None:
            self._use_vocab_subset(torch.tensor(state["vocab_subset"]))
        self.output_factor = 1.0  # no ramp: the fresh head's damping would flatten a trained head's logits
        self.initialized_from = {"checkpoint": str(path), "step": state["step"]}
        logger.info("initialized from %s (its step %d)", path, state["step"])

    def _initialize_from_head(self, folder: Path) -> None:
        """A saved head reads raw target features (its feature scale is folded into ``fc``); when this run
        trains on standardized features, ``fc`` is unfolded with this run's scale, so the head computes
        exactly what it computed when saved."""
        try:
            head = DFlash2DraftModel.from_pretrained(folder)
        except Exception as error:  # a folder that is not a loadable head
            raise ValueError(f"--init-from {folder}: not a saved head ({type(error).__name__}: {error})") from None
        weights = {name: tensor.detach().clone() for name, tensor in head.state_dict().items()}
        weights = self._grown(folder, head.config.to_dict(), weights)
        taps = self.accelerator.unwrap_model(self.drafter).config.target_layer_ids
        widened = head.config.target_layer_ids != taps
        if widened:  # before the check: a widened head has this run's shape
            try:
                weights["fc.weight"] = widened_fc_weight(weights["fc.weight"], head.config.target_layer_ids, taps,
                                                         head.config.hidden_size)
            except ValueError as error:
                raise ValueError(f"--init-from {folder}: {error}") from None
            # a warning: with --store and no --target-layer-ids a run takes all the store's taps
            logger.warning("--init-from %s: its taps %s widened to %s (the new taps' fc columns start at zero)",
                           folder, head.config.target_layer_ids, taps)
        self._check_source_shape(folder, head.config.to_dict(), weights, widened_taps=widened)
        if self.feature_scale is not None:  # in fp32: a bf16 head's fc is not rounded a second time
            weights["fc.weight"] = weights["fc.weight"].float() * self.feature_scale.float().cpu()[None]
        drafter = self.accelerator.unwrap_model(self.drafter)
        drafter.load_state_dict(weights)
        if head.draft_vocab is not None and self.vocab_subset is not None:
            self._use_vocab_subset(head.draft_vocab)
        self.output_factor = 1.0
        recipe = folder / "training_recipe.json"
        steps = json.loads(recipe.read_text()).get("steps") if recipe.exists() else None
        self.initialized_from = {"head": str(folder), "step": steps}
        logger.info("initialized from the saved head %s", folder)

    def initialize_layers_from_target(self, layer_ids: list[int] | str, context: bool = False) -> None:
        """A fresh head whose layers start as copies of the target's ``layer_ids`` (or its ``"last"`` ones;
        ``copy_target_layers``) and, with ``context``, whose context projection starts as what the first of
        them reads (``copy_target_context``, in the standardized space ``fc`` trains in) and whose q/k norms keep
        the target's query and key scale where the target has none (``calibrate_query_key_norms``, on the first
        training sequence); everything else (selector, schedule, logit ramp) as in a fresh run. Layers and
        context are checked before either writes."""
        drafter = self.accelerator.unwrap_model(self.drafter)
        target_layers = target_decoder_layers(self.target)
        if layer_ids == "last":
            if len(drafter.layers) > len(target_layers):
                raise ValueError(f"init_layers_from_target='last': the head's {len(drafter.layers)} layers exceed "
                                 f"the target's {len(target_layers)}")
            layer_ids = list(range(len(target_layers) - len(drafter.layers), len(target_layers)))
        layer_ids = list(layer_ids)
        if context:
            check_context_layer(drafter, target_layers, layer_ids[0])
            first = self.sequences[0]
            ids = self.store[first["store_index"]]["input_ids"] if self.store is not None else first["input_ids"]
            text = torch.as_tensor(ids)[:512][None]
        copied = copy_target_layers(drafter, self.target, layer_ids)
        self.initialized_from = {"target_layers": layer_ids}
        logger.info("head layers initialized from target layers %s (%s)", layer_ids, ", ".join(copied))
        if not context:
            return
        slot = copy_target_context(drafter, self.target, layer_ids[0])
        if self.feature_scale is not None:  # fc reads features / scale in training: the pass-through is I * scale
            with torch.no_grad():
                drafter.fc.weight.mul_(self.feature_scale.to(drafter.fc.weight)[None])
        self.initialized_from["target_context"] = layer_ids[0]
        logger.info("context projection initialized as target layer %d's input (tap %d, fc slot %d)",
                    layer_ids[0], layer_ids[0] - 1, slot)
        scales = calibrate_query_key_norms(drafter, self.target, layer_ids, text)
        if scales:
            self.initialized_from["query_key_scales"] = {str(index): list(pair) for index, pair in scales.items()}
            logger.info("head q/k norms set to the target layers' query / key RMS: %s",
                        ", ".join(f"{index}: {q:.3f} / {k:.3f}" for index, (q, k) in scales.items()))

    def _grown(self, path: Path, source_config: dict, weights: dict) -> dict:
        """``weights`` grown to this run's layer count when the run has more layers than the source, and its
        selector pruned to this run's rank when the run's is smaller (a smaller head with a deeper stack)."""
        config = self.accelerator.unwrap_model(self.drafter).config
        theirs, mine = source_config.get("num_hidden_layers"), config.num_hidden_layers
        if isinstance(theirs, int) and theirs < mine:  # more here: grown; fewer: _check_source_shape refuses
            logger.info("--init-from %s: growing its %d layers to %d (new layers copy the last, outputs zeroed)",
                        path, theirs, mine)
            weights = grown_drafter_weights(weights, theirs, mine)
        theirs = weights.get(SELECTOR_FACTORS[0])
        mine = config.selector_rank if config.use_selector else None
        if theirs is not None and mine is not None and mine < theirs.shape[1]:
            logger.info("--init-from %s: pruning its selector from rank %d to its %d strongest coordinates",
                        path, theirs.shape[1], mine)
            weights = pruned_selector_weights(weights, mine)
        return weights

    def _check_source_shape(self, path: Path, source_config: dict, weights: dict, widened_taps: bool = False) -> None:
        drafter = self.accelerator.unwrap_model(self.drafter)
        ours = drafter.config.to_dict()
        for name in ("target_layer_ids", "block_size", "hidden_size", "vocab_size", "num_hidden_layers"):
            theirs = source_config.get(name, (source_config.get("dflash_config") or {}).get(name))
            mine = ours.get(name, (ours.get("dflash_config") or {}).get(name))
            if name == "num_hidden_layers" and isinstance(theirs, int) and theirs < mine:
                continue  # grown by _grown
            if name == "target_layer_ids" and widened_taps:
                continue  # widened by _initialize_from_head
            if theirs != mine:
                hint = " (a head's taps widen from its exported head folder only)" if name == "target_layer_ids" else ""
                raise ValueError(f"--init-from {path}: its {name} is {theirs}, this run's is {mine}{hint}")
        expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
        given = {name: tuple(t.shape) for name, t in weights.items()}
        if given != expected:  # load_state_dict would copy what matches before it raised
            differ = sorted(set(given.items()) ^ set(expected.items()))[:4]
            raise ValueError(f"--init-from {path}: its drafter does not match this run's shape: {differ}")

    def _use_vocab_subset(self, token_ids: torch.Tensor) -> None:
        self.vocab_subset = token_ids.to(self.accelerator.device)
        self._head_weight = None  # restricted to the old subset, if it was made already

    @contextmanager
    def exported_weights(self):
        """The drafter as it is saved: the feature scale folded into ``fc`` (it reads raw target features)."""
        drafter = self.accelerator.unwrap_model(self.drafter)
        if self.feature_scale is None:
            yield drafter
            return
        weight = drafter.fc.weight
        standardized = weight.detach().clone()
        with torch.no_grad():
            weight.div_(self.feature_scale.to(weight.dtype)[None])
        try:
            yield drafter
        finally:
            with torch.no_grad():
                weight.copy_(standardized)

    def exported_state_dict(self) -> dict:
        with self.exported_weights() as drafter:
            return {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()}

    def save_head(self, folder: str | Path) -> Path:
        """A Hub-ready head folder (safetensors, config, remote code), written next to and renamed in."""
        from ..assets import SMOLLM2_HUB_ID
        from ..hub import save_head

        with self.exported_weights() as drafter:
            drafter.set_draft_vocab(self.vocab_subset)
            if "target" in self.config.extra:  # recorded by `hf-dflash2 train`; None is its default target
                drafter.config.base_model = self.config.extra["target"] or SMOLLM2_HUB_ID
            return save_head(drafter, folder)

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        from ..generation import PLAIN_GREEDY, speculative_generate

        stats = None
        with self.exported_weights() as drafter:
            drafter.eval()
            drafter.set_draft_vocab(self.vocab_subset)  # draft over what was trained, as the saved head will
            for prompt_ids in self.eval_prompts[: self.config.eval_prompts]:
                ids = torch.tensor([prompt_ids], device=self.accelerator.device)
                result = speculative_generate(
                    self.target, drafter, ids, max_new_tokens=self.config.eval_max_new_tokens, adaptive=False,
                    ngram_size=0, **PLAIN_GREEDY,
                )  # tau of the head itself: every round verifies the block, no n-gram drafts
                stats = result.stats if stats is None else stats.merge(result.stats)
        if stats is None:
            return {}
        return {"eval_tau": stats.acceptance_length, "eval_per_position": stats.per_position_acceptance[:8]}

    # ----------------------------------------------------------------- the loop
    def train(
        self, resume: bool = False, stop_after: int | None = None, stop_after_minutes: float | None = None,
        stop_at: int | None = None,
    ) -> list[dict]:
        """Run to ``config.steps`` (or ``stop_after`` more steps, or to step ``stop_at``, or until
        ``stop_after_minutes`` have passed; either way with a checkpoint to resume from). Returns the logged
        history."""
        if resume:
            self.load_checkpoint()
        last = self.config.steps if stop_after is None else min(self.config.steps, self.step + stop_after)
        if stop_at is not None:
            last = min(last, max(self.step, stop_at))
        progress = tqdm(
            total=self.config.steps, initial=self.step, desc="train", disable=not self.accelerator.is_main_process
        )
        block_size = self.accelerator.unwrap_model(self.drafter).config.block_size
        per_step = self.config.anchors_per_sequence * self.config.batch_size * self.accelerator.num_processes
        per_step *= self.config.loss_positions or block_size - 1
        # Compute so far, carried across resumes: what the tau-against-compute curve is drawn over.
        seconds_before = self.history[-1].get("train_seconds", 0.0) if self.history else 0.0
        started = time.perf_counter()
        deadline = None if stop_after_minutes is None else started + 60 * stop_after_minutes
        while self.step < last:
            record = self.train_step()
            elapsed = time.perf_counter() - started
            record["block_positions"] = self.step * per_step
            record["train_seconds"] = seconds_before + elapsed
            record["positions_per_s"] = self.step * per_step / max(record["train_seconds"], 1e-9)
            if self.config.eval_every and self.step % self.config.eval_every == 0 and self.accelerator.is_main_process:
                record.update(self.evaluate())
            self.history.append(record)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['top1_position1']:.2f}")
            if self.step % self.config.log_every == 0 or "eval_tau" in record:
                logger.info(json.dumps(record))
            out_of_time = deadline is not None and time.perf_counter() > deadline
            if self.step % self.config.checkpoint_every == 0 or self.step == last or out_of_time:
                self.save_checkpoint()
            if out_of_time:
                logger.info(
                    "stopping after %.1f minutes at step %d (resume with --resume)", stop_after_minutes, self.step
                )
                break
        progress.close()
        return self.history
