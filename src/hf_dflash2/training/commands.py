"""``hf-dflash2 regenerate | store | train``: the training side of the command line.

Defaults come from the dataclasses (``RegenerationConfig``, ``TrainingConfig``), so the command line and
the Python API cannot disagree.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import fields
from pathlib import Path

from ..prompts import CHAT_TEMPLATE_HELP, apply_chat_template_option, chat_template_argument
from .regenerate import RegenerationConfig
from .trainer import TrainingConfig

logger = logging.getLogger("hf_dflash2")

PRECISION_HELP = "auto (default): bf16 where this machine's bf16 matmul is fast, else fp32; or bf16 / fp32 / fp16"


def _defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls)}


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=None, help="target folder or Hub id (default: offline SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --target")
    parser.add_argument("--chat-template", default="auto", type=chat_template_argument, help=CHAT_TEMPLATE_HELP)


def _layer_ids(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise SystemExit(f"--target-layer-ids {text!r}: expected comma-separated integers, e.g. 1,7,14,20,27") from None


def _load_target(args, precision: str):

    from ..assets import load_target
    from ..precision import resolve_dtype

    dtype = resolve_dtype(precision)
    target, tokenizer = load_target(args.target, args.gguf_file, dtype=dtype)
    apply_chat_template_option(tokenizer, args.chat_template)
    return target, tokenizer, dtype


FOLLOWUPS = "sharegpt-followups:"


def _followup_sources(source: str | None) -> list[Path]:
    """The regenerated files a ``sharegpt-followups:FILE,FILE`` source names, each checked to exist."""
    if not source or not source.startswith(FOLLOWUPS):
        return []
    paths = [Path(p) for p in source[len(FOLLOWUPS):].split(",") if p]
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        raise SystemExit(f"--prompts {source}: name regenerated JSONL files of ShareGPT turns"
                         + (f"; not found: {', '.join(missing)}" if missing else ""))
    return paths


def _load_prompts(source: str | None, seed: int, tokenizer=None):
    from ..assets import load_jsonl_prompts, load_sharegpt_followups, load_sharegpt_prompts
    from .store import drop_evaluation_prompts

    if source in (None, "sharegpt"):
        prompts, report = load_sharegpt_prompts()
    elif source.startswith(FOLLOWUPS):
        from .regenerate import read_regenerated

        answers = {record["id"]: tokenizer.decode(record["response_ids"], skip_special_tokens=True).strip()
                   for path in _followup_sources(source) for record in read_regenerated(path)}
        prompts, report = load_sharegpt_followups({k: v for k, v in answers.items() if v})
    elif source == "python-functions" or source.startswith("python-functions:"):
        from .code_prompts import python_function_prompts

        roots = source.partition(":")[2]
        try:
            prompts, report = python_function_prompts(roots.split(",") if roots else None, seed=seed)
        except (FileNotFoundError, ValueError) as error:
            raise SystemExit(f"--prompts {source}: {error}") from None
    else:
        prompts, report = load_jsonl_prompts(source)
    prompts = drop_evaluation_prompts(prompts, report)
    logger.info("prompts from %s: %s", source or "sharegpt", report)
    random.Random(seed).shuffle(prompts)
    return prompts


# ---------------------------------------------------------------------- regenerate
def cmd_regenerate(args) -> int:
    from ..linear_kernels import check_linear_kernel, use_linear_kernel
    from .regenerate import regenerate

    try:
        check_linear_kernel(args.linear_kernel)
    except ValueError as error:
        raise SystemExit(f"--linear-kernel: {error}") from None
    config = RegenerationConfig(
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.do_sample,
        temperature=args.temperature,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
    )
    if config.batch_size < 1 or config.max_new_tokens < 1:
        raise SystemExit(f"--batch-size {config.batch_size} and --max-new-tokens {config.max_new_tokens} must be >= 1")
    if not config.repetition_penalty > 0:
        raise SystemExit(f"--repetition-penalty {config.repetition_penalty} must be > 0 (1.0: none)")
    from .regenerate import other_penalties, read_regenerated

    mixed = other_penalties(read_regenerated(args.output), config.repetition_penalty)
    if mixed:  # before the target loads
        raise SystemExit(f"--output {args.output} holds responses decoded with repetition_penalty {sorted(mixed)}, "
                         f"not {config.repetition_penalty}: give another --output")
    if args.skip < 0:
        raise SystemExit(f"--skip {args.skip} must be >= 0")
    followups = bool(_followup_sources(args.prompts))
    if followups:  # the target's answers are decoded with its tokenizer
        target, tokenizer, _ = _load_target(args, args.mixed_precision)
        prompts = _load_prompts(args.prompts, args.seed, tokenizer)
    else:
        prompts = _load_prompts(args.prompts, args.seed)
    if args.skip >= len(prompts):
        raise SystemExit(f"--skip {args.skip} leaves nothing: --prompts {args.prompts} holds {len(prompts)} prompts")
    # The order is fixed by --seed, so --skip N continues past what an earlier file (now gone) covered.
    prompts = prompts[args.skip :]
    if not followups:
        target, tokenizer, _ = _load_target(args, args.mixed_precision)
    # Probed at the batch's own row count: a regeneration step multiplies one row per running prompt.
    use_linear_kernel(target, args.linear_kernel, rows=(config.batch_size,))
    regenerate(target, tokenizer, prompts, args.output, config, max_records=args.limit)
    return 0


def _register_regenerate(sub) -> None:
    d = _defaults(RegenerationConfig)
    p = sub.add_parser("regenerate", help="write the target's own responses to a prompt set (resumable)")
    _add_target_args(p)
    p.add_argument(
        "--prompts",
        default="sharegpt",
        help="'sharegpt' (offline package); 'python-functions' (documented functions of the standard library and "
        "installed packages, as HumanEval-style completions; 'python-functions:DIR,DIR' for other source); "
        "'sharegpt-followups:FILE,FILE' (the next turn of the ShareGPT conversations whose turns these "
        "regenerated files answer, after the target's own answers: first-turn files give second turns, adding "
        "the second turns' file gives third turns); or a JSONL of chats/prompts",
    )
    p.add_argument("--output", required=True)
    p.add_argument("--limit", type=int, default=None, help="stop after this many records in the file")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N prompts of the (seeded) order")
    p.add_argument("--max-prompt-tokens", type=int, default=d["max_prompt_tokens"])
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"])
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=d["temperature"])
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--repetition-penalty", type=float, default=d["repetition_penalty"],
                   help="decode as generate(repetition_penalty=...) does (1.0: none), for a head that will serve "
                   "penalized decoding; recorded in every record, and a file is never resumed under another value")
    p.add_argument("--mixed-precision", default="auto", help=PRECISION_HELP)
    p.add_argument("--linear-kernel", default="auto",
                   help="CPU linear layers: oneDNN with packed weights, PyTorch's default, or auto (timed once at "
                   "--batch-size rows and cached; oneDNN where it is 1.1x faster)")
    p.set_defaults(func=cmd_regenerate)


# ---------------------------------------------------------------------- store
def _store_target_name(args) -> str:
    return args.target or "SmolLM2-135M-Instruct (offline GGUF)"


def cmd_store(args) -> int:
    from ..precision import PRECISION_CHOICES
    from .store import (
        FeatureStore,
        StoreMeta,
        build_store,
        check_store_fields,
        drop_evaluation_prompts,
        encode_exchange,
        regenerated_records,
        sharegpt_exchanges,
    )

    if args.mixed_precision not in PRECISION_CHOICES:
        raise SystemExit(f"--mixed-precision {args.mixed_precision!r}: choose one of {PRECISION_CHOICES}")
    sources = args.source.split(",")
    for source in sources:
        if source != "sharegpt" and not Path(source).exists():
            raise SystemExit(f"--source {source!r}: neither 'sharegpt' nor an existing regenerated JSONL")
    layer_ids = _layer_ids(args.target_layer_ids)
    for name in ("max_tokens", "max_length", "top_k", "tokens_per_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    output = Path(args.output)
    # (a first run killed between writing meta.tmp and renaming it leaves only that file: not a foreign folder)
    foreign = output.is_dir() and {p.name for p in output.iterdir()} - {"meta.tmp"}
    if output.exists() and (not output.is_dir() or (foreign and not (output / "meta.json").exists())):
        raise SystemExit(f"--output {args.output} exists and is not a feature store (no meta.json): "
                         "choose a new or empty folder")
    known_before_loading = {
        "target": _store_target_name(args), "top_k": args.top_k, "final_hidden": args.final_hidden,
    }
    if layer_ids is not None:
        known_before_loading["target_layer_ids"] = layer_ids
    try:  # the fields the arguments fix, before the (possibly large) target loads
        check_store_fields(args.output, fields=known_before_loading)
    except ValueError as error:
        raise SystemExit(f"hf-dflash2 store: {error}") from None
    target, tokenizer, dtype = _load_target(args, args.mixed_precision)
    text_config = target.config.get_text_config()
    if layer_ids is None:
        from ..configuration_dflash2 import default_target_layer_ids

        layer_ids = default_target_layer_ids(text_config.num_hidden_layers, 5)
    # before meta.json is written: a store's first settings are its settings for good
    if not all(0 <= i < text_config.num_hidden_layers for i in layer_ids):
        raise SystemExit(f"--target-layer-ids {layer_ids}: the target has layers "
                         f"0..{text_config.num_hidden_layers - 1}")
    if args.top_k > text_config.vocab_size:
        raise SystemExit(f"--top-k {args.top_k} exceeds the target's vocabulary of {text_config.vocab_size}")
    meta = StoreMeta(
        target=_store_target_name(args),
        target_layer_ids=layer_ids,
        hidden_size=text_config.hidden_size,
        vocab_size=text_config.vocab_size,
        top_k=args.top_k,
        final_hidden=args.final_hidden,
    )
    try:
        store = FeatureStore(args.output, meta)
    except ValueError as error:  # an existing store built otherwise: named, and left as it is
        raise SystemExit(f"hf-dflash2 store: {error}") from None
    records = []
    for source in sources:
        if source == "sharegpt":
            exchanges, report = sharegpt_exchanges()
            exchanges = drop_evaluation_prompts(exchanges, report)
            random.Random(args.seed).shuffle(exchanges)
            for exchange in exchanges:
                encoded = encode_exchange(tokenizer, exchange["messages"], args.max_length)
                if encoded is None:
                    report.skip("prompt longer than --max-length")
                    continue
                records.append({"id": exchange["id"], **encoded})
            logger.info("ShareGPT exchanges: %s", report)
        else:
            records.extend(regenerated_records(source, args.max_length))
    logger.info(
        "store %s: %d sequences / %d tokens already in, dtype %s", args.output, len(store), store.num_tokens, dtype
    )
    build_store(
        target,
        records,
        store,
        tokens_per_batch=args.tokens_per_batch,
        max_tokens=args.max_tokens,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    logger.info("store %s: %d sequences, %d tokens", args.output, len(store), store.num_tokens)
    return 0


def _register_store(sub) -> None:
    p = sub.add_parser(
        "store", help="run the target once over training text: tapped features + top-k labels (resumable)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_target_args(p)
    p.add_argument("--output", required=True, help="store folder (created, or appended to)")
    p.add_argument("--source", default="sharegpt", help="comma-separated: 'sharegpt' and/or regenerated JSONL files")
    p.add_argument("--max-tokens", type=int, default=1_000_000, help="stop when the store holds this many tokens")
    p.add_argument("--max-length", type=int, default=512, help="tokens per sequence (prompt + response)")
    p.add_argument("--top-k", type=int, default=32, help="target log-probabilities kept per position")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated tapped layers (default: 5 evenly spaced)")
    p.add_argument("--tokens-per-batch", type=int, default=4096, help="tokens per target forward (memory)")
    p.add_argument("--final-hidden", action="store_true",
                   help="also keep the target's LM-head input per token (bf16, 2*H bytes), for `train --hidden-weight`")
    p.add_argument("--mixed-precision", default="auto", help=PRECISION_HELP)
    p.add_argument("--seed", type=int, default=0, help="order of the ShareGPT exchanges")
    p.set_defaults(func=cmd_store)


# ---------------------------------------------------------------------- train
def cmd_train(args) -> int:
    import torch

    from ..precision import PRECISION_CHOICES, resolve_precision
    from .regenerate import encode_prompts
    from .trainer import Trainer, load_sequences, parse_record_weights, store_sequences

    if args.mixed_precision not in PRECISION_CHOICES:
        raise SystemExit(f"--mixed-precision {args.mixed_precision!r}: choose one of {PRECISION_CHOICES}")
    if (args.data is None) == (args.store is None):
        raise SystemExit("give exactly one of --data (regenerated JSONL) or --store (feature store folder)")
    if args.data is not None and args.hidden_weight:
        raise SystemExit(f"--hidden-weight {args.hidden_weight} needs a --store built with --final-hidden, not --data")
    source = args.data or args.store
    if not Path(source).exists():
        raise SystemExit(f"{source}: no such file or folder (run `hf-dflash2 regenerate` or `hf-dflash2 store` first)")
    record_weights = None
    if args.records is not None:
        try:
            record_weights = parse_record_weights(args.records)
        except ValueError as error:
            raise SystemExit(f"hf-dflash2 train: {error}") from None
        if args.store is None:
            raise SystemExit(f"--records {args.records!r} selects records of a --store; --data has no record ids")
    target_layers_init = None
    if args.init_layers_from_target is not None:
        if args.init_from:
            raise SystemExit(f"--init-layers-from-target {args.init_layers_from_target!r} starts a fresh head; "
                             f"--init-from {args.init_from} starts from trained weights: give one of them")
        try:
            target_layers_init = ("last" if args.init_layers_from_target == "last"
                                  else [int(i) for i in args.init_layers_from_target.split(",")])
        except ValueError:
            raise SystemExit(f"--init-layers-from-target {args.init_layers_from_target!r}: expected 'last' or "
                             "comma-separated integers, one per head layer, e.g. 28,29") from None
        if target_layers_init != "last" and len(target_layers_init) != args.layers:
            raise SystemExit(f"--init-layers-from-target {args.init_layers_from_target!r} names "
                             f"{len(target_layers_init)} target layers, the head has --layers {args.layers}")
    if args.init_context_from_target and target_layers_init is None:
        raise SystemExit("--init-context-from-target starts the context projection as what the first copied layer "
                         "reads: give --init-layers-from-target too")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.release_freed_memory:
        from ..allocator import retain_freed_memory

        retain_freed_memory()
    precision = resolve_precision(args.mixed_precision)
    config = TrainingConfig(
        output_dir=args.output,
        steps=args.steps,
        batch_size=args.batch_size,
        anchors_per_sequence=args.anchors,
        loss_positions=args.loss_positions,
        max_length=args.max_length,
        learning_rate=args.lr,
        selector_weight=args.selector_weight,
        vocab_subset=args.vocab_subset,
        label_source=args.label_source,
        draft_vocab_size=args.draft_vocab_size,
        seed=args.seed,
        mixed_precision=precision,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens,
        log_every=args.log_every,
        standardize_features=not args.raw_features,
        output_scale=args.output_scale,
        warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule,
        decay_steps=args.decay_steps,
        logit_ramp_steps=args.logit_ramp_steps,
        ema_decay=args.ema_decay,
        gradient_checkpointing=args.gradient_checkpointing,
        hidden_weight=args.hidden_weight,
        loss_gamma=args.loss_gamma,
        copy_weight=args.copy_weight,
    )
    try:
        config.validate()
    except ValueError as error:  # a named error, before any model loads
        raise SystemExit(f"hf-dflash2 train: {error}") from None
    _check_train_args(args)
    # what export reads back to rebuild the head on its own target, from any working directory
    config.extra.update({"target": _absolute_if_local(args.target), "gguf_file": args.gguf_file})
    store = None
    if args.store:
        from .store import FeatureStore

        try:
            store = FeatureStore(args.store)
        except (FileNotFoundError, ValueError) as error:
            raise SystemExit(f"hf-dflash2 train: --store {args.store}: {error}") from None
        if config.hidden_weight and not store.meta.final_hidden:
            raise SystemExit(
                f"--hidden-weight {args.hidden_weight}: store {args.store} keeps no final hidden states "
                "(build one with `hf-dflash2 store --final-hidden`)"
            )
        try:
            sequences = store_sequences(store, args.max_length, record_weights)
        except ValueError as error:
            raise SystemExit(f"hf-dflash2 train: {error}") from None
        config.extra["data"] = f"feature store {args.store} ({store.num_tokens:,} target tokens)" + (
            f", only its records starting with {args.records} ({len(sequences):,} sequences per epoch)"
            if record_weights
            else ""
        )
        layer_ids = store.meta.target_layer_ids
        if args.target_layer_ids:  # a head may tap some of the store's layers (arms on the same text)
            chosen = _layer_ids(args.target_layer_ids)
            if not set(chosen) <= set(layer_ids) or len(set(chosen)) != len(chosen):
                raise SystemExit(f"--target-layer-ids {args.target_layer_ids}: the store {args.store} keeps "
                                 f"layers {layer_ids}; choose distinct layers among them")
            layer_ids = chosen
    else:
        sequences = load_sequences(args.data, args.max_length)
        layer_ids = _layer_ids(args.target_layer_ids)
    if args.max_sequences:
        sequences = sequences[: args.max_sequences]
        if args.store:
            config.extra["data"] += f"; the first {len(sequences):,} used (--max-sequences)"
    if store is not None and not _same_target(store.meta.target, _store_target_name(args)):
        raise SystemExit(f"--store {args.store} holds the features of {store.meta.target!r}, not of "
                         f"{_store_target_name(args)!r}: pass its --target, or build a store for this one")
    # The target stays fp32 under autocast (its embedding / LM head are shared, frozen); the store
    # already holds its features, so its forward runs only for evaluation.
    from ..assets import load_target

    target, tokenizer = load_target(args.target, args.gguf_file)
    apply_chat_template_option(tokenizer, args.chat_template)
    if store is not None:
        text = target.config.get_text_config()
        for name in ("hidden_size", "vocab_size"):
            if getattr(store.meta, name) != getattr(text, name):
                raise SystemExit(f"--store {args.store} has {name}={getattr(store.meta, name)}, the target "
                                 f"{_store_target_name(args)} has {getattr(text, name)}")
    try:
        drafter = _new_drafter(target, args, layer_ids)
    except ValueError as error:
        raise SystemExit(f"hf-dflash2 train: {error}") from None
    eval_prompts = [ids for _, ids in encode_prompts(tokenizer, heldout_prompts(args.eval_prompts), 1024)]
    trainer = Trainer(target, drafter, sequences, config, eval_prompts=eval_prompts, store=store)
    resuming = args.resume and trainer.checkpoint_path.exists()
    if args.init_from and resuming:
        logger.info("--init-from %s ignored: resuming from %s", args.init_from, trainer.checkpoint_path)
    elif args.init_from:
        try:
            trainer.initialize_from(args.init_from)
        except (FileNotFoundError, ValueError) as error:
            raise SystemExit(f"hf-dflash2 train: {error}") from None
    elif target_layers_init and resuming:
        logger.info("--init-layers-from-target%s ignored: resuming from %s",
                    " and --init-context-from-target" if args.init_context_from_target else "", trainer.checkpoint_path)
    elif target_layers_init:
        try:
            trainer.initialize_layers_from_target(target_layers_init, context=args.init_context_from_target)
        except ValueError as error:
            raise SystemExit(f"hf-dflash2 train: {error}") from None
    logger.info(
        "training %s head: %d sequences, %d steps, precision %s, labels %s",
        "DFlash-1" if args.dflash1 else "dFlash 2",
        len(sequences),
        args.steps,
        precision,
        args.label_source,
    )
    trainer.train(resume=args.resume, stop_after=args.stop_after, stop_after_minutes=args.stop_after_minutes)
    if trainer.accelerator.is_main_process:
        head = trainer.save_head(Path(args.output) / "head")
        (Path(args.output) / "history.json").write_text(json.dumps(trainer.history, indent=1))
        logger.info("head written to %s", head)
    return 0


def heldout_prompts(count: int, slice_index: int = 0) -> list[dict]:
    """``count`` evaluation prompts, alternating HumanEval and MT-Bench (every 10th question: one per
    category; 16 prompts in all). Both sets are excluded from every training source
    (``store.drop_evaluation_prompts``). ``slice_index`` k > 0 picks another 16, disjoint from slice 0's:
    MT-Bench questions k, k + 10, ... and HumanEval problems 8k to 8k + 7, a second opinion when many heads
    have been chosen between on slice 0."""
    from ..assets import load_humaneval_prompts, load_mtbench_prompts

    if not 0 <= slice_index < 10:
        raise ValueError(f"slice_index {slice_index} is outside 0..9 (MT-Bench has ten questions per category)")
    humaneval, mtbench = load_humaneval_prompts()[8 * slice_index :], load_mtbench_prompts()[slice_index::10]
    mixed = [p for pair in zip(humaneval, mtbench) for p in pair]
    return mixed[:count]


def _absolute_if_local(target: str | None) -> str | None:
    """A target folder as an absolute path (a Hub id, or None for the default, as given)."""
    return str(Path(target).resolve()) if target is not None and Path(target).exists() else target


def _same_target(a: str, b: str) -> bool:
    """The same name, or two spellings of one local folder (``./m``, ``m``, ``/abs/m``)."""
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def _check_train_args(args) -> None:
    """The head's shape options and the output folder, named, before any model loads."""
    for name, least in (("layers", 1), ("block_size", 2), ("selector_rank", 1), ("selector_top_k", 1),
                        ("max_sequences", 0)):  # --max-sequences 0: every sequence (the recipes' default)
        value = getattr(args, name)
        if value is not None and value < least:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        raise SystemExit(f"--output {args.output} is a file, not a run folder")
    if (output / "checkpoint.pt").exists() and not args.resume:
        raise SystemExit(f"--output {args.output} already holds a run (checkpoint.pt): pass --resume to continue "
                         "it, or choose another --output")


