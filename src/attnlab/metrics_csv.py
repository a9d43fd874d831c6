"""<run>/logs/metrics.csv with whole rows on a full disk: Lightning's CSVLogger, whose writer appends each flush's
rows and, when a column first appears (val/loss at the first validation), rewrites the file in place, truncated
first, so that a full disk at that moment loses every row before. Here an append that does not fit is cut back to
the rows before it, and the rewrite goes through files.write_atomic; either way a full disk raises files.DiskFull
naming metrics.csv, and the file keeps every row it had (`run_metrics` reads it, a resume moves it aside)."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from .files import append_or_cut_back, disk_full, disk_full_cause, write_atomic

KEPT = "metrics.csv holds every row written before, whole; the fit stops with this error."


class WholeRowsWriter(ExperimentWriter):
    """Lightning's CSV experiment writer with whole-or-absent flushes (see the module docstring)."""

    def save(self) -> None:
        if not self.metrics:
            return
        path, keys = Path(self.metrics_file_path), list(self.metrics_keys)
        exists = path.is_file()
        try:
            if self._record_new_keys() and exists:  # a new column: the whole file again, with the new header
                with open(path, newline="", encoding="utf-8") as f:
                    rows = list(csv.DictReader(f))
                data = self.rows(rows + self.metrics, header=True)
                write_atomic(path, lambda f: f.write(data), lambda: len(data), path.name)
            else:
                append_whole(path, self.rows(self.metrics, header=not exists))
        except BaseException:
            self.metrics_keys = keys  # the header on disk is still the old one
            raise
        self.metrics = []

    def rows(self, rows: list[dict], header: bool) -> bytes:
        """The CSV text of `rows` under the writer's columns, as Lightning's DictWriter writes it."""
        out = io.StringIO(newline="")
        writer = csv.DictWriter(out, fieldnames=self.metrics_keys)
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().encode("utf-8")


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` whole, or leave the file as it was (a file this call created is removed)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start = os.fstat(fd).st_size
    try:
        append_or_cut_back(fd, data, start)
    except BaseException as e:
        os.close(fd)
        if start == 0:
            path.unlink(missing_ok=True)
        cause = disk_full_cause(e)
        if cause is None:
            raise
        raise disk_full(path.parent, path.name, len(data), cause, KEPT) from e
    os.close(fd)


class WholeRowsCSVLogger(CSVLogger):
    """CSVLogger whose metrics.csv is written by WholeRowsWriter."""

    @property
    @rank_zero_experiment
    def experiment(self) -> WholeRowsWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = WholeRowsWriter(log_dir=self.log_dir)
        return self._experiment
