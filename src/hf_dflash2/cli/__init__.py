"""The ``hf-dflash2`` command (``main``) and the subcommands that live nowhere else.

``main.py`` builds the parser from every subcommand's ``register(subparsers)``: regenerate, store, train and
export (``training.commands``), distill (``training.distill``), bench (``evaluation.bench``), demo
(``demo.py``), card and push (``push.py``). ``python -m hf_dflash2.cli`` runs it too.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
