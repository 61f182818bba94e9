"""``hf-dflash2 push HEAD_FOLDER REPO_ID``: upload a head with a generated model card.

The flags are ``settings.CardSettings`` (``card``) and ``settings.PushSettings`` (``push``). HEAD_FOLDER and
REPO_ID stay explicit positionals: they are what the command acts on, not settings with defaults, and
``settings.add_arguments`` generates ``--flags`` only.
"""

from __future__ import annotations

import sys

from ..settings import CardSettings, PushSettings, add_arguments, from_args


def cmd_push(args) -> int:
    from ..hub import load_card_results, push_head

    settings = from_args(PushSettings, args)
    try:
        url = push_head(
            args.head_folder,
            args.repo_id,
            private=settings.private,
            revision=settings.revision,
            create_pr=settings.create_pr,
            results=load_card_results(settings.results, settings.method),
            endpoint=settings.endpoint,
            base_model=settings.base_model,
            dry_run=settings.dry_run,
        )
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(url)
    return 0


def cmd_card(args) -> int:
    from pathlib import Path

    from ..hub import check_repo_id, is_head_folder, load_card_results, render_model_card

    settings = from_args(CardSettings, args)
    ok, reason = is_head_folder(args.head_folder)
    if not ok:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    try:  # the card names the repo in its usage code: the name push would refuse is refused here too
        check_repo_id(args.repo_id)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        results = load_card_results(settings.results, settings.method)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    card = render_model_card(args.head_folder, args.repo_id, results=results, base_model=settings.base_model)
    (Path(args.head_folder) / "README.md").write_text(card, encoding="utf-8")
    print(f"wrote {Path(args.head_folder) / 'README.md'}")
    return 0


def _add_head_and_repo(parser) -> None:
    parser.add_argument("head_folder", metavar="HEAD_FOLDER", help="folder with config.json and model.safetensors")
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, e.g. your-name/Qwen3-8B-dflash2")


def register(subparsers) -> None:
    card = subparsers.add_parser("card", help="write a head folder's README.md model card from a bench report")
    _add_head_and_repo(card)
    add_arguments(card, CardSettings)
    card.set_defaults(func=cmd_card)

    push = subparsers.add_parser(
        "push",
        help="upload a head folder (weights, config, remote code, model card) to the Hugging Face Hub",
        description="Upload a head folder written by `hf-dflash2 train` / save_head to the Hub, with a generated "
        "README.md (the folder on disk is left unchanged). The token comes from HF_TOKEN or `hf auth login`.",
    )
    _add_head_and_repo(push)
    add_arguments(push, PushSettings)
    push.set_defaults(func=cmd_push)
