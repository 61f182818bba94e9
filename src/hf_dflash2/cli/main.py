"""The ``hf-dflash2`` command: regenerate, store, train, average, distill, bench, demo, card, push.

Each subcommand lives in its own module, which adds its parser with ``register(subparsers)``; its flags are
generated from its settings dataclasses (``settings.add_arguments``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..evaluation import bench
from ..training import commands as training_commands
from ..training import distill
from . import demo, push

logger = logging.getLogger("hf_dflash2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dflash2", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (training_commands, distill, bench, demo, push):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
