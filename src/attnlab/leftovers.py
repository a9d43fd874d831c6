"""What killed processes leave behind, and how to tell whether their owner is gone.

A process that writes something temporary (a data cache folder being built, a checkpoint being saved) or
holds a lock names itself in it: its owner stamp is `<host>:<pid>`. A stamp of this host whose PID no longer
runs is an orphan, removed by the next process that looks; a stamp of another host is never judged from here
(that process may still be running), so it is left alone. Temporary names are `<prefix>@<owner>@<random>`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

log = logging.getLogger("attnlab")


def owner() -> str:
    """This process's stamp: `<host>:<pid>` (the same string names an ablation worker)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_alive(stamp: str | None) -> bool | None:
    """True when the process of `stamp` runs, False when it is of this host and gone, None when unknown (another
    host, or not a stamp). A zombie is gone: it died and holds nothing, its parent has not reaped it yet (a lock
    it held would otherwise wait for its grace period, and every worker behind that lock miss its heartbeats)."""
    host, _, pid = (stamp or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # "<pid> (<name>) <state> ...": the name may hold ")"
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:  # reaped since
        return False
    except (OSError, IndexError):  # no /proc (not Linux)
        return True


def stamped(prefix: str, suffix: str = "") -> str:
    """A temporary name owned by this process: `<prefix>@<host>:<pid>@<random><suffix>`."""
    return f"{prefix}@{owner()}@{uuid.uuid4().hex[:8]}{suffix}"


def stamp_of(name: str) -> str | None:
    parts = name.split("@")
    return parts[-2] if len(parts) >= 3 else None


def remove_orphans(folder: Path, pattern: str) -> list[Path]:
    """Remove the files and folders in `folder` matching `pattern` whose stamped owner is gone; return them."""
    removed = []
    for path in sorted(folder.glob(pattern)) if folder.is_dir() else []:
        if owner_alive(stamp_of(path.name)) is not False:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        log.info("removed %s, left by a process that is gone", path)
        removed.append(path)
    return removed
