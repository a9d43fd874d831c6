"""Corpus files read line by line, strict UTF-8, with file:line in every error: line-aligned pairs, TSV, JSON
lines (pairs or documents), plain-text documents. Every bad input raises `DataError` naming file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import DataError


# ---------------------------------------------------------------------------------------------
# Line readers: strict UTF-8 with file:line in every error
# ---------------------------------------------------------------------------------------------
def need_file(path: Path) -> Path:
    if not path.is_file():
        raise DataError(f"corpus file not found: {path}")
    return path


def count_lines(path: Path) -> int:
    """Lines in a file, counting a last line without a newline; reads 1 MiB blocks (fast, flat memory)."""
    n, last = 0, b"\n"
    with open(need_file(path), "rb") as f:
        while block := f.read(1 << 20):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its line terminator); invalid UTF-8 is a DataError naming file:line. A UTF-8
    byte order mark at the start of the file (as Windows editors write) is not text: it is dropped."""
    with open(need_file(path), "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{i}: invalid UTF-8 at byte {e.start}: {raw[max(0, e.start - 20):e.end + 20]!r}"
                                ) from None
            yield i, line.rstrip("\r\n")


def read_aligned(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    """Line-aligned parallel files (train.en / train.de): line i of one translates line i of the other."""
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)  # checked before anything is read or trained
    if n_src != n_tgt:
        raise DataError(f"parallel files differ in length: {src_path} has {n_src} lines, {tgt_path} has {n_tgt}")
    for (_, s), (_, t) in zip(read_lines(src_path), read_lines(tgt_path), strict=True):
        yield s, t


def read_tsv(path: Path) -> Iterator[tuple[str, str]]:
    """`source<TAB>target` per line; empty lines are skipped, any other line needs exactly one tab."""
    for i, line in read_lines(path):
        if not line:
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            what = "no tab" if len(parts) == 1 else f"{len(parts)} tab-separated fields"
            raise DataError(f"{path}:{i}: expected 'source<TAB>target', found {what}: {line[:80]!r}")
        yield parts[0], parts[1]


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    for i, line in read_lines(path):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None


def pair_from_record(rec: Any, src_lang: str, tgt_lang: str, where: str) -> tuple[str, str]:
    """{"translation": {src_lang: .., tgt_lang: ..}} (Hugging Face WMT schema) or {"src": .., "tgt": ..}."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "translation" in rec:
        tr = rec["translation"]
        if not isinstance(tr, dict):
            raise DataError(f"{where}: 'translation' must be an object with {src_lang!r} and {tgt_lang!r} keys")
        for lang in (src_lang, tgt_lang):
            if lang not in tr:
                raise DataError(f"{where}: 'translation' has no key {lang!r} (keys: {sorted(tr)})")
        src, tgt = tr[src_lang], tr[tgt_lang]
    elif "src" in rec or "tgt" in rec:
        for key in ("src", "tgt"):
            if key not in rec:
                raise DataError(f"{where}: record has no key {key!r}")
        src, tgt = rec["src"], rec["tgt"]
    else:
        raise DataError(f"{where}: expected key 'translation' ({{{src_lang!r}: .., {tgt_lang!r}: ..}}) "
                        f"or keys 'src' and 'tgt'; found {sorted(rec)}")
    if not isinstance(src, str) or not isinstance(tgt, str):
        raise DataError(f"{where}: source and target must be strings, got {type(src).__name__}, "
                        f"{type(tgt).__name__}")
    return src, tgt


def read_jsonl_pairs(path: Path, src_lang: str, tgt_lang: str) -> Iterator[tuple[str, str]]:
    for i, rec in _json_lines(path):
        yield pair_from_record(rec, src_lang, tgt_lang, f"{path}:{i}")


def read_jsonl_docs(path: Path, key: str) -> Iterator[str]:
    for i, rec in _json_lines(path):
        if not isinstance(rec, dict) or key not in rec:
            raise DataError(f"{path}:{i}: record has no key {key!r} (set data.text_field)")
        if not isinstance(rec[key], str):
            raise DataError(f"{path}:{i}: {key!r} must be a string, got {type(rec[key]).__name__}")
        yield rec[key]


def read_text_docs(path: Path) -> Iterator[str]:
    """Plain text for LM: documents are separated by one or more blank lines; a document's lines keep their
    newlines. A file with one document per line therefore needs blank lines between them (or use JSONL)."""
    lines: list[str] = []
    for _, line in read_lines(path):
        if line.strip():
            lines.append(line)
        elif lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)
