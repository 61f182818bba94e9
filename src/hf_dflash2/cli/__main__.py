"""``python -m hf_dflash2.cli``: the ``hf-dflash2`` command."""

import sys

from .main import main

sys.exit(main())