def _new_drafter(target, args, layer_ids):
    from .trainer import new_drafter_for

    return new_drafter_for(
        target,
        num_hidden_layers=args.layers,
        block_size=args.block_size,
        dflash2=not args.dflash1,
        seed=args.seed,
        selector_rank=args.selector_rank,
        selector_top_k=args.selector_top_k,
        target_layer_ids=layer_ids,
        mask_token_id=args.mask_token_id,
        output_scale=args.output_scale,
    )


def _register_train(sub) -> None:
    d = _defaults(TrainingConfig)
    p = sub.add_parser("train", help="train a dFlash 2 (or --dflash1) head on a feature store or regenerated data",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_target_args(p)
    p.add_argument("--store", default=None, help="feature store folder from `hf-dflash2 store` (recommended)")
    p.add_argument("--data", default=None, help="regenerated JSONL from `hf-dflash2 regenerate` (target runs online)")
    p.add_argument("--output", required=True, help="run folder: checkpoint.pt, head/, history.json")
    p.add_argument("--layers", type=int, default=2, help="the head's transformer layers")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per drafted block (anchor + B-1 drafts); the committed head: 8")
    p.add_argument("--selector-rank", type=int, default=256, help="rank of the path selector's K x K pair scores")
    p.add_argument("--selector-top-k", type=int, default=16,
                   help="candidates per position the selector chooses among (K)")
    p.add_argument("--target-layer-ids", default=None,
                   help="comma-separated tapped layers (default: evenly spaced; with --store, the store's, or some of "
                   "them; with --init-from a head tapping a subset, its new taps start at zero)")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the target's pad token")
    p.add_argument("--dflash1", action="store_true", help="ablation: no conv, no selector")
    p.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps (the schedule's length)")
    p.add_argument("--stop-after", type=int, default=None, help="run at most this many steps now (resume later)")
    p.add_argument("--init-from", default=None,
                   help="start from trained weights: a run (its folder or checkpoint.pt) or a saved head folder "
                   "(e.g. heads/smollm2-135m-dflash2); weights only, fresh schedule")
    p.add_argument("--init-layers-from-target", default=None,
                   help="comma-separated target layers, one per head layer, or 'last' (the target's last "
                   "--layers layers): a fresh head whose layers start as copies of them; not with --init-from")
    p.add_argument("--init-context-from-target", action="store_true",
                   help="with --init-layers-from-target: fc passes the tap the first copied layer reads (its input) "
                   "and zeroes the other taps, and hidden_norm takes that layer's input norm, so the copied layer "
                   "starts attending over the context with the target's own keys and values")
    p.add_argument("--stop-after-minutes", type=float, default=None, help="checkpoint and stop after this long")
    p.add_argument("--batch-size", type=int, default=d["batch_size"], help="sequences per step")
    p.add_argument("--anchors", type=int, default=d["anchors_per_sequence"],
                   help="blocks drafted per sequence and step, at random anchor positions in its response")
    p.add_argument("--loss-positions", type=int, default=d["loss_positions"],
                   help="drafted positions with a loss (default: all B-1)")
    p.add_argument("--max-length", type=int, default=d["max_length"], help="tokens per sequence read from the data")
    p.add_argument("--max-sequences", type=int, default=None, help="train on the first N sequences only")
    p.add_argument("--records", default=None,
                   help="with --store: train only on records whose id starts with one of these comma-separated "
                   "prefixes (regen/: the target's own responses; sharegpt/: ShareGPT's text); PREFIX=N repeats "
                   "its records N times per epoch (the longest matching prefix counts), e.g. regen/python/=3,regen/")
    p.add_argument("--lr", type=float, default=d["learning_rate"], help="peak learning rate (AdamW; see --lr-schedule)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 4%% of --steps")
    p.add_argument("--lr-schedule", choices=["cosine", "wsd"], default=d["lr_schedule"],
                   help="after the warmup: cosine decay over --steps, or wsd: constant until the last --decay-steps, "
                   "then down to 0 (a long run's trunk at a constant rate; resume a copy of its checkpoint with "
                   "--steps NOW+DECAY to cool it down into a head while the trunk goes on)")
    p.add_argument("--decay-steps", type=int, default=None,
                   help="with --lr-schedule wsd: the cool-down's length (default: 20%% of the steps after warmup)")
    # The CLI's defaults are this round's recipe (README "Training"); TrainingConfig keeps the ramp for code
    # that builds full-scale heads with DFlash2DraftModel.for_target.
    p.add_argument("--output-scale", type=float, default=0.1,
                   help="a fresh head's output norm starts at this fraction of the target's final-norm scale")
    p.add_argument("--logit-ramp-steps", type=int, default=0,
                   help="steps over which a fresh head's logit scale grows to 1 (capped at the warmup; 0: none)")
    p.add_argument("--ema-decay", type=float, default=d["ema_decay"],
                   help="keep a moving average of the weights with this decay (e.g. 0.998; 0: none), checkpointed "
                   "beside them; export it with `python -m hf_dflash2.training.export RUN DIR --ema`")
    p.add_argument("--release-freed-memory", action="store_true",
                   help="leave glibc's defaults, which give freed memory back to the kernel (by default the "
                   "trainer keeps it mapped: each step's temporaries then reuse pages instead of faulting in "
                   "fresh ones; see hf_dflash2/allocator.py)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each head layer in the backward pass instead of keeping its activations "
                   "(less memory, more time: large targets on a GPU)")
    p.add_argument("--hidden-weight", type=float, default=d["hidden_weight"],
                   help="weight of a loss pulling the head's LM-head input towards the target's at each drafted "
                   "position (relative squared error; needs a store built with --final-hidden; 0: off)")
    p.add_argument("--loss-gamma", type=float, default=d["loss_gamma"],
                   help="decay of the loss over block positions, weight exp(-(k-1)/gamma) "
                   "(default: the DFlash paper's for the block size, 4 at B = 8)")
    p.add_argument("--copy-weight", type=float, default=d["copy_weight"],
                   help="weight of the block positions the fast loop's n-gram chain would draft and have accepted "
                   "from the same anchor (1: off; below 1 the head learns more of the text no copy drafts)")
    p.add_argument("--selector-weight", type=float, default=d["selector_weight"],
                   help="weight of the selector's loss beside the per-position loss")
    p.add_argument("--vocab-subset", choices=["data", "full"], default=d["vocab_subset"],
                   help="draft over the tokens in the data, or the whole vocabulary")
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=d["draft_vocab_size"],
        help="with --store: train and draft over the N most frequent label tokens only",
    )
    p.add_argument(
        "--label-source",
        choices=["data", "argmax", "kl"],
        default=d["label_source"],
        help="data tokens, the target's argmax, or sparse KL to the target's top-k (the last two need --store)",
    )
    p.add_argument("--mixed-precision", default="auto", help=PRECISION_HELP)
    p.add_argument("--seed", type=int, default=d["seed"], help="initialisation, data order and anchors")
    p.add_argument("--checkpoint-every", type=int, default=d["checkpoint_every"],
                   help="steps between checkpoints (atomic; --resume continues)")
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="steps between held-out tau evaluations")
    p.add_argument("--eval-prompts", type=int, default=d["eval_prompts"],
                   help="held-out prompts per evaluation (HumanEval and MT-Bench, never trained on)")
    p.add_argument("--eval-max-new-tokens", type=int, default=d["eval_max_new_tokens"],
                   help="tokens generated per evaluation prompt")
    p.add_argument("--log-every", type=int, default=d["log_every"], help="steps between log lines")
    p.add_argument(
        "--raw-features",
        action="store_true",
        help="ablation: train fc on the raw tapped features instead of per-channel standardized ones",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--resume", action="store_true", help="continue the run in --output from its checkpoint")
    p.set_defaults(func=cmd_train)


def register(subparsers) -> None:
    from .average import register as _register_average

    _register_regenerate(subparsers)
    _register_store(subparsers)
    _register_train(subparsers)
    _register_average(subparsers)
