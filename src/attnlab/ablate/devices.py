"""The GPUs of one machine shared out among local ablation workers: each worker's CUDA_VISIBLE_DEVICES, and what a
trial records as the devices it ran on."""

from __future__ import annotations

import os

import torch

from ..config import ConfigError
from .spec import AblationSpec


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries: that variable's list when it is set,
    else every device torch sees; [] without CUDA."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def visible_devices_label() -> str:
    """What a trial records as the devices it ran on (user attr cuda_visible_devices)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return env
    return "all" if torch.cuda.is_available() else "cpu"


def gpu_slices(gpus: list[str], workers: int, per_trial: int, workers_per_gpu: int = 1) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of each of `workers` local workers: worker i gets the GPUs of group i // K (K =
    workers_per_gpu), a group being `per_trial` consecutive GPUs of `gpus`; so two workers share GPUs only when
    K > 1. None when there are no GPUs (CPU trials). Too few GPUs is a ConfigError, before anything starts."""
    if not gpus:
        return None
    if workers_per_gpu < 1:
        raise ConfigError(f"--workers-per-gpu {workers_per_gpu} must be >= 1")
    if per_trial < 1:
        raise ConfigError(f"trainer.devices={per_trial}: local workers on GPUs need a device count per trial "
                          "(resources.devices in the ablation file), not -1")
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"--gpus {','.join(gpus)}: a GPU is listed twice")
    groups = -(-workers // workers_per_gpu)  # ceil
    if groups * per_trial > len(gpus):
        raise ConfigError(
            f"--workers {workers} with {per_trial} GPU(s) per trial and --workers-per-gpu {workers_per_gpu} need "
            f"{groups * per_trial} GPUs; {len(gpus)} are given ({','.join(gpus)}): lower --workers or raise "
            "--workers-per-gpu")
    return [",".join(gpus[(i // workers_per_gpu) * per_trial:(i // workers_per_gpu + 1) * per_trial])
            for i in range(workers)]


def default_workers(gpus: list[str], per_trial: int, workers_per_gpu: int = 1) -> int:
    """Local workers when --workers is not given: every GPU slice packed, `workers_per_gpu` workers on each group
    of `per_trial` GPUs (8 GPUs, 1 a trial, 4 a GPU: 32); 1 without GPUs (CPU trials) or with trials of -1 devices."""
    if not gpus or per_trial < 1:
        return 1
    return max(1, len(gpus) // per_trial) * max(1, workers_per_gpu)


def trial_devices(spec: AblationSpec) -> int:
    """Devices per trial (resources.devices, else the base recipe's trainer.devices); one size for all trials."""
    if "trainer.devices" in spec.varied_keys():
        raise ConfigError(f"{spec.path}: trainer.devices varies across trials; a local worker's GPUs are one slice "
                          "(run one study per device count)")
    return spec.experiment({}).trainer.devices
