"""Store charts as 256-colour palette PNGs, to keep the repository small.

    python benchmarks/shrink_pngs.py benchmarks/results/<cpu kind>/some_chart.png [...]

Charts written through `hf_dflash2.charts.save_chart` are palette PNGs already; this rewrites any other. A
file already in palette mode is left alone, and another is rewritten only when the palette
version is smaller, so a second run changes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_dflash2.charts import shrink_png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.paths:
        if path.suffix.lower() != ".png" or not path.is_file():
            parser.error(f"not a PNG file: {path}")
    for path in args.paths:
        before, after = shrink_png(path)
        print(f"{path}: {before:,} -> {after:,} bytes" if after != before else f"{path}: unchanged, {before:,} bytes")


if __name__ == "__main__":
    main()
