"""The ``hf-dflash2`` command (``main``) and the subcommands that live nowhere else.

``main.py`` builds the parser from every subcommand's ``register(subparsers)``: regenerate, store and train
(``training.commands``), average (``training.average``), distill (``training.distill``), bench
(``evaluation.bench``), demo (``demo.py``), card and push (``push.py``). ``python -m hf_dflash2.cli`` runs it too.

Every ``--flag`` is generated from a settings dataclass beside its command (``settings.add_arguments``), so each
default, help text and value check is stated once; ``tests/test_cli.py`` walks the built parser to keep it so.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
