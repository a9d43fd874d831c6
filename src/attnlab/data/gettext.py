"""gettext catalogs as a parallel corpus: the compiled `.mo` files every Linux machine ships, English -> <lang>.

`<dir>/<lang>/LC_MESSAGES/*.mo` for each folder of data.locale_dir (Debian's /usr/share/locale, Ubuntu's language
packs in /usr/share/locale-langpack). The .mo format is 7 little- or big-endian uint32s and two string tables,
parsed here. A machine without (enough of) the catalogs gets an error saying where it looked and how to install
them, before anything is trained.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

from .config import DataConfig, DataError

log = logging.getLogger("attnlab.data")


def read_mo(path: Path) -> list[tuple[str, str]]:
    """(English, translation) pairs of one compiled catalog. The "" header entry is skipped, msgctxt prefixes
    (`ctx\\x04msgid`) removed, plural entries give (msgid, form 0) and (msgid_plural, form 1).
    A malformed catalog raises DataError."""
    data = path.read_bytes()
    if len(data) < 28:
        raise DataError(f"{path}: too short for a .mo catalog ({len(data)} bytes)")
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if order is None:
        raise DataError(f"{path}: bad .mo magic number {magic:#010x}")
    revision, n, orig_at, trans_at = struct.unpack(order + "4I", data[4:20])
    if revision >> 16 > 1:
        raise DataError(f"{path}: unsupported .mo major revision {revision >> 16}")
    if max(orig_at, trans_at) + 8 * n > len(data):
        raise DataError(f"{path}: string tables run past the end of the file (truncated?)")
    raw: list[tuple[bytes, bytes]] = []
    for i in range(n):
        olen, ooff = struct.unpack_from(order + "2I", data, orig_at + 8 * i)
        tlen, toff = struct.unpack_from(order + "2I", data, trans_at + 8 * i)
        if ooff + olen > len(data) or toff + tlen > len(data):
            raise DataError(f"{path}: entry {i} points past the end of the file (truncated?)")
        raw.append((data[ooff:ooff + olen], data[toff:toff + tlen]))
    charset = "utf-8"
    for msgid, msgstr in raw:
        if msgid == b"":  # the header entry: "Content-Type: text/plain; charset=UTF-8" and friends
            for line in msgstr.decode("ascii", "replace").splitlines():
                if line.lower().startswith("content-type:") and "charset=" in line:
                    charset = line.split("charset=", 1)[1].strip() or "utf-8"
    pairs: list[tuple[str, str]] = []
    try:
        for msgid, msgstr in raw:
            if msgid == b"":
                continue
            src = msgid.decode(charset)
            src = src.split("\x04", 1)[-1]  # msgctxt "\x04" msgid
            srcs, tgts = src.split("\x00"), msgstr.decode(charset).split("\x00")
            pairs.extend(zip(srcs[:2], tgts[:2], strict=False))  # singular/form 0, plural/form 1
    except (UnicodeDecodeError, LookupError) as e:
        raise DataError(f"{path}: cannot decode as {charset!r}: {e}") from None
    return pairs


def gettext_catalogs(dirs: list[str], lang: str) -> list[Path]:
    """Every <dir>/<lang>/LC_MESSAGES/*.mo of the folders, in the order given (possibly none)."""
    return [f for d in dirs for f in sorted((Path(d) / lang / "LC_MESSAGES").glob("*.mo"))]


def too_few_catalogs(dirs: list[str], lang: str, files: int, pairs: int, need: int) -> DataError:
    """The error of a machine without (enough of) the catalogs: where it looked, what it found, how to install."""
    searched = ", ".join(str(Path(d) / lang / "LC_MESSAGES") for d in dirs)
    pack = {"zh_CN": "zh-hans", "zh_SG": "zh-hans", "zh_TW": "zh-hant", "zh_HK": "zh-hant"}.get(lang)
    pack = pack or lang.split("_")[0]  # Ubuntu's language-pack-<language>
    found = f"{pairs:,} English->{lang} pairs in {files} catalog(s)"
    found += f"; data.min_pairs asks for {need:,}" if need else ""
    return DataError(
        f"gettext:{lang}: {found}. Searched: {searched}. Install the catalogs, then run again:\n"
        f"  Debian: sudo apt-get install iso-codes git gnupg-l10n libc-l10n coreutils  (each package ships its own "
        f"catalogs; slim images delete them: first remove the 'path-exclude /usr/share/locale' lines from the files "
        f"in /etc/dpkg/dpkg.cfg.d/, then add --reinstall)\n"
        f"  Ubuntu: sudo apt-get install language-pack-{pack}  (into /usr/share/locale-langpack)\n"
        f"or set data.locale_dir to folder(s) holding {lang}/LC_MESSAGES/*.mo, or data.corpus to other text"
    )


def gettext_corpus_pairs(cfg: DataConfig, lang: str) -> tuple[list[tuple[str, str]], list[Path]]:
    """The pairs of gettext:<lang> and the catalogs they came from; too few (none, or under data.min_pairs) is an
    error that says where it looked and how to install the catalogs, before any tokenizer or model is trained."""
    files = gettext_catalogs(cfg.locale_dirs, lang)
    pairs = _pairs_of(files, lang)
    if not pairs or len(pairs) < cfg.min_pairs:
        raise too_few_catalogs(cfg.locale_dirs, lang, len(files), len(pairs), cfg.min_pairs)
    return pairs, files


def gettext_pairs(locale_dir: str | list[str], lang: str) -> list[tuple[str, str]]:
    """Every (English, <lang>) pair of the machine's catalogs in the folder(s): deduplicated (first occurrence
    kept), pairs with an empty side or identical sides dropped; unreadable catalogs are skipped with a warning
    naming them."""
    dirs = [locale_dir] if isinstance(locale_dir, str) else list(locale_dir)
    return _pairs_of(gettext_catalogs(dirs, lang), lang)


def _pairs_of(files: list[Path], lang: str) -> list[tuple[str, str]]:
    """The pairs of gettext_pairs, from catalogs already listed."""
    seen: set[tuple[str, str]] = set()
    out: list[tuple[str, str]] = []
    skipped: list[str] = []
    for path in files:
        try:
            pairs = read_mo(path)
        except (DataError, OSError) as e:
            log.warning("skipping broken gettext catalog %s: %s", path, e)
            skipped.append(path.name)
            continue
        for src, tgt in pairs:
            if not src.strip() or not tgt.strip() or src == tgt or (src, tgt) in seen:
                continue
            seen.add((src, tgt))
            out.append((src, tgt))
    if skipped:
        log.warning("gettext:%s: skipped %d broken catalog(s): %s", lang, len(skipped), ", ".join(skipped))
    return out
