"""Files written whole, and a full disk said as what it is.

`write_atomic` writes to a temporary file beside the target (named by its owner, `leftovers.stamped`), fsyncs it
and renames it over the target: a reader sees the old file or the new one, never half of one, and a write that
fails or is killed leaves the old file as it was. When the failure is a full disk (ENOSPC, or EDQUOT: over a
quota, as on most shared clusters) it raises `DiskFull`, whose message names the folder, the bytes the file
needs and the bytes free there, and says that the old file is unchanged, instead of the stream writer's error
(torch.save reports ENOSPC as "unexpected pos 704 vs 598").
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .leftovers import remove_orphans, stamped

FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """A write that found no space left; str() names the folder, the bytes needed and those free."""

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full_cause(e: BaseException | None) -> OSError | None:
    """The ENOSPC / EDQUOT OSError in an exception or the chain it was raised from, or None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL:
            return e
        e = e.__cause__ or e.__context__
    return None


def size_text(n: int) -> str:
    return f"{n:,} bytes" + (f" ({n / 2**20:.1f} MiB)" if n >= 2**20 else "")


def disk_full(folder: Path, what: str, needed: int, cause: OSError, kept: str) -> DiskFull:
    """The DiskFull to raise for `what` (a file of `needed` bytes) that did not fit in `folder`."""
    try:
        free: str = size_text(shutil.disk_usage(folder).free)
    except OSError:
        free = "an unknown number of bytes"
    reason = "over quota" if cause.errno == errno.EDQUOT else "no space left"
    return DiskFull(cause.errno, f"{reason} in {folder} to write {what}: it needs {size_text(needed)}, {free} "
                                 f"free there. {kept}")


def append_or_cut_back(fd: int, data: bytes, start: int, fsync: bool = False) -> None:
    """Write `data` at the end of the open file `fd` whole (and with `fsync`, durably), or cut the file back to
    `start`, its length before, and raise what stopped it: an append that is whole or absent."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]  # a short write on a full disk; the next one raises
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, start)
        raise


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object], size: Callable[[], int],
                 what: str | None = None) -> None:
    """Write `path` whole (see the module docstring): `write(f)` fills the temporary file; `size()` says how many
    bytes the file needs, asked only when the disk was full."""
    write_group([(Path(path), write, size)], what)


def write_group(files: list[tuple[Path, Callable[[BinaryIO], object], Callable[[], int]]],
                what: str | None = None) -> None:
    """Several files of one folder written whole and together: every one to its temporary file first, then all
    renamed into place, so a full disk midway leaves every previous file as it was (a set that belongs together,
    such as an evaluation's outputs and its scores, is never half old and half new)."""
    done: list[tuple[Path, Path]] = []
    existed = [path.exists() for path, _, _ in files]
    try:
        for path, write, _ in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_orphans(path.parent, ".*@*@*.tmp")
            tmp = path.with_name(stamped(f".{path.name}", ".tmp"))
            done.append((tmp, path))
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        for tmp, path in done:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, _ in done:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        cause = disk_full_cause(e)
        if cause is None:
            raise
        names = ", ".join(path.name for path, _, _ in files)
        if all(existed):
            kept = f"The previous {names} {'is' if len(files) == 1 else 'are'} unchanged."
        else:
            kept = f"{'No' if not any(existed) else 'No new'} {names} {'was' if len(files) == 1 else 'were'} written."
        needed = sum(size() for _, _, size in files)
        raise disk_full(files[0][0].parent, what or names, needed, cause, kept) from e


def copy_atomic(src: str | Path, path: str | Path, what: str | None = None) -> None:
    """`path` written whole (write_atomic) as a copy of the file `src`, copied by the kernel (sendfile): no byte
    passes through Python. Two files, not two names of one: damage to either leaves the other whole."""
    size = os.path.getsize(src)

    def write(f: BinaryIO) -> None:
        with open(src, "rb") as s:
            f.flush()
            done = 0
            try:
                while done < size and (n := os.sendfile(f.fileno(), s.fileno(), done, size - done)):
                    done += n
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or done:
                    raise
                shutil.copyfileobj(s, f, 2**24)  # no sendfile between these files: through Python, 16 MiB a read
                done = f.tell()
            if done != size:  # the source changed under the copy: no half file in place of `path`
                raise OSError(errno.EIO, f"copying {src}: {done:,} of its {size:,} bytes read")

    write_atomic(path, write, lambda: size, what)


def write_text_atomic(path: str | Path, text: str) -> None:
    """A text file (UTF-8) written whole; DiskFull when it does not fit."""
    write_texts_atomic({Path(path): text})


def write_texts_atomic(texts: dict[Path, str]) -> None:
    """Text files (UTF-8) of one folder written whole and together (write_group)."""
    data = [(path, text.encode("utf-8")) for path, text in texts.items()]
    write_group([(path, lambda f, b=b: f.write(b), lambda b=b: len(b)) for path, b in data])
