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
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..experiment import Experiment
from ..models.accounting import count_parameters, flops_per_token, training_flops
from ..train import prepare

if TYPE_CHECKING:
    from .spec import AblationSpec

NO_HORIZON = ("noam", "inverse_sqrt")  # decay as 1/sqrt(step) whatever the budget


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


def with_flops_budget(exp: Experiment, flops: float, horizon: bool = True, cost: StepCost | None = None
                      ) -> tuple[Experiment, StepCost]:
    """The trial with trainer.max_steps set to its budget's steps, and the schedule's horizon (optim.max_steps)
    too unless the file sets it (`horizon` False), as a steps budget does (AblationSpec.trial_overrides)."""
    cost = cost or step_cost(exp)
    steps = budget_steps(flops, cost)
    optim = exp.optim.replace(max_steps=steps) if horizon else exp.optim
    return exp.replace(trainer=exp.trainer.replace(max_steps=steps), optim=optim), cost


def scale_flops(exp: Experiment, budget: dict[str, float], cost: StepCost) -> float:
    """The training FLOPs a size's budget gives it (`scale: {budget: ...}`): fixed FLOPs, FLOPs per parameter,
    fixed tokens, or tokens per parameter (Hoffmann et al. 2022 found about 20 compute-optimal), tokens times the
    trial's FLOPs per token. Parameters: every one, embeddings included (the model of the trial, its vocabulary
    the tokenizer's)."""
    (key, value), = budget.items()
    if key == "flops":
        return value
    model = exp.model.replace(vocab_size=exp.data.vocab_size, src_vocab_size=0) if exp.task == "lm" else \
        prepare(exp)[1].model
    n = count_parameters(model)["total"]
    if key == "flops_per_param":
        return value * n
    tokens = value if key == "tokens" else value * n
    return tokens * cost.flops_per_token


def warmup_warning(where: str, steps: int, warmup: int, what: str) -> str:
    return (f"{where}: {what}={steps} ends inside the warmup (optim.warmup_steps={warmup}): every trial stops "
            f"before its learning rate peaks, so variants are compared on their warmup. Fix: set optim.warmup_steps "
            f"under overrides: well below the budget (a tenth of it, {max(1, steps // 10)}, is common), or raise "
            f"the budget")


def budget_warnings(spec: AblationSpec) -> list[str]:
    """What makes a study's budget mean less than it says, for the start of `ablate run` and `submit`: a steps
    budget that ends inside the warmup (a FLOPs budget is checked per trial, once its steps are known), and a
    schedule that ignores the budget's horizon. One warning per problem, naming the variants it concerns when
    not all of them."""
    if spec.budget_steps is None and spec.budget_flops is None and spec.budget_time_min is None and \
            not spec.scale_budget:
        return []
    found: dict[str, list[str]] = {}
    variants = spec.variants() or [None]  # a search: its base
    for v in variants:
        o = spec.experiment(v.overrides if v else {}).optim
        if spec.budget_steps is not None and o.warmup_steps >= spec.budget_steps:
            found.setdefault(warmup_warning(str(spec.path), spec.budget_steps, o.warmup_steps, "budget.steps"),
                             []).append(v.name if v else "")
        if o.schedule in NO_HORIZON:
            found.setdefault(
                f"{spec.path}: optim.schedule={o.schedule} ignores the budget's horizon: its rate decays as "
                "1/sqrt(step) whatever the budget, so every trial stops mid-schedule and variants are compared "
                "before they anneal. Fix: overrides: {optim.schedule: cosine} (or wsd), which decays to the end of "
                "the budget (optim.max_steps), with optim.lr its peak rate", []).append(v.name if v else "")
    return [msg if len(names) == len(variants) else f"{msg} (variants: {', '.join(names)})"
            for msg, names in found.items()]
