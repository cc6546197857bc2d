"""A figure written to a command's ``--plot`` file: its format from the file's suffix
(``.png``, ``.svg``, ``.pdf``, as matplotlib takes them), checked before any work, and
the file written whole (:func:`fp8ray.io.paths.write_output`)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from ..errors import DestinationError
from ..io.paths import write_output


def plot_format(path: str | os.PathLike) -> str:
    """The format of a plot written to ``path``, from its suffix (none: PNG); a suffix
    matplotlib cannot write is refused, naming the ones it can. Called before the work,
    so that a bad name does not throw a long run's results away."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix[1:].lower()
    supported = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in supported:
        raise DestinationError(f"plot {path}: matplotlib writes no .{suffix} files; name one of .{', .'.join(sorted(supported))}")
    return suffix or "png"


def save_figure(fig, path: str | os.PathLike, **savefig) -> None:
    """Render ``fig`` in the format of ``path``'s suffix and write it there, whole."""
    image = io.BytesIO()
    fig.savefig(image, format=plot_format(path), **savefig)
    write_output(str(path), image.getvalue())
