"""Prompts for every command: chat template resolution (``--chat-template auto|none|FILE``), encoding,
left padding, and loading a head for a target.

Many targets are base models whose tokenizer has no chat template. ``auto`` uses the tokenizer's template
when there is one and otherwise falls back to plain text, with a logged note; ``none`` always uses plain
text; a file path uses that Jinja template. The choice is validated before any model is loaded
(``parse_chat_template``) and then installed on the tokenizer (``apply_chat_template_option``), so every
later ``tokenizer.apply_chat_template`` call (regeneration, training's eval prompts, bench, demo) agrees.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CHAT_TEMPLATE_HELP = (
    "auto (default): the tokenizer's chat template, plain text when it has none; none: plain text; "
    "or a Jinja chat template file"
)


class ChatTemplateError(ValueError):
    """A ``--chat-template`` value that is neither auto, none, nor a readable template file."""


def parse_chat_template(value: str | None) -> str:
    """``"auto"``, ``"none"`` or the text of a template file. Cheap: call it before loading a model."""
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return "none"
    path = Path(value)
    if not path.is_file():
        raise ChatTemplateError(f"--chat-template {value!r}: expected auto, none or an existing template file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"--chat-template {value!r}: cannot read the file ({error})") from None
    if "{{" not in text and "{%" not in text:
        raise ChatTemplateError(f"--chat-template {value!r}: the file holds no Jinja template ({len(text)} characters)")
    return text


def chat_template_argument(value: str) -> str:
    """``argparse`` type of ``--chat-template``: a bad value is a usage error at parse time, before any load."""
    import argparse

    try:
        parse_chat_template(value)
    except ChatTemplateError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def plain_text_template(tokenizer) -> str:
    """A chat template that writes the turns' contents separated by blank lines, as a base model reads text.

    It starts with the BOS token exactly when the tokenizer adds one to plain text, since
    ``apply_chat_template`` tokenizes without special tokens.
    """
    bos = ""
    if tokenizer.bos_token is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]:
        bos = "{{ bos_token }}"
    turns = "{% for message in messages %}{{ message['content'] }}{% if not loop.last %}\n\n{% endif %}{% endfor %}"
    return bos + turns


def apply_chat_template_option(tokenizer, value: str | None = "auto") -> str:
    """Install the chosen template on ``tokenizer``; returns ``"tokenizer"``, ``"file"`` or ``"plain"``."""
    choice = parse_chat_template(value)
    if choice == "auto" and getattr(tokenizer, "chat_template", None):
        return "tokenizer"
    if choice in ("auto", "none"):
        if choice == "auto":
            logger.warning(
                "note: the tokenizer (%s) has no chat template; prompts are encoded as plain text "
                "(pass --chat-template FILE to use a template)", getattr(tokenizer, "name_or_path", "?"),
            )
        tokenizer.chat_template = plain_text_template(tokenizer)
        return "plain"
    tokenizer.chat_template = choice
    return "file"


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt, ready for the assistant's turn (the tokenizer's current template)."""
    if not getattr(tokenizer, "chat_template", None):
        apply_chat_template_option(tokenizer, "auto")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def encode_prompt(tokenizer, prompt: dict, device=None) -> torch.Tensor:
    """A ``{"messages": [...]}`` prompt -> input ids [1, L]."""
    return torch.tensor([encode_messages(tokenizer, prompt["messages"])], device=device)


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids [1, L_i] -> (ids [N, max L], attention mask [N, max L]), padded on the left."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[1] :] = row[0]
        mask[i, width - row.shape[1] :] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------- heads


def default_head(name: str = "smollm2-135m-dflash2") -> Path | None:
    """``heads/<name>`` of this repository (a checkout or the working directory), else None (installed)."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "heads" / name / "config.json").is_file():
            return root / "heads" / name
    return None


def check_head_matches_target(folder, target) -> None:
    """A head trained for another target is refused before any work, naming both values."""
    config = json.loads((Path(folder) / "config.json").read_text())
    text = target.config.get_text_config()
    for field, mine in (("hidden_size", text.hidden_size), ("vocab_size", text.vocab_size),
                        ("num_target_layers", text.num_hidden_layers)):
        if field in config and config[field] != mine:
            raise ValueError(f"head {folder} has {field}={config[field]} but the target has {mine}")


def load_head(folder, target):
    """The head at ``folder`` in the target's dtype and on its linear kernel, bound to ``target``."""
    from .cpu.linear_kernels import linear_kernel_of, use_linear_kernel
    from .modeling_dflash2 import DFlash2DraftModel

    drafter = DFlash2DraftModel.from_pretrained(folder, dtype=next(target.parameters()).dtype).eval()
    use_linear_kernel(drafter, linear_kernel_of(target))
    return drafter.bind_target(target)
