"""Charts written as 256-colour palette PNGs.

Matplotlib writes RGBA; a chart has a few dozen colours, so a palette PNG shows the same picture in a
fraction of the size. Every chart the benchmarks commit goes through here, to keep the repository small.
"""

from __future__ import annotations

import io
import os
from pathlib import Path


def charts_available() -> bool:
    """Whether matplotlib (the ``plots`` extra) is installed, so that a long run can say so before it starts."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def palette_png_bytes(image) -> bytes:
    """The PNG bytes of a PIL ``image`` quantised to a 256-colour palette."""
    from PIL import Image

    palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _write_atomically(path: Path, data: bytes) -> None:
    # A chart is often rewritten in place next to committed results; a kill mid-write must not leave half a file.
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def shrink_png(path: str | Path) -> tuple[int, int]:
    """Rewrite the PNG at ``path`` as a palette PNG when that is smaller; (bytes before, bytes after).

    A file already in palette mode is left alone, so a second call changes nothing."""
    from PIL import Image

    path = Path(path)
    before = path.stat().st_size
    with Image.open(path) as image:
        if image.mode == "P":
            return before, before
        data = palette_png_bytes(image)
    if len(data) < before:
        _write_atomically(path, data)
    return before, path.stat().st_size


def save_chart(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save a matplotlib ``fig`` to ``path`` as a palette PNG (the figure is left open)."""
    from PIL import Image

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"charts are saved as PNG; got the path {str(path)!r}")
    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=dpi)
    rendered.seek(0)
    with Image.open(rendered) as image:
        data = palette_png_bytes(image)
    _write_atomically(path, data)
    return path
