"""Equal-compute budgets and the compute a trial spends, by the accounting module (models/accounting.py).

`budget: {flops: X}` gives each variant the steps that spend X training FLOPs, so a wider or gated variant does
not get more compute for the same steps. A step's FLOPs are the training FLOPs per target token times the
target tokens of a step:

- language model: every micro-batch holds max(1, max_tokens // seq_len) windows of seq_len tokens on each
  device, and every token costs flops_per_token at seq_len. Exact, from the config alone.
- translation: lengths vary, so both are measured on the training split (the data is prepared as fit would):
  FLOPs per target token = sum over the pairs of training_flops(T_i, S_i) / sum of T_i (each pair's attention
  at its own lengths, EOS included), and target tokens per step = the split's target tokens / its batches (their
  mean), times devices, nodes and accumulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..experiment import Experiment
from ..models.accounting import flops_per_token, training_flops
from ..train import prepare


@dataclass(frozen=True)
class StepCost:
    flops_per_token: float  # training FLOPs per target token
    tokens_per_step: float  # target tokens of one optimizer step, all devices and micro-batches together

    @property
    def flops_per_step(self) -> float:
        return self.flops_per_token * self.tokens_per_step


def replicas(exp: Experiment) -> int:
    """Micro-batches in one optimizer step: devices x nodes x accumulation (devices -1: the visible GPUs)."""
    devices = exp.trainer.devices if exp.trainer.devices > 0 else max(1, torch.cuda.device_count())
    return devices * exp.trainer.num_nodes * exp.optim.accumulate


def step_cost(exp: Experiment) -> StepCost:
    """The FLOPs per target token and target tokens per step of a trial (see the module docstring)."""
    if exp.task == "lm":
        model = exp.model.replace(vocab_size=exp.data.vocab_size, src_vocab_size=0)  # the tokenizer's size, as fit
        windows = max(1, exp.data.max_tokens // exp.data.seq_len)
        return StepCost(flops_per_token(model, exp.data.seq_len), windows * exp.data.seq_len * replicas(exp))
    dm, resolved = prepare(exp)
    ds = dm.dataset("train")
    tgt, src = ds.tgt.lengths() + 1, ds.src.lengths() + 1  # (N,) each: + EOS, as batches hold them
    pairs, counts = np.unique(np.stack([tgt, src], axis=1), axis=0, return_counts=True)  # distinct (T, S)
    total = sum(float(c) * training_flops(resolved.model, int(t), int(s))["total"]
                for (t, s), c in zip(pairs, counts, strict=True))
    tokens = float(tgt.sum())
    batches = dm.sampler("train", shuffle=False).n_batches
    return StepCost(total / tokens, tokens / batches * replicas(exp))


def budget_steps(flops: float, cost: StepCost) -> int:
    """The whole steps that spend at most `flops` (at least one)."""
    return max(1, math.floor(flops / cost.flops_per_step))


def with_flops_budget(exp: Experiment, flops: float) -> tuple[Experiment, StepCost]:
    """The trial with trainer.max_steps (and the schedule's horizon, optim.max_steps) set to its budget's steps."""
    cost = step_cost(exp)
    steps = budget_steps(flops, cost)
    return exp.replace(trainer=exp.trainer.replace(max_steps=steps), optim=exp.optim.replace(max_steps=steps)), cost
