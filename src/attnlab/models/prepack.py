"""oneDNN's prepacked matrix multiply for the linear layers of a model that decodes on a CPU.

`F.linear` on a CPU calls the BLAS torch was built with (MKL in the PyPI wheels), which packs its operands anew at
every call; on this project's AMD EPYC it ran a decoding step's GEMMs at 75-98 GFLOP/s on one core, oneDNN with the
weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what TorchInductor's CPU
freezing pass does for inference) at 95-227, with the same sums to 1e-4 (another order of the same fp32 adds):
`bench/cpu_linear.py`, bench/results/cpu_linear_2026-11-26.json. A search packs the weights once, runs every
nn.Linear (and the head tied to the embedding) through `torch.ops.mkldnn._linear_pointwise` where a call is large
enough to gain (`MIN_MACS`), and puts them back after.

It applies only where it is the same computation: fp32 weights on a CPU, no autograd, no CPU autocast, a torch
built with oneDNN. Elsewhere (CUDA, bf16, a training step) `prepacked_linears` does nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_LOCK = threading.Lock()  # searches on several threads (translate_lines' workers) pack and unpack one model once
_STATE = "_attnlab_prepacked"  # on the model while packed: [how many searches use it, the linears, the tied head]


def _has_ops() -> bool:
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def applies(model: nn.Module) -> bool:
    """Whether packing gives `model`'s own computation here: fp32 weights on a CPU, no grad, no CPU autocast."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or not torch.backends.mkldnn.is_available():
        return False
    params = list(model.parameters())
    return bool(params) and _has_ops() and all(
        p.device.type == "cpu" and p.dtype == torch.float32 and type(p.detach()) is torch.Tensor  # not FSDP's DTensor
        for p in params)


# oneDNN's call costs about 10 us more than F.linear's: below about 2^20 multiply-adds a call (a step with a few
# rows left, one sentence), F.linear is as fast or faster (0.2-1.04x); from there on oneDNN is 1.2-2.5x faster
# (bench/results/cpu_linear_2026-11-26.json)
MIN_MACS = 1 << 20


def _linear(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if x.numel() * weight.shape[0] < MIN_MACS:  # rows * in * out multiply-adds
        return F.linear(x, weight, bias)  # (..., out)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (..., out)


def _pack(weight: torch.Tensor, bias: torch.Tensor | None):
    w = weight.detach()
    return functools.partial(_linear, w, torch.ops.mkldnn._reorder_linear_weight(w),
                             None if bias is None else bias.detach())


@contextlib.contextmanager
def prepacked_linears(model: nn.Module) -> Iterator[None]:
    """Within it, every nn.Linear of `model` (its exact type: quantized or adapted subclasses keep their own) and
    a head tied to the embedding (`model.head` None, `model.output_embedding()`) run oneDNN's GEMM on weights
    packed on entry. Nested and concurrent uses share one packing; the last to leave restores the modules. The
    weights must not change inside it (a search's do not)."""
    with _LOCK:
        state = model.__dict__.get(_STATE)
        if state is None:
            if applies(model):
                linears = [m for m in model.modules() if type(m) is nn.Linear]
                for m in linears:
                    m.forward = _pack(m.weight, m.bias)  # an instance attribute over nn.Linear.forward
                tied = getattr(model, "head", 1) is None and hasattr(model, "output_embedding")
                if tied:
                    object.__setattr__(model, "head", _pack(model.output_embedding().weight, None))
                state = model.__dict__[_STATE] = [0, linears, tied]
        if state is not None:
            state[0] += 1
    try:
        yield
    finally:
        if state is not None:
            with _LOCK:
                state[0] -= 1
                if state[0] == 0:
                    for m in state[1]:
                        del m.forward
                    if state[2]:
                        object.__setattr__(model, "head", None)
                    del model.__dict__[_STATE]

