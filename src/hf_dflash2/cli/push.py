"""``hf-dflash2 push HEAD_FOLDER REPO_ID``: upload a head with a generated model card."""

from __future__ import annotations

import sys

from ..settings import CardSettings, add_arguments, from_args


def cmd_push(args) -> int:
    from ..hub import load_card_results, push_head

    settings = from_args(CardSettings, args)
    try:
        url = push_head(
            args.head_folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            create_pr=args.create_pr,
            results=load_card_results(settings.results, settings.method),
            endpoint=args.endpoint,
            base_model=args.base_model,
            dry_run=args.dry_run,
        )
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(url)
    return 0


def cmd_card(args) -> int:
    from pathlib import Path

    from ..hub import is_head_folder, load_card_results, render_model_card

    settings = from_args(CardSettings, args)
    ok, reason = is_head_folder(args.head_folder)
    if not ok:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    try:
        results = load_card_results(settings.results, settings.method)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    card = render_model_card(args.head_folder, args.repo_id, results=results)
    (Path(args.head_folder) / "README.md").write_text(card, encoding="utf-8")
    print(f"wrote {Path(args.head_folder) / 'README.md'}")
    return 0


def register(subparsers) -> None:
    card = subparsers.add_parser("card", help="write a head folder's README.md model card from a bench report")
    card.add_argument("head_folder", metavar="HEAD_FOLDER")
    card.add_argument("repo_id", metavar="REPO_ID")
    add_arguments(card, CardSettings)
    card.set_defaults(func=cmd_card)

    push = subparsers.add_parser(
        "push",
        help="upload a head folder (weights, config, remote code, model card) to the Hugging Face Hub",
        description="Upload a head folder written by `hf-dflash2 train` / save_head to the Hub, with a generated "
        "README.md (the folder on disk is left unchanged). The token comes from HF_TOKEN or `hf auth login`.",
    )
    push.add_argument("head_folder", metavar="HEAD_FOLDER", help="folder with config.json and model.safetensors")
    push.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, e.g. your-name/Qwen3-8B-dflash2")
    add_arguments(push, CardSettings)
    push.add_argument("--private", action="store_true", help="create the repo private (ignored if it exists)")
    push.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    push.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing to main")
    push.add_argument("--base-model", default=None,
                      help="target model id for the card, if config.json has no base_model")
    push.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or https://huggingface.co)")
    push.add_argument("--dry-run", default=None, metavar="DIR",
                      help="write exactly what would be uploaded (weights, code, card) into the new folder DIR "
                      "instead; no token or network needed")
    push.set_defaults(func=cmd_push)
