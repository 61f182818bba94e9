"""The distill pipeline, phase by phase (the package docstring lists them): the store, the trunk and cool-down,
the export, the evaluation and the push, each resumable, driven by ``distill`` under one budget and display."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import random
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import torch
from transformers import AutoConfig

from ...assets import load_target, offline_target, resolve_target
from ...cpu.precision import resolve_dtype, resolve_precision
from ...hub import push_head, save_head
from ...modeling_dflash2 import DFlash2DraftModel
from ...prompts import apply_chat_template_option, load_head, parse_chat_template
from ...settings import add_arguments
from ..code_prompts import python_function_prompts
from ..commands import heldout_prompts
from ..export import thin_history
from ..losses import decay_gamma
from ..regenerate import RegenerationConfig, encode_prompts, read_regenerated, regenerate
from ..store import (
    FeatureStore,
    StoreMeta,
    build_store,
    drop_evaluation_prompts,
    encode_exchange,
    regenerated_records,
    sharegpt_exchanges,
)
from ..trainer import Trainer, TrainingConfig, store_sequences
from .evaluation import CARD_DATASETS, card_extra, card_results, heldout_evaluation, write_card
from .plan import (
    Display,
    adopt_plan,
    format_plan,
    format_seconds,
    inner_bars_off,
    other_store_sources,
    plan_for_budget,
    plan_on_built_store,
)
from .recipe import (
    API_ONLY,
    PLAN_FIELDS,
    RECIPE_FLAGS,
    STATE_VERSION,
    DistillError,
    DistillRecipe,
    DistillSettings,
    RunState,
    check_identity,
    check_output,
    check_target_config,
    check_target_model,
    parse_budget,
    run_identity,
    target_layer_ids,
    text_sources,
)

logger = logging.getLogger(__name__)

COMMAND_SUMMARY = "a dFlash 2 head for any causal LM, in one command, within a wall-clock budget"

TRUNK_PLANNED_STEPS = 1_000_000  # the trunk's wsd schedule never reaches its own decay


# ============================================================================ 4. the store
def training_text(tokenizer, recipe: DistillRecipe, sharegpt: str | None,
                  code_source: str | None = None) -> tuple[list[dict], list[dict]]:
    """ShareGPT's first exchanges (evaluation prompts removed), shuffled by the seed and split in two disjoint
    halves: prompts the target answers itself, and exchanges prefilled as they are. With ``code_share``, the
    prompts are that share of code prompts (documented functions of ``code_source``, default the standard
    library, as HumanEval-style completion requests), interleaved with the ShareGPT ones."""
    exchanges, report = sharegpt_exchanges(sharegpt)
    exchanges = drop_evaluation_prompts(exchanges, report)
    logger.info("ShareGPT exchanges: %s", report)
    random.Random(recipe.seed).shuffle(exchanges)
    prompts = [{"id": e["id"], "messages": e["messages"][:1]} for e in exchanges[0::2]]
    if recipe.code_share > 0:
        code, code_report = python_function_prompts([code_source or default_code_source()], seed=recipe.seed)
        code = drop_evaluation_prompts(code, code_report)
        prompts = interleaved(prompts, code, recipe.code_share)
    return prompts, exchanges[1::2]


def default_code_source() -> str:
    """The standard library's folder: always installed, public, and the same on every machine with this
    Python (the installed packages' source would make a run depend on what else is installed)."""
    return sysconfig.get_paths()["stdlib"]


def interleaved(chat: list[dict], code: list[dict], code_share: float) -> list[dict]:
    """``chat`` and ``code`` in one order where every prefix holds about ``code_share`` code (all code when it
    is 1, none when it is 0); once one runs out, the rest of the other."""
    if code_share == 0:
        return list(chat)
    out, i, j = [], 0, 0
    while i < len(chat) or j < len(code):
        if j < len(code) and (i >= len(chat) or j < code_share * (i + j + 1)):
            out.append(code[j])
            j += 1
        else:
            out.append(chat[i])
            i += 1
    return out


def regeneration_batch(recipe: DistillRecipe, device: torch.device) -> int:
    return recipe.regen_batch_size or (128 if device.type == "cuda" else 48)


# How much longer than planned the store may run before it stops adding (a share of its planned seconds).
STORE_OVERRUN = 1.25


def regenerate_until(target, tokenizer, prompts: list[dict], path: Path, tokens: int, recipe: DistillRecipe,
                     device: torch.device, on_batch=None, max_batches: int | None = None,
                     out_of_time=lambda: False) -> list[dict]:
    """The target's greedy responses, one batch of prompts after another (appended to ``path``), until they
    hold ``tokens`` store tokens (prompt + response), the prompts run out or ``out_of_time()``. -> their store
    records. Resumable and deterministic: each batch is the next ``batch`` prompts, whatever ran before."""
    batch = regeneration_batch(recipe, device)
    config = RegenerationConfig(max_prompt_tokens=recipe.regen_max_prompt_tokens,
                                max_new_tokens=recipe.regen_max_new_tokens, batch_size=batch, seed=recipe.seed)
    records = regenerated_records(path, recipe.max_length)
    # Batch k is prompts[k * batch : (k + 1) * batch] (those that fit max_prompt_tokens): a resumed run starts
    # after the last batch the file holds, so its batches are the uninterrupted run's.
    position = {prompt["id"]: index for index, prompt in enumerate(prompts)}
    answered = [position[r["id"]] for r in read_regenerated(path) if r["id"] in position]
    offered = 0 if not answered else -(-(max(answered) + 1) // batch) * batch
    batches = 0
    while (sum(len(r["input_ids"]) for r in records) < tokens and offered < len(prompts)
           and (max_batches is None or batches < max_batches) and not out_of_time()):
        batches += 1
        regenerate(target, tokenizer, prompts[offered : offered + batch], path, config)
        offered += batch
        records = regenerated_records(path, recipe.max_length)
        if on_batch is not None:
            on_batch(sum(len(r["input_ids"]) for r in records))
    kept, total = [], 0
    for record in records:  # in file order: the same records whatever batches a resumed run appended
        if total >= tokens:
            break
        kept.append(record)
        total += len(record["input_ids"])
    return kept


def sharegpt_records(tokenizer, exchanges: list[dict], tokens: int, max_length: int) -> list[dict]:
    """Chat-encoded ShareGPT exchanges, in order, until they hold ``tokens`` tokens."""
    records, total = [], 0
    for exchange in exchanges:
        if total >= tokens:
            break
        encoded = encode_exchange(tokenizer, exchange["messages"], max_length)
        if encoded is None or len(encoded["input_ids"]) - encoded["response_start"] < 2:
            continue
        records.append({"id": exchange["id"], **encoded})
        total += len(encoded["input_ids"])
    return records


def store_tokens_per_batch(vocab_size: int) -> int:
    """Tokens per prefill: the logits of one batch ([tokens, vocab] float32) stay under ~1 GiB."""
    return max(256, min(4096, (1 << 30) // (4 * vocab_size)))


def prefill(target, records: list[dict], store, recipe: DistillRecipe, pad_token_id: int, on_chunk=None,
            out_of_time=lambda: False) -> None:
    """Put ``records`` into ``store`` (those already there are skipped), one shard per ``store_chunk_tokens``,
    until they are all in or ``out_of_time()`` (checked between shards): a kill loses at most the shard being
    built, and a rerun rebuilds it from the same records."""
    done = store.record_ids
    todo = [r for r in records if str(r["id"]) not in done]
    per_batch = store_tokens_per_batch(store.meta.vocab_size)
    chunk, size = [], 0
    for index, record in enumerate(todo):
        if not chunk and out_of_time():
            return
        chunk.append(record)
        size += len(record["input_ids"])
        if size >= recipe.store_chunk_tokens or index == len(todo) - 1:
            build_store(target, chunk, store, tokens_per_batch=per_batch, tokens_per_shard=1 << 40,
                        pad_token_id=pad_token_id)
            chunk, size = [], 0
            if on_chunk is not None:
                on_chunk(store.num_tokens)


def open_store(output: Path, name: str, target, layer_ids: list[int], recipe: DistillRecipe):
    text = target.config.get_text_config()
    meta = StoreMeta(target=name, target_layer_ids=layer_ids, hidden_size=text.hidden_size,
                     vocab_size=text.vocab_size, top_k=min(recipe.top_k, text.vocab_size))
    return FeatureStore(output / "store", meta)


@contextmanager
def store_precision(target, precision: str):
    """The target as the store and regeneration run it: a bf16 copy where bf16 is this machine's fast
    precision (the fp32 original stays for training and evaluation), else the target itself."""
    if precision != "bf16" or next(target.parameters()).dtype == torch.bfloat16:
        yield target
        return
    fast = copy.deepcopy(target).to(torch.bfloat16)
    try:
        yield fast
    finally:
        del fast


# ============================================================================ 5-6. training
def training_config(recipe: DistillRecipe, output_dir: Path, steps: int, warmup: int, precision: str,
                    decay_steps: int | None = None):
    return TrainingConfig(
        output_dir=str(output_dir), steps=steps, batch_size=recipe.batch_size, anchors_per_sequence=recipe.anchors,
        max_length=recipe.max_length, learning_rate=recipe.learning_rate, warmup_steps=warmup, lr_schedule="wsd",
        decay_steps=decay_steps, logit_ramp_steps=0, output_scale=recipe.output_scale, label_source=recipe.label_source,
        vocab_subset="data", draft_vocab_size=recipe.draft_vocab_size, seed=recipe.seed, mixed_precision=precision,
        checkpoint_every=recipe.checkpoint_every, log_every=10**9, eval_prompts=recipe.check_prompts,
        eval_max_new_tokens=recipe.check_max_new_tokens,
    )


def new_head(target, layer_ids: list[int], recipe: DistillRecipe):
    """A fresh head sized from the target's config (hidden size, heads, MLP width, vocabulary, RoPE)."""
    text = target.config.get_text_config()
    return DFlash2DraftModel.for_target(target, num_hidden_layers=recipe.layers, block_size=recipe.block_size,
                                        dflash2=True, seed=recipe.seed, selector_rank=recipe.selector_rank,
                                        selector_top_k=min(recipe.selector_top_k, text.vocab_size),
                                        target_layer_ids=layer_ids, output_scale=recipe.output_scale)


def make_trainer(target, store, layer_ids, recipe: DistillRecipe, config, eval_prompts):
    sequences = store_sequences(store, recipe.max_length)
    return Trainer(target, new_head(target, layer_ids, recipe), sequences, config, eval_prompts=eval_prompts,
                   store=store)


def start_from_target_layers(trainer) -> dict:
    """The head's layers as copies of the target's last ones where each fits a head layer (a Llama- or
    Qwen3-style layer with a SiLU MLP); otherwise (Gemma's extra norms and GELU, Qwen2's biases) fresh layers,
    the reason recorded."""
    try:
        trainer.initialize_layers_from_target("last")
    except ValueError as error:
        logger.info("head layers start fresh: %s", error)
        trainer.initialized_from = {"fresh_layers": str(error)}
    return trainer.initialized_from


def train_in_chunks(trainer, last_step: int, recipe: DistillRecipe, display: Display, state: RunState,
                    checks_at: tuple[int, ...] = (), step_key: str | None = None,
                    fit_budget: Callable[[int, float], int] | None = None) -> int:
    """Train to ``last_step``, a checkpoint every ``checkpoint_every`` steps (a kill loses at most one chunk);
    at the steps in ``checks_at`` the held-out τ of the head alone goes into the history and the display.
    ``fit_budget(step, seconds_per_step)``, asked after every chunk with this call's own rate, may end the
    training sooner (never before ``step``); the end it gives is kept in ``state`` for a resumed call.
    -> the last step."""
    first, training_seconds = trainer.step, 0.0
    key = f"{step_key}_end" if step_key else None
    if key and key in state.data:
        last_step = min(last_step, state.data[key])
    while trainer.step < last_step:
        checks = {min(s, last_step) for s in checks_at}  # a shortened trunk still ends with its held-out τ
        chunk = min(recipe.checkpoint_every, last_step - trainer.step)
        due = sorted(s for s in checks if trainer.step < s <= trainer.step + chunk)
        if due:
            chunk = due[0] - trainer.step
        started = time.perf_counter()
        trainer.train(stop_after=chunk)  # checkpoints at its last step
        training_seconds += time.perf_counter() - started
        seconds_per_step = training_seconds / max(1, trainer.step - first)  # this call's mean: one slow chunk is noise
        tau = None
        if trainer.step in checks and trainer.eval_prompts:
            evaluation = trainer.evaluate()
            trainer.history[-1].update(evaluation)
            tau = evaluation.get("eval_tau")
            loss = sum(h["loss"] for h in trainer.history[-10:]) / len(trainer.history[-10:])
            display.write(f"  step {trainer.step:,}: loss {loss:.3f}, held-out τ {tau:.2f} (head alone)")
        if fit_budget is not None and trainer.step < last_step:
            last_step = min(last_step, fit_budget(trainer.step, seconds_per_step))
            if key:
                state.data[key] = last_step
        state.data["spent_seconds"] = round(display.spent(), 1)
        if step_key is not None:
            state.data[step_key] = trainer.step
        state.save()
        display.update((trainer.step - first) / max(1, last_step - first), tau=tau)
    return trainer.step


def loss_summary(history: list[dict]) -> dict:
    losses = [h["loss"] for h in history]
    window = max(1, min(10, len(losses) // 4))
    return {"steps": len(losses), "first_loss": sum(losses[:window]) / window,
            "last_loss": sum(losses[-window:]) / window}


# ============================================================================ 7. export
def export_head(trainer, folder: Path, base_model: str) -> Path:
    """A Hub-ready head (bf16 safetensors, config with auto_map, remote code, draft vocabulary)."""
    with trainer.exported_weights() as drafter:
        drafter.set_draft_vocab(trainer.vocab_subset)
        drafter.config.base_model = base_model
        return save_head(drafter, folder, dtype=torch.bfloat16)


def training_recipe(state: RunState, trainer, recipe: DistillRecipe, store, base_model: str) -> dict:
    """The head's ``training_recipe.json``: what made it; the target named as the card's ``base_model`` (the Hub
    id where known: ``--base-model``, or an offline target's)."""
    config = trainer.config
    plan = state.data["plan"]
    return {
        "made_with": state.data.get("command", "hf-dflash2 distill"),
        "target": base_model,
        "steps": trainer.step,
        "trunk_steps": state.data["done"]["trunk"]["step"],
        "cool_steps": trainer.step - state.data["done"]["trunk"]["step"],
        "schedule": "warmup-stable-decay: a constant-rate trunk, then a copy cooled down as 1 - sqrt over the "
                    "last steps",
        "sequences_per_step": config.batch_size,
        "anchors_per_sequence": config.anchors_per_sequence,
        "learning_rate": config.learning_rate,
        "warmup_steps": config.warmup_steps,
        "output_scale": config.output_scale,
        "label_source": config.label_source,
        "loss_gamma": decay_gamma(recipe.block_size, config.loss_gamma),
        "draft_vocab_size": config.draft_vocab_size,
        "mixed_precision": config.mixed_precision,
        "seed": config.seed,
        "initialized_from": trainer.initialized_from,
        "data": f"feature store of {store.num_tokens:,} target tokens ({len(store):,} sequences): the target's own "
                "greedy responses to ShareGPT first turns"
                + (f" and, for {recipe.code_share:.0%} of the prompts, to completions of the Python standard "
                   "library's documented functions" if recipe.code_share else "")
                + " and a prefill over other ShareGPT exchanges (MT-Bench and HumanEval prompts removed)",
        "chat_template_used": state.data.get("chat_template_used"),
        "datasets": CARD_DATASETS,
        "budget": format_seconds(plan["budget_seconds"]),
        "rates": state.data.get("rates"),
        "plan": {k: plan[k] for k in ("store_tokens", "trunk_steps", "cool_steps", "eval_prompts")},
        "loss": loss_summary(trainer.history),
        "train_minutes": round(trainer.history[-1].get("train_seconds", 0) / 60, 1) if trainer.history else None,
    }


def decode_precision(target, recipe: DistillRecipe, device: torch.device) -> torch.dtype:
    """The dtype batch-1 decoding is fastest in here (``precision.resolve_dtype``, workload ``decode``)."""
    choice = {"auto": "auto", "bf16": "bf16", "fp32": "fp32"}[recipe.precision]
    return resolve_dtype(choice, device, workload="decode", config=target.config.get_text_config())


# ============================================================================ the pipeline
def choose_machine(recipe: DistillRecipe) -> tuple[torch.device, str]:
    """Device (a GPU when there is one), threads (every core this process may use) and the training precision
    (accelerate's name: ``bf16`` where this machine's bf16 matmul is fast, else ``no``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DistillError(f"distill runs in one process (WORLD_SIZE={os.environ['WORLD_SIZE']}): run it without "
                           "`accelerate launch`; it takes the GPU it finds through accelerate itself")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        threads = recipe.threads
        if threads is None:
            try:
                threads = len(os.sched_getaffinity(0))
            except AttributeError:  # not Linux
                threads = os.cpu_count() or 1
        torch.set_num_threads(threads)
    choice = {"auto": "auto", "bf16": "bf16", "fp32": "no"}[recipe.precision]
    return device, resolve_precision(choice, device, workload="train")


def load_checked_target(settings: DistillSettings, recipe: DistillRecipe):
    """Every refusal, then the target: the config alone first (no weights load for an encoder-decoder or a
    two-layer model), then the loaded model. Nothing is written."""
    parse_chat_template(settings.chat_template)
    name = settings.target or "SmolLM2-135M-Instruct (offline GGUF)"
    try:
        location, gguf = resolve_target(settings.target, settings.gguf_file)
    except ValueError as error:
        raise DistillError(f"target {name}: {error}") from None
    try:
        config = AutoConfig.from_pretrained(location, **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError) as error:
        raise DistillError(f"target {name}: cannot read its config ({type(error).__name__}: {error})") from None
    check_target_config(config, name, recipe)
    try:
        target, tokenizer = load_target(location, gguf, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise DistillError(f"target {name}: cannot load it as a causal LM ({type(error).__name__}: {error})") from None
    layer_ids = target_layer_ids(target.config, recipe)
    check_target_model(target, name, layer_ids)
    template = apply_chat_template_option(tokenizer, settings.chat_template)
    return target, tokenizer, name, layer_ids, template


def probe_rates(target, store_target, tokenizer, store, layer_ids, regen_prompts, exchanges, output: Path,
                recipe: DistillRecipe, device, precision: str, display: Display) -> dict:
    """This machine's rates on this target: one regeneration batch (the run's next one, kept), a prefill into a
    throwaway store, a throwaway head's training steps on it, and a short plain greedy decode. The run's own
    store is untouched: its contents never depend on where a run was stopped."""
    display.start("probe")
    path, probe = output / "regenerated.jsonl", output / ".probe"
    shutil.rmtree(probe, ignore_errors=True)
    seen = {r["id"] for r in read_regenerated(path)}
    known = sum(len(r["input_ids"]) for r in regenerate_until(store_target, tokenizer, regen_prompts, path, 1 << 62,
                                                              recipe, device, max_batches=0))
    started = time.perf_counter()
    regenerate_until(store_target, tokenizer, regen_prompts, path, known + 1, recipe, device)  # one batch
    regen_seconds = time.perf_counter() - started
    fresh = [r for r in read_regenerated(path) if r["id"] not in seen]
    regen_tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in fresh)
    records = [r for r in regenerate_until(store_target, tokenizer, regen_prompts, path, 1 << 62, recipe, device,
                                           max_batches=0) if r["id"].removeprefix("regen/") not in seen]
    records += sharegpt_records(tokenizer, exchanges, recipe.min_store_tokens // 2, recipe.max_length)
    scratch = FeatureStore(probe / "store", store.meta)
    started = time.perf_counter()
    prefill(store_target, records, scratch, recipe, tokenizer.pad_token_id or 0)
    prefill_seconds = time.perf_counter() - started
    prefill_tokens = scratch.num_tokens
    # Training: a throwaway head on the scratch store, one step to warm up, then three timed.
    config = training_config(recipe, probe / "run", steps=10, warmup=1, precision=precision)
    trainer = make_trainer(target, scratch, layer_ids, recipe, config, eval_prompts=[])
    trainer.train_step()
    started = time.perf_counter()
    for _ in range(3):
        trainer.train_step()
    seconds_per_step = (time.perf_counter() - started) / 3
    del trainer
    shutil.rmtree(probe, ignore_errors=True)
    ids = torch.tensor([records[0]["input_ids"][: records[0]["response_start"]] if records else [0, 1, 2]],
                       device=device)
    greedy = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None,
              "pad_token_id": tokenizer.pad_token_id}
    target.generate(ids, max_new_tokens=2, **greedy)
    started = time.perf_counter()
    out = target.generate(ids, max_new_tokens=16, **greedy)
    per_token = (time.perf_counter() - started) / max(1, out.shape[1] - ids.shape[1])
    rates = {
        "regen_tokens_per_s": round(max(1, regen_tokens) / max(regen_seconds, 1e-6), 1),
        "prefill_tokens_per_s": round(max(1, prefill_tokens) / max(prefill_seconds, 1e-6), 1),
        "seconds_per_step": round(seconds_per_step, 4),
        "greedy_seconds_per_token": round(per_token, 5),
        "export_seconds": 5.0,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "precision": "bf16" if precision == "bf16" else "fp32",
    }
    logger.info("rates: %s", rates)
    return rates


def distill(settings: DistillSettings, command: str = "hf-dflash2 distill") -> dict:
    """Run (or continue) the pipeline for ``settings``; returns the run's state (``distill.json``)."""
    call_started = time.perf_counter()  # loading the target counts against the budget too
    recipe, output = settings.recipe, Path(settings.output)
    settings.validate()
    budget = parse_budget(settings.budget)
    check_output(output)
    state = RunState(output)
    identity = run_identity(settings)
    check_identity(state, identity, output)

    # 1. check: every refusal happens in here, before anything is written
    target, tokenizer, name, layer_ids, template = load_checked_target(settings, recipe)
    device, precision = choose_machine(recipe)
    target = target.to(device)

    # From here on the run writes into --output.
    state.data.update(version=STATE_VERSION, identity=identity, command=command, chat_template_used=template,
                      target_layer_ids=layer_ids)
    state.data.setdefault("spent_seconds", 0.0)
    state.save()
    display = Display(budget, state.data["spent_seconds"], enabled=settings.progress, started=call_started)
    try:
        with inner_bars_off():
            result = _pipeline(settings, state, display, target, tokenizer, name, layer_ids, device, precision,
                               budget)
    finally:
        state.data["spent_seconds"] = round(display.spent(), 1)
        state.save()
        display.close()
    return result


def _pipeline(settings, state, display, target, tokenizer, name, layer_ids, device, precision, budget) -> dict:
    recipe, output = settings.recipe, Path(settings.output)
    store = open_store(output, name, target, layer_ids, recipe)
    pad = tokenizer.pad_token_id or 0
    @functools.cache
    def texts() -> tuple[list[dict], list[dict]]:  # read only by a phase that runs the target on data
        return training_text(tokenizer, recipe, settings.sharegpt, settings.code_source)

    with contextlib.ExitStack() as stack:
        @functools.cache
        def store_target():  # the store's copy of the target, made once, and only for a phase that needs it
            return stack.enter_context(store_precision(target, precision))

        # 2. probe: this machine's rates (one regeneration batch is kept: the run's first)
        if "rates" not in state.data:
            state.data["rates"] = probe_rates(target, store_target(), tokenizer, store, layer_ids, *texts(), output,
                                              recipe, device, precision, display)
            state.data["spent_seconds"] = round(display.spent(), 1)
            state.save()
        rates = state.data["rates"]

        # 3. plan: from the rates, for what is left of the budget (kept as long as the budget and plan settings are)
        plan_settings = {"budget": budget, **{k: getattr(recipe, k) for k in PLAN_FIELDS}}
        sources = text_sources(settings, recipe)
        if state.data.get("plan") is None or state.data.get("plan_settings") != plan_settings:
            old = state.data.get("plan") or {}
            plan = plan_for_budget(state, budget, display.spent(), rates, recipe, store, sources)
            if (recorded := other_store_sources(state, sources)) is not None:
                display.write(f"the store keeps its size: it was built from other text ({recorded}; this "
                              f"call reads {sources})")
            adopt_plan(state, plan, old)
            state.data["plan_settings"] = plan_settings
            state.save()
        plan = state.data["plan"]
        display.write(format_plan(plan, rates, name))

        # 4. store: (a) the target's own responses, (b) a prefill over ShareGPT text
        if not state.done("store"):
            display.start("store", plan["store_seconds"])
            total, regen_path = plan["store_tokens"], output / "regenerated.jsonl"
            regen_prompts, exchanges = texts()
            # progress over what this call adds: a grown store starts with what it had
            stored_before = store.num_tokens
            regenerated_before = sum(len(r["input_ids"]) for r in regenerated_records(regen_path, recipe.max_length))
            to_add = max(1, total - stored_before)

            def progress(share: float) -> None:  # a kill loses no more than one batch of the budget's account
                display.update(share)
                state.data["spent_seconds"] = round(display.spent(), 1)
                state.save()

            # A store running slow (a busy machine) must not eat the training's time: past its planned time and
            # a quarter more, it stops adding; what was regenerated is still stored, since it is paid for. A
            # recipe's explicit store size is built whatever the clock says (reproductions, tests).
            deadline = plan.get("spent_seconds_at_plan", display.spent()) + STORE_OVERRUN * plan["store_seconds"]

            def out_of_time() -> bool:
                return recipe.store_tokens is None and display.spent() > deadline

            records = regenerate_until(store_target(), tokenizer, regen_prompts, regen_path, plan["regen_tokens"],
                                       recipe, device, out_of_time=out_of_time,
                                       on_batch=lambda n: progress(0.8 * (n - regenerated_before) / to_add))
            prefill(store_target(), records, store, recipe, pad,
                    on_chunk=lambda n: progress((n - stored_before) / to_add))
            regen_stored = sum(len(r["input_ids"]) for r in records)
            text = sharegpt_records(tokenizer, exchanges, total - regen_stored, recipe.max_length)
            prefill(store_target(), text, store, recipe, pad, on_chunk=lambda n: progress((n - stored_before) / to_add),
                    out_of_time=out_of_time)
            stopped = out_of_time() and store.num_tokens < total
            display.write(f"store: {store.num_tokens:,} tokens in {len(store):,} sequences"
                          + (f" (stopped at its time, {total:,} planned)" if stopped else ""))
            # The store took what it took: the training phases are planned again for what is left of the budget.
            trained = plan_on_built_store(state, budget, display.spent(), rates, recipe, store)
            adopt_plan(state, trained, plan)
            plan = trained
            state.data["spent_seconds"] = round(display.spent(), 1)
            state.mark("store", {"tokens": store.num_tokens, "sequences": len(store),
                                 "regenerated_tokens": regen_stored, "sources": sources,
                                 "stopped_at_its_time": stopped,
                                 # then a larger budget cannot grow it
                                 "data_ran_out": store.num_tokens < total and not stopped})
            display.write(format_plan(plan, rates, name))
    store_target.cache_clear()  # the store's bf16 copy of the target and the texts: not needed for training
    texts.cache_clear()
    if settings.stop_after == "store":
        return state.data

    eval_ids = [ids for _, ids in _encoded(tokenizer, heldout_prompts(recipe.check_prompts))]

    # 5. trunk: the head's layers from the target's last ones, a constant rate
    trunk_config = training_config(recipe, output / "trunk", TRUNK_PLANNED_STEPS, plan["warmup_steps"], precision)
    trainer = None
    if not state.done("trunk"):
        display.start("trunk", plan["trunk_seconds"])
        trainer = make_trainer(target, store, layer_ids, recipe, trunk_config, eval_ids)
        if not trainer.load_checkpoint():
            state.data["initialized_from"] = start_from_target_layers(trainer)
            if "fresh_layers" in state.data["initialized_from"]:
                display.write(f"head layers start fresh: {state.data['initialized_from']['fresh_layers']}")
        checks = tuple(sorted({max(1, plan["trunk_steps"] * (i + 1) // recipe.checks) for i in range(recipe.checks)}))
        fit = None
        if recipe.trunk_steps is None:  # planned from rates: the trunk ends early where its steps run slow
            check_seconds = recipe.check_prompts * recipe.check_max_new_tokens * rates["greedy_seconds_per_token"]
            evaluation = plan["eval_seconds"] - recipe.checks * check_seconds  # the final one, without the checks

            def fit(step: int, seconds_per_step: float) -> int:
                cool = plan["cool_steps"] * seconds_per_step  # at the rate the trunk's steps really run
                checks_left = sum(1 for c in checks if c > step) * check_seconds
                left = (budget - display.spent() - cool - evaluation - checks_left
                        - rates.get("export_seconds", 5.0))
                floor = max(step, plan["warmup_steps"], recipe.min_trunk_steps)
                return max(floor, min(plan["trunk_steps"], step + int(left / seconds_per_step)))
        trunk_started = display.spent()
        trunk_end = train_in_chunks(trainer, plan["trunk_steps"], recipe, display, state, checks_at=checks,
                                    step_key="trunk_step", fit_budget=fit)
        if trunk_end != plan["trunk_steps"]:
            display.write(f"trunk ended at step {trunk_end:,} of {plan['trunk_steps']:,}: its steps ran slower "
                          "than the probe's, and the budget keeps the cool-down and the evaluation")
            plan = {**plan, "trunk_steps": trunk_end, "trunk_seconds": round(display.spent() - trunk_started, 1)}
            state.data["plan"] = plan
        state.data["trunk_step"] = trainer.step
        state.data["trunk_loss"] = loss_summary(trainer.history)
        state.mark("trunk", {"step": trainer.step})
    if settings.stop_after == "trunk":
        return state.data

    # 6. cool-down: a copy of the trunk's checkpoint, its rate decayed to 0 over the last steps
    trunk_step = state.data["done"]["trunk"]["step"]
    cool_dir = output / f"cool_{trunk_step}"
    cool_config = training_config(recipe, cool_dir, trunk_step + plan["cool_steps"], plan["warmup_steps"], precision,
                                  decay_steps=plan["cool_steps"])
    if not state.done("cool"):
        display.start("cool-down", plan["cool_seconds"])
        if not (cool_dir / "checkpoint.pt").exists() or _checkpoint_planned_steps(cool_dir) != cool_config.steps:
            shutil.rmtree(cool_dir, ignore_errors=True)
            cool_dir.mkdir(parents=True)
            shutil.copyfile(output / "trunk" / "checkpoint.pt", cool_dir / ".checkpoint.copy")
            os.replace(cool_dir / ".checkpoint.copy", cool_dir / "checkpoint.pt")
        trainer = make_trainer(target, store, layer_ids, recipe, cool_config, eval_ids)
        trainer.load_checkpoint()
        train_in_chunks(trainer, cool_config.steps, recipe, display, state)
        state.data["loss"] = loss_summary(trainer.history)
        state.mark("cool", {"dir": cool_dir.name, "step": trainer.step})
    if settings.stop_after == "cool":
        return state.data

    # 7. export: the head folder, with its recipe and history
    head_folder = output / "head"
    if not state.done("export"):
        display.start("export")
        if trainer is None or trainer.config.output_dir != str(cool_dir):
            trainer = make_trainer(target, store, layer_ids, recipe, cool_config, eval_ids)
            trainer.load_checkpoint()

        base_model = settings.base_model or _offline_hub_id(settings.target) or state.data["identity"]["target"]
        export_head(trainer, head_folder, base_model)
        recipe_json = training_recipe(state, trainer, recipe, store, base_model)
        (head_folder / "training_recipe.json").write_text(json.dumps(recipe_json, indent=1) + "\n")
        (head_folder / "training_history.json").write_text(json.dumps(thin_history(trainer.history)) + "\n")
        state.mark("export", {"folder": str(head_folder), "step": trainer.step})
    del trainer
    if settings.stop_after == "export":
        return state.data

    # 8. evaluate: held-out τ and speedups, into the card
    if not state.done("evaluate"):
        display.start("evaluate", plan["eval_seconds"])
        dtype = decode_precision(target, recipe, device)
        target.to(dtype)
        head = load_head(head_folder, target)
        sets = heldout_evaluation(target, tokenizer, head, heldout_prompts(plan["eval_prompts"]),
                                  plan["eval_max_new_tokens"], on_prompt=lambda f: display.update(f))
        dtype_name = str(dtype).removeprefix("torch.")
        evaluation = {"sets": sets, "prompts": plan["eval_prompts"], "max_new_tokens": plan["eval_max_new_tokens"],
                      "baseline": f"the fastest plain greedy `generate` ({dtype_name}, {device.type}, "
                                  f"{torch.get_num_threads()} threads)",
                      "dtype": dtype_name}
        head_tau = [row["head"].get("tau") for row in sets.values() if row["head"].get("tau") is not None]
        display.update(1.0, tau=sum(head_tau) / len(head_tau) if head_tau else None)
        details = {"device": f"{device.type} ({torch.get_num_threads()} threads)", "dtype": dtype_name,
                   "max_new_tokens": plan["eval_max_new_tokens"], "command": state.data.get("command")}
        results = card_results(evaluation, details)
        recipe_path = head_folder / "training_recipe.json"
        recipe_json = json.loads(recipe_path.read_text())
        recipe_json["heldout_evaluation"] = evaluation
        recipe_path.write_text(json.dumps(recipe_json, indent=1) + "\n")
        write_card(head_folder, settings.push or f"local/{output.resolve().name}", results, card_extra(evaluation))
        state.data["results"] = {"evaluation": evaluation, "card": results}
        state.mark("evaluate", True)
        for set_name, row in sets.items():
            display.write(f"{set_name}: head alone τ {row['head'].get('tau', 0):.2f} ({row['head']['speedup']:.2f}x), "
                          f"default loop τ {row['default'].get('tau', 0):.2f} ({row['default']['speedup']:.2f}x), "
                          f"prompt lookup {row['prompt_lookup']['speedup']:.2f}x, greedy "
                          f"{row['greedy_tokens_per_s']:.1f} tok/s")
    if settings.stop_after == "evaluate":
        return state.data

    # 9. push
    if settings.push and (not state.done("push") or state.data["done"]["push"].get("repo") != settings.push):
        display.start("push")
        try:
            url = push_head(head_folder, settings.push, private=settings.private, endpoint=settings.endpoint,
                            results=state.data["results"]["card"])
        except (ValueError, RuntimeError) as error:
            raise DistillError(f"--push {settings.push}: {error}") from None
        state.mark("push", {"repo": settings.push, "url": url})
        display.write(f"pushed to {url}")
    return state.data


def _encoded(tokenizer, prompts: list[dict]) -> list[tuple[str, list[int]]]:
    return encode_prompts(tokenizer, prompts, 1024)


def _checkpoint_planned_steps(folder: Path) -> int | None:
    try:
        state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # a torn or foreign file: the copy is made again
        return None
    return state["config"]["steps"]


def _offline_hub_id(target: str | None) -> str | None:
    offline = offline_target(target)
    return offline.hub_id if offline else None


# ============================================================================ command line
def cmd_distill(args) -> int:
    try:
        recipe = DistillRecipe(**{name: getattr(args, name) for name in RECIPE_FLAGS})
        settings = DistillSettings(**{f.name: getattr(args, f.name) for f in fields(DistillSettings)
                                      if f.name not in API_ONLY}, recipe=recipe)
        state = distill(settings, command="hf-dflash2 " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["distill"]
                        else "hf-dflash2 distill")
    except DistillError as error:
        raise SystemExit(f"hf-dflash2 distill: {error}") from None
    done = state.get("done", {})
    if "export" in done:
        print(done["export"]["folder"])
    return 0


def register(sub) -> None:
    p = sub.add_parser("distill", help=COMMAND_SUMMARY,
                       description=COMMAND_SUMMARY)
    add_arguments(p, DistillSettings, skip=API_ONLY)
    add_arguments(p, DistillRecipe, only=RECIPE_FLAGS)
    p.set_defaults(func=cmd_distill)
