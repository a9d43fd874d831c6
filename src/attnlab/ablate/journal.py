"""The study journal file, whose appends are whole or absent.

optuna's JournalFileBackend appends a batch of JSON records with one buffered write. When the disk fills (or the
quota runs out) halfway, the part that fitted stays: a record without its newline at the end of the file. Readers
skip it while it is last, but the next append lands on the same line, and from then on every read of the study
fails ("Invalid log format", or a JSON error) until someone edits the file by hand: the study is lost to a full
disk. `WholeJournalFile` appends under the same lock with plain writes and, when any of them (or the fsync) fails,
cuts the file back to where this append began, then raises files.DiskFull naming the folder and the bytes the
records need. It also cuts a torn record that a writer killed mid-append left at the end (a writer holds the lock
while it writes, so under the lock no one is still writing it) before appending after it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from optuna.storages.journal import JournalFileBackend

from ..files import append_or_cut_back, disk_full, disk_full_cause
from . import faults

log = logging.getLogger("attnlab.ablate")


def cut_torn_tail(fd: int, path: Path) -> int:
    """Truncate a record left without its newline at the end of the file; returns the file's length."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end, chunk = size, 65536
    while end > 0:
        start = max(0, end - chunk)
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            end = start + at + 1
            break
        end = start
    os.ftruncate(fd, end)
    log.warning("%s ended in a record cut short (%d bytes, by a writer killed mid-append): removed", path, size - end)
    return end


class WholeJournalFile(JournalFileBackend):
    """optuna's journal file backend with appends that are whole or absent (see the module docstring)."""

    def __init__(self, file_path: str, lock_obj: Any) -> None:  # a lock with acquire() and release(): OwnedLock
        super().__init__(file_path, lock_obj=lock_obj)
        self.path, self.lock = Path(file_path), lock_obj

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = ("\n".join(json.dumps(r, separators=(",", ":")) for r in logs) + "\n").encode("utf-8")
        try:
            self.lock.acquire()  # its lock file names its holder: on a full disk that write fails too
        except OSError as e:
            raise self.full(e, len(logs), len(data)) from e
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = cut_torn_tail(fd, self.path)
                faults.reached("journal_write", lambda: os.write(fd, data[: len(data) // 2]))  # tests only
                try:
                    append_or_cut_back(fd, data, start, fsync=True)  # every record before this append stays, whole
                except BaseException as e:
                    raise self.full(e, len(logs), len(data)) from e
            finally:
                os.close(fd)
        finally:
            self.lock.release()

    def full(self, e: BaseException, records: int, needed: int) -> BaseException:
        """The error to raise: files.DiskFull when e is a full disk, else e itself."""
        cause = disk_full_cause(e)
        if cause is None:
            return e
        return disk_full(self.path.parent, f"{records} record(s) to the study journal {self.path.name}", needed, cause,
                         "The journal holds every record written before it, whole; the worker stops with this error, "
                         "and a trial it ran is taken up again by the next worker once there is space.")
