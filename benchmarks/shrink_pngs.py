"""Store charts as 256-colour palette PNGs, to keep the tracked tree under the 64 MiB a device call carries.

    python benchmarks/shrink_pngs.py benchmarks/results/some_chart.png [...]

Matplotlib writes RGBA; a chart has a few dozen colours, so a palette PNG shows the same picture at about a
third of the size. A file already in palette mode is left alone, and another is rewritten only when the
palette version is smaller, so a second run changes nothing.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from PIL import Image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.paths:
        if path.suffix.lower() != ".png" or not path.is_file():
            parser.error(f"not a PNG file: {path}")
    for path in args.paths:
        before = path.stat().st_size
        with Image.open(path) as image:
            if image.mode == "P":
                print(f"{path}: already a palette PNG, {before:,} bytes")
                continue
            palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        buffer = io.BytesIO()
        palette.save(buffer, format="PNG", optimize=True)
        if buffer.tell() < before:
            path.write_bytes(buffer.getvalue())
        print(f"{path}: {before:,} -> {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
