"""A trial's stored hypotheses and references: the files ablate/final.py writes, one segment a line, read as
sacreBLEU's command line reads them."""

from __future__ import annotations

from pathlib import Path


def read_lines(path: Path) -> list[str]:
    """A .hyp / .ref file's segments, read as sacreBLEU's command line reads them."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip() for line in f]
