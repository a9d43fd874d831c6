"""Writing a fit's checkpoints: Lightning's CheckpointIO and ModelCheckpoint as attnlab runs them.

- `AtomicCheckpointIO`: every file through `checkpoints.save_atomic` (a kill leaves the previous file whole),
  stamped with this code's layout; a resume reads the file migrated to it. With `background=True` the save takes a
  point-in-time copy of the state's tensors in host memory, in the training thread (`host_snapshot`: one
  device-to-host copy into pinned buffers and one wait), and a thread writes the file while training goes on:
  pickling, fsync and rename, which with the copy were about 1.3 s for the base model's 580 MB of weights and AdamW
  moments, 1 step in 8 of the 5-minute base run's wall clock at a checkpoint every 10 s. The writer thread makes no
  CUDA call: one made while the training thread captures a CUDA graph (validation's beam step, decode.cuda_graph)
  fails that capture. An earlier version copied on the device and let the thread move the copy to the host; the
  H100 fit of 2026-11-26 (bench/results/h100_2026-11-26c_*) died at its first validation of it. One write is in
  flight at a time: a save waits for the one before. An error in the thread (a full disk) is raised at the next
  save or when the fit ends, and again by any save after it (the exception checkpoint that follows), which writes
  nothing: the first error is the one the fit stops with.
- `after_writes(trainer, fn)`: fn once every save queued before it is on disk (at once in the foreground). What
  reads a checkpoint just saved goes through it: last.ckpt copied from the step checkpoint, the best window's
  links (best_window.py).
- `StepCheckpoint`: Lightning's ModelCheckpoint, where last.ckpt at a step whose step=N.ckpt was just written is a
  copy of that file (`copy_checkpoint`) instead of a second serialization of the same state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from weakref import proxy

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from .checkpoints import FORMAT, migrate, save_atomic
from .files import copy_atomic


class AtomicCheckpointIO(TorchCheckpointIO):
    """A Trainer's checkpoint files: every save goes through `save_atomic`, stamped with this code's layout, in the
    calling thread or (background=True) in a writer thread from a snapshot (see the module docstring); a resume
    reads the file migrated to it (`migrate`)."""

    def __init__(self, background: bool = False) -> None:
        super().__init__()
        self.background = background
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._failed: BaseException | None = None  # the first write that failed: raised again by every later save
        self._lock = threading.Lock()

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        stamped = {**checkpoint, "attnlab_format": FORMAT}
        if not self.background:
            save_atomic(stamped, path)
            return
        self.wait()  # one write in flight: the snapshot held besides the live state is one, and errors surface here
        if self._failed is not None:  # the exception checkpoint after that error: the first error, not a second
            raise self._failed  # write into the same full disk whose error would replace it at the end of the fit
        snapshot = host_snapshot(stamped)  # the optimizer steps on while the thread writes
        self.after(lambda: save_atomic(snapshot, path))

    def after(self, fn: Callable[[], Any]) -> None:
        """fn after every write queued before it (at once in the foreground)."""
        if not self.background:
            fn()
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnlab-checkpoint")
            self._pending.append(self._pool.submit(fn))

    def wait(self) -> None:
        """Block until every queued write is done; the first error among them is raised (the files it left are
        those save_atomic leaves: the previous checkpoint whole)."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors = [e for e in (f.exception() for f in pending) if e is not None]
        if errors:
            self._failed = self._failed or errors[0]
            raise errors[0]

    def load_checkpoint(self, path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait()  # a file being written is read whole
        return migrate(super().load_checkpoint(path, *args, **kwargs))

    def remove_checkpoint(self, path) -> None:
        self.after(lambda: super(AtomicCheckpointIO, self).remove_checkpoint(path))  # never before its own write

    def teardown(self) -> None:
        """The end of fit (Lightning calls it, also after an exception): every write finished."""
        try:
            self.wait()
        finally:
            with self._lock:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)


def host_snapshot(state: Any) -> Any:
    """A point-in-time copy of every tensor in `state` in host memory (containers rebuilt), made in the calling
    thread so that whoever pickles it needs no device: CUDA tensors go into pinned buffers (PyTorch's caching host
    allocator reuses them from one checkpoint to the next) without a wait each, then one wait per device."""
    devices: set[torch.device] = set()

    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        out.copy_(t, non_blocking=t.is_cuda)
        devices.add(t.device)
        return out

    snapshot = apply_to_collection(state, torch.Tensor, copy)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the non-blocking copies have landed before the thread reads them
    return snapshot


def after_writes(trainer, fn: Callable[[], Any]) -> None:
    """fn once the checkpoints the trainer has queued are written (at once where it writes in the foreground)."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    if isinstance(io, AtomicCheckpointIO):
        io.after(fn)
    else:
        fn()


def wait_for_writes(trainer) -> None:
    """Every checkpoint the trainer queued is on disk (errors raised)."""
    io = trainer.strategy.checkpoint_io
    if isinstance(io, AtomicCheckpointIO):
        io.wait()


def copy_checkpoint(trainer, src: str | Path, dst: str | Path) -> bool:
    """`dst` made, by rank 0, a copy of the checkpoint file `src` just saved with the same state (files.copy_atomic),
    instead of serializing that state again (the GPU-to-host copies, pickling, writing: about twice the time of the
    copy); False, with nothing done, where `src` is not a file (a sharded checkpoint folder). Collective, like
    trainer.save_checkpoint: every rank calls it at the same point and takes the branch rank 0 takes. Where the
    checkpoints are written in the background the copy is queued behind src's write."""
    io = trainer.strategy.checkpoint_io
    queued = isinstance(io, AtomicCheckpointIO) and io.background  # src is being written by AtomicCheckpointIO
    if not trainer.strategy.broadcast((queued or Path(src).is_file()) if trainer.is_global_zero else False, src=0):
        return False
    if trainer.is_global_zero:
        after_writes(trainer, lambda: copy_atomic(src, dst, f"checkpoint {Path(dst).name}"))
    trainer.strategy.barrier("copy_checkpoint")
    return True


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, where last.ckpt at a step whose step=N.ckpt was just written is a copy of that
    file (copy_checkpoint) instead of a second serialization of the same state. Still two files: a damaged
    last.ckpt leaves the step checkpoint to resume from."""

    @property
    def state_key(self) -> str:
        """ModelCheckpoint's own key, so that a run saved before this class resumes with its checkpoint state."""
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def _save_topk_checkpoint(self, trainer, monitor_candidates) -> None:
        # last.ckpt's path is part of the saved state (Lightning sets it just before writing last.ckpt): set it
        # before the step checkpoint is written, so that both files hold the same state
        if self.save_last and not self.last_model_path:
            self.last_model_path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        src = self._last_checkpoint_saved
        if filepath == self.last_model_path and src and src != filepath \
                and self._last_global_step_saved == trainer.global_step and copy_checkpoint(trainer, src, filepath):
            self._last_checkpoint_saved = filepath
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(proxy(self))
            return
        super()._save_checkpoint(trainer, filepath)
