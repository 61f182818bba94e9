"""``hf-dflash2 regenerate | store | train``: the training side of the command line.

Defaults come from the dataclasses (``RegenerationConfig``; ``train``'s flags are ``config.TrainSettings``'
fields, whose shared defaults are ``TrainingConfig``'s), so the command line and the Python API cannot disagree.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import asdict, fields, replace
from pathlib import Path

from ..prompts import CHAT_TEMPLATE_HELP, apply_chat_template_option, chat_template_argument
from .config import PRECISION_HELP
from .regenerate import RegenerationConfig
from .trainer import TrainingConfig

logger = logging.getLogger("hf_dflash2")



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
    from ..cpu.precision import resolve_dtype

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
    from ..cpu.linear_kernels import check_linear_kernel, use_linear_kernel
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
    from ..cpu.precision import PRECISION_CHOICES
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
    """``hf-dflash2 train``: the runs of ``--config`` (its phases in order) or of the flags alone; the flags
    given override the file. ``--plan`` prints each run's settings and stops."""
    from .config import FIELDS, TrainSettings, plan_runs, read_recipe

    given = {name: value for name, value in vars(args).items() if name in FIELDS}
    try:
        recipe = read_recipe(args.config) if args.config else None
        runs = [(name, TrainSettings(**values)) for name, values in plan_runs(recipe, given)]
    except ValueError as error:  # RecipeError included: named, before anything loads
        raise SystemExit(f"hf-dflash2 train: {error}") from None
    if any(settings.output is None for _, settings in runs):
        args.train_parser.error("the following arguments are required: --output"
                                + (f" (or output: in {args.config})" if args.config else ""))
    if args.plan:
        for name, settings in runs:
            try:
                _training_config(settings, "no").validate()
            except ValueError as error:
                raise SystemExit(f"hf-dflash2 train: {f'phase {name}: ' if name else ''}{error}") from None
        print(json.dumps([{"phase": name, **asdict(settings)} for name, settings in runs], indent=1))
        return 0
    for name, settings in runs:  # every run's settings checked before the first one trains
        try:
            _check_settings(_forked(settings))
        except SystemExit as error:
            raise SystemExit(f"phase {name}: {error.code}" if name else error.code) from None
    for name, settings in runs:
        if name is not None:
            logger.info("phase %s: %s", name, settings.output)
        step, end = _train(settings)
        if step < end and name is not None and name != runs[-1][0]:
            logger.info("phase %s stopped at step %d before its end (%d): the later phases wait; run the same "
                        "command again to continue", name, step, end)
            break
    return 0


def _forked(args):
    """A run with ``fork_from`` resumes: the copy of the other run's checkpoint, or its own once it has one."""
    return replace(args, resume=True) if args.fork_from else args


def _fork(args) -> None:
    """``--fork-from``: ``--output`` starts as a copy of that run's checkpoint (once; later calls resume it)."""
    import shutil

    output = Path(args.output)
    if (output / "checkpoint.pt").exists():
        return
    source = Path(args.fork_from)
    source = source / "checkpoint.pt" if source.is_dir() else source
    if not source.is_file():
        raise SystemExit(f"--fork-from {args.fork_from}: no checkpoint to start from (train that run first)")
    output.mkdir(parents=True, exist_ok=True)
    partial = output / "checkpoint.pt.fork"
    shutil.copyfile(source, partial)  # the source is replaced atomically by its run, so this copy is whole
    partial.replace(output / "checkpoint.pt")
    logger.info("--fork-from: %s copied to %s", source, output / "checkpoint.pt")


def _check_settings(args) -> tuple[dict | None, list[int] | str | None]:
    """The checks that need no model, each naming its flag: the record weights and the target layers to
    copy, parsed."""
    from ..cpu.precision import PRECISION_CHOICES
    from .trainer import parse_record_weights

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
    try:
        _training_config(args, "no").validate()
    except ValueError as error:  # a named error, before any model loads
        raise SystemExit(f"hf-dflash2 train: {error}") from None
    _check_train_args(args)
    return record_weights, target_layers_init


def _training_config(args, precision: str) -> TrainingConfig:
    return TrainingConfig(
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


def _train(args) -> tuple[int, int]:
    """One run (``args``: a ``TrainSettings``). Returns the step it reached and the step it was to reach."""
    import torch

    from ..cpu.precision import resolve_precision
    from .regenerate import encode_prompts
    from .trainer import Trainer, load_sequences, store_sequences

    args = _forked(args)
    record_weights, target_layers_init = _check_settings(args)
    if args.fork_from:
        _fork(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.release_freed_memory:
        from ..cpu.allocator import retain_freed_memory

        retain_freed_memory()
    precision = resolve_precision(args.mixed_precision)
    config = _training_config(args, precision)
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
    trainer.train(resume=args.resume, stop_after=args.stop_after, stop_after_minutes=args.stop_after_minutes,
                  stop_at=args.stop_at)
    if trainer.accelerator.is_main_process:
        head = trainer.save_head(Path(args.output) / "head")
        (Path(args.output) / "history.json").write_text(json.dumps(trainer.history, indent=1))
        logger.info("head written to %s", head)
    return trainer.step, min(args.steps, args.steps if args.stop_at is None else args.stop_at)


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
    from ..settings import add_arguments
    from .config import TrainSettings

    p = sub.add_parser("train", help="train a dFlash 2 (or --dflash1) head on a feature store or regenerated data")
    p.add_argument("--config", default=None,
                   help="a recipe: YAML or JSON whose keys are this command's flags (with _ for -), and optionally "
                   "phases, runs made in order (e.g. recipes/smollm2-135m-dflash2.yaml); flags given here override it")
    p.add_argument("--plan", action="store_true",
                   help="print each run's settings (--config and flags merged, phase by phase) as JSON and stop")
    # Every TrainSettings field is a flag; one not given leaves no attribute, so a --config value stays under it.
    add_arguments(p, TrainSettings, suppress_defaults=True)
    p.set_defaults(func=cmd_train, train_parser=p)


def register(subparsers) -> None:
    from .average import register as _register_average

    _register_regenerate(subparsers)
    _register_store(subparsers)
    _register_train(subparsers)
    _register_average(subparsers)
