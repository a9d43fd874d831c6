"""AdamW parameter groups and learning-rate schedules. No Lightning here, so everything is testable on its own;
the LightningModules call these (the training loss is in loss.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..config import OptimConfig


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two groups: decayed matrices, and (unless asked otherwise) undecayed norms, biases and embeddings."""
    if cfg.weight_decay == 0 or cfg.decay_norms_biases_embeddings:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": cfg.weight_decay}]
    no_decay: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding) or p.dim() < 2 or name == "bias":
                no_decay.add(id(p))  # norms' gains and every bias are 1-D; embeddings are lookups
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if id(p) not in no_decay], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
    ]


def scale_grads_(grads: list[torch.Tensor], scale: torch.Tensor, norm: bool = True) -> torch.Tensor | None:
    """Multiply every gradient by the 0-d tensor `scale` in place and return the global L2 norm of the result
    (fp32; None with norm=False, a step that logs none): two multi-tensor (foreach) kernels and a stack for any
    number of tensors, not two kernels per tensor, and no host sync."""
    torch._foreach_mul_(grads, scale)  # public equivalent: none; torch.optim's own foreach paths use these
    if not norm:
        return None
    norms = torch._foreach_norm(grads)  # one norm per tensor, fp32 accumulation inside the kernel
    return torch.linalg.vector_norm(torch.stack(norms).float())  # (,)


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019); with weight_decay 0 it is the paper's Adam. Fused (one kernel for every
    parameter, step counts kept on the device: no host sync) on CUDA and on a CPU."""
    fused = all(p.device.type in ("cuda", "cpu") for p in model.parameters())
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


def lr_factor(cfg: OptimConfig, d_model: int) -> Callable[[int], float]:
    """Multiplier of `cfg.lr` at optimizer step `step` (0-based; the first update uses step 0)."""
    w, horizon = cfg.warmup_steps, cfg.max_steps

    def warm(s: int) -> float:
        return min(1.0, s / w) if w else 1.0

    def noam(step: int) -> float:  # Vaswani et al. 2017, eq. (3): d^-0.5 * min(s^-0.5, s * w^-1.5)
        s = step + 1
        return d_model**-0.5 * min(s**-0.5, s * w**-1.5)

    def inverse_sqrt(step: int) -> float:  # fairseq: linear warmup to lr, then lr * sqrt(w / s)
        s = step + 1
        return warm(s) if s < w else math.sqrt(max(w, 1) / s)

    def cosine(step: int) -> float:  # linear warmup, then half a cosine down to min_lr_ratio at max_steps
        s = step + 1
        if s < w:
            return warm(s)
        progress = min(1.0, (s - w) / max(1, horizon - w))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def wsd(step: int) -> float:  # warmup-stable-decay (Hu et al. 2024, MiniCPM): linear decay at the end
        s = step + 1
        decay_start = horizon * (1 - cfg.decay_fraction)
        if s < w:
            return warm(s)
        if s <= decay_start:
            return 1.0
        progress = min(1.0, (s - decay_start) / max(1.0, horizon - decay_start))
        return 1.0 - (1 - cfg.min_lr_ratio) * progress

    def constant(step: int) -> float:
        return warm(step + 1)

    return {"noam": noam, "inverse_sqrt": inverse_sqrt, "cosine": cosine, "wsd": wsd, "constant": constant}[
        cfg.schedule
    ]


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, d_model: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, d_model))
