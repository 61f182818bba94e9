"""The ``hf-dflash2`` command: regenerate, train, bench, push, demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger("hf_dflash2")


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target folder or Hub id (default: offline SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --target")


def _load_prompts(source: str | None, limit: int | None, seed: int):
    import random

    from .assets import load_jsonl_prompts, load_sharegpt_prompts

    if source in (None, "sharegpt"):
        prompts, report = load_sharegpt_prompts()
    else:
        prompts, report = load_jsonl_prompts(source)
    logger.info("prompts from %s: %s", source or "sharegpt", report)
    random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit else prompts


def cmd_regenerate(args) -> int:
    from .assets import load_target
    from .training.regenerate import RegenerationConfig, regenerate

    config = RegenerationConfig(
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.do_sample,
        temperature=args.temperature,
        seed=args.seed,
    )
    prompts = _load_prompts(args.prompts, None, args.seed)
    target, tokenizer = load_target(args.target, args.gguf_file)
    regenerate(target, tokenizer, prompts, args.output, config, max_records=args.limit)
    return 0


def cmd_train(args) -> int:
    import torch

    from .assets import load_target
    from .training.regenerate import encode_prompts
    from .training.trainer import Trainer, TrainingConfig, load_sequences, new_drafter_for

    if args.threads:
        torch.set_num_threads(args.threads)
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
        seed=args.seed,
        mixed_precision=args.mixed_precision,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        eval_prompts=args.eval_prompts,
        log_every=args.log_every,
    )
    if not Path(args.data).exists():
        raise SystemExit(f"--data {args.data}: no such file (run `hf-dflash2 regenerate` first)")
    sequences = load_sequences(args.data, args.max_length)
    if args.max_sequences:
        sequences = sequences[: args.max_sequences]
    target, tokenizer = load_target(args.target, args.gguf_file)
    layer_ids = [int(i) for i in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    drafter = new_drafter_for(
        target,
        num_hidden_layers=args.layers,
        block_size=args.block_size,
        dflash2=not args.dflash1,
        seed=args.seed,
        selector_rank=args.selector_rank,
        selector_top_k=args.selector_top_k,
        target_layer_ids=layer_ids,
        mask_token_id=args.mask_token_id,
    )
    from .assets import load_humaneval_prompts

    eval_prompts = [ids for _, ids in encode_prompts(tokenizer, load_humaneval_prompts()[: args.eval_prompts], 1024)]
    trainer = Trainer(target, drafter, sequences, config, eval_prompts=eval_prompts)
    logger.info("training %s head: %d sequences, %d steps", "DFlash-1" if args.dflash1 else "dFlash 2", len(sequences), args.steps)
    trainer.train(resume=args.resume, stop_after=args.stop_after)
    if trainer.accelerator.is_main_process:
        head = trainer.save_head(Path(args.output) / "head")
        (Path(args.output) / "history.json").write_text(json.dumps(trainer.history, indent=1))
        logger.info("head written to %s", head)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dflash2", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    regen = sub.add_parser("regenerate", help="write the target's own responses to a prompt set (resumable)")
    _add_target_args(regen)
    regen.add_argument("--prompts", default="sharegpt", help="'sharegpt' (offline package) or a JSONL of chats/prompts")
    regen.add_argument("--output", required=True)
    regen.add_argument("--limit", type=int, default=None, help="stop after this many records in the file")
    regen.add_argument("--max-prompt-tokens", type=int, default=256)
    regen.add_argument("--max-new-tokens", type=int, default=160)
    regen.add_argument("--batch-size", type=int, default=32)
    regen.add_argument("--do-sample", action="store_true")
    regen.add_argument("--temperature", type=float, default=1.0)
    regen.add_argument("--seed", type=int, default=0)
    regen.set_defaults(func=cmd_regenerate)

    train = sub.add_parser("train", help="train a dFlash 2 (or --dflash1) head on regenerated data")
    _add_target_args(train)
    train.add_argument("--data", required=True, help="regenerated JSONL from `hf-dflash2 regenerate`")
    train.add_argument("--output", required=True)
    train.add_argument("--layers", type=int, default=2)
    train.add_argument("--block-size", type=int, default=16)
    train.add_argument("--selector-rank", type=int, default=128)
    train.add_argument("--selector-top-k", type=int, default=16)
    train.add_argument("--target-layer-ids", default=None, help="comma-separated tapped layers (default: evenly spaced)")
    train.add_argument("--mask-token-id", type=int, default=None, help="default: the target's pad token")
    train.add_argument("--dflash1", action="store_true", help="ablation: no conv, no selector")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--stop-after", type=int, default=None, help="run at most this many steps now (resume later)")
    train.add_argument("--batch-size", type=int, default=1)
    train.add_argument("--anchors", type=int, default=64)
    train.add_argument("--loss-positions", type=int, default=None)
    train.add_argument("--max-length", type=int, default=512)
    train.add_argument("--max-sequences", type=int, default=None)
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--selector-weight", type=float, default=1.0)
    train.add_argument("--vocab-subset", choices=["data", "full"], default="data")
    train.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--checkpoint-every", type=int, default=50)
    train.add_argument("--eval-every", type=int, default=0)
    train.add_argument("--eval-prompts", type=int, default=4)
    train.add_argument("--log-every", type=int, default=10)
    train.add_argument("--threads", type=int, default=None)
    train.add_argument("--resume", action="store_true")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = build_parser()
    _register_more(parser)
    args = parser.parse_args(argv)
    return args.func(args)


def _register_more(parser) -> None:
    """Subcommands that live in their own modules (bench, push, demo)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for module_name in ("hf_dflash2.bench", "hf_dflash2.push_cli", "hf_dflash2.demo"):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        module.register(sub)


if __name__ == "__main__":
    sys.exit(main())
