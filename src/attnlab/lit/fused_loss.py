"""The training loss through a maintained fused kernel library (the `gpu` extra, `pip install 'attnlab[gpu]'`):
the logits h @ W^T are made block by block on the GPU and never held for the whole batch, in fp32 or otherwise.

  liger  Liger Kernel (Hsu et al. 2024, arXiv:2410.10989): `liger_fused_linear_cross_entropy`, chunks of tokens,
         the chunk's logits by cuBLAS, loss and logit gradient by one Triton kernel; the gradients are made in the
         forward pass. Label smoothing, z-loss (its lse_square_scale), soft-capping, ignore_index.
  cce    Cut Cross-Entropy (Wijmans et al. 2025, arXiv:2411.09009): `cut_cross_entropy.linear_cross_entropy`, the
         log-sum-exp by a blocked matmul kernel, the logits recomputed in the backward. Soft-capping and
         ignore_index only: 25.1.1 has no label smoothing and no z-loss, so a loss with either is refused.

`trainer.fused_loss` (FUSED_LOSSES) picks one; `resolve_fused_loss` says what runs on a device. The values are
token_loss's (lit/loss.py) of softcap(h @ W^T): (loss_sum, nll_sum, n_tokens), padding (pad_id) ignored.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math

import torch

from ..config import ConfigError
from .loss import autocast_dtype

FUSED_LOSSES = ("auto", "liger", "cce", "off")
# what auto tries, first first (liger until bench/train_throughput.py's attnlab-liger and attnlab-cce rows are
# measured on an H100); each also needs a CUDA device and a loss it can compute
AUTO_ORDER = ("liger", "cce")
# tokens of each of liger's chunks. Its own default (chunks of about N x d logits) cuts bench/train_throughput.py's
# encdec batch (12,800 tokens, d 512, V 37k) into 256-token chunks: 26% slower than the plain loss on an H100 (eager,
# 2026-11-26); 4,096-token chunks: encdec 2% and lm (16,384 tokens, d 768, V 32k) 10% faster than the plain loss
LIGER_CHUNK_TOKENS = 4096
PACKAGES = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}


@functools.cache
def installed(impl: str) -> bool:
    """Whether `impl`'s package is importable (looked up, not imported: importing liger takes seconds)."""
    return importlib.util.find_spec(PACKAGES[impl][0]) is not None


def unsupported(impl: str, label_smoothing: float, z_loss: float) -> str | None:
    """Why `impl` cannot compute this loss, or None."""
    if impl == "cce" and (label_smoothing or z_loss):
        return (f"cut-cross-entropy computes plain cross-entropy (with soft-capping) only: it has no label smoothing "
                f"(optim.label_smoothing={label_smoothing}) and no z-loss (model.z_loss={z_loss}); set both to 0, "
                "or use trainer.fused_loss liger (or auto)")
    return None


def resolve_fused_loss(choice: str, device_type: str, label_smoothing: float = 0.0, z_loss: float = 0.0) -> str:
    """What computes the training loss on `device_type`: 'liger', 'cce', or 'off' (the logits path, plain or
    chunked by trainer.loss_chunk). auto: on CUDA the first of AUTO_ORDER that is installed and can compute the loss,
    else off. liger / cce: that library, or a ConfigError saying why it cannot run here."""
    if choice not in FUSED_LOSSES:
        raise ConfigError(f"trainer.fused_loss={choice!r} is not one of: {', '.join(FUSED_LOSSES)}")
    if choice == "off":
        return "off"
    if choice == "auto":
        if device_type != "cuda":
            return "off"
        return next((i for i in AUTO_ORDER if installed(i) and unsupported(i, label_smoothing, z_loss) is None), "off")
    if device_type != "cuda":
        raise ConfigError(f"trainer.fused_loss={choice} runs Triton kernels on a CUDA device; this run trains on "
                          f"{device_type}: use trainer.fused_loss auto (off here) or off")
    if not installed(choice):
        raise ConfigError(f"trainer.fused_loss={choice} needs {PACKAGES[choice][1]}, which is not installed: "
                          "pip install 'attnlab[gpu]'")
    why = unsupported(choice, label_smoothing, z_loss)
    if why is not None:
        raise ConfigError(f"trainer.fused_loss={choice}: {why}")
    return choice


def _liger(h, w, target, pad_id, label_smoothing, z_loss, softcap, chunk_tokens) -> torch.Tensor:
    lib = importlib.import_module("liger_kernel.transformers.functional")
    (N, d), V = h.shape, w.shape[0]
    # liger's chunks hold about chunk_mem_const x N d logits, rounded to a power of two of tokens
    chunk_mem = max(1, math.ceil(chunk_tokens * V / max(N * d, 1))) if chunk_tokens else 1
    # reduction sum: token_loss's loss_sum; fp32 accumulation of dL/dW over the chunks (else in W's dtype: bf16)
    return lib.liger_fused_linear_cross_entropy(h, w, target, ignore_index=pad_id, lse_square_scale=z_loss,
                                                label_smoothing=label_smoothing, reduction="sum",
                                                softcap=softcap or None, accum_dtype=torch.float32,
                                                chunk_mem_const=chunk_mem)


def _cce(h, w, target, pad_id, label_smoothing, z_loss, softcap, chunk_tokens) -> torch.Tensor:
    why = unsupported("cce", label_smoothing, z_loss)
    if why is not None:
        raise ConfigError(why)
    lib = importlib.import_module("cut_cross_entropy")
    # filter_eps=None: exact gradients (its default skips vocabulary blocks whose softmax is below bf16's eps / 32)
    return lib.linear_cross_entropy(h, w, target, ignore_index=pad_id, softcap=softcap or None, reduction="sum",
                                    filter_eps=None)


LIBRARIES = {"liger": _liger, "cce": _cce}


@torch.compiler.disable
def _library_loss(impl, h, w, target, pad_id, label_smoothing, z_loss, softcap, chunk_tokens) -> torch.Tensor:
    # never traced: liger's forward reads the kept-token count to the host (.item()) and CCE's selects the kept rows
    # with nonzero(); dynamo would break the graph there anyway. attnlab compiles blocks only: this runs eagerly.
    with torch.autocast(h.device.type, enabled=False):
        return LIBRARIES[impl](h, w, target, pad_id, label_smoothing, z_loss, softcap, chunk_tokens)


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, pad_id: int, label_smoothing: float = 0.0,
    z_loss: float = 0.0, softcap: float = 0.0, impl: str = "liger", with_nll: bool = True,
    chunk_tokens: int = LIGER_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """token_loss(softcap(hidden @ weight^T), target, pad_id, label_smoothing, z_loss) through library `impl`.

    hidden (..., d) final hidden states, weight (V, d) the output projection (no bias), target (...) token ids.
    Returns (loss_sum, nll_sum, n_tokens) as token_loss does. Neither library returns the nll beside a smoothed or
    z-regularised loss, so with either term nll_sum comes from a second, gradient-free call with both off (one more
    logits matmul, no backward), made only when `with_nll` (the trainer asks on its logging steps); otherwise
    nll_sum is None. Without them the loss is the nll. Under autocast the logits are made in the autocast dtype, as
    the output layer's F.linear would make them. chunk_tokens: about how many tokens each of liger's chunks takes
    (0: liger's own default; CCE has no chunks)."""
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, d)
    tgt = target.reshape(-1)  # (N,)
    if h.shape[0] != tgt.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but target has {tgt.shape[0]}")
    if impl not in LIBRARIES:
        raise ValueError(f"impl={impl!r} is not one of: {', '.join(LIBRARIES)}")
    w = weight
    dtype = autocast_dtype(h.device.type)
    if dtype is not None:
        h, w = h.to(dtype), w.to(dtype)  # differentiable casts: gradients return to the inputs' dtypes
    loss = _library_loss(impl, h, w, tgt, pad_id, label_smoothing, z_loss, softcap, chunk_tokens)  # () fp32
    nll = None
    if with_nll and not (label_smoothing or z_loss):
        nll = loss.detach()
    elif with_nll:
        with torch.no_grad():
            nll = _library_loss(impl, h.detach(), w.detach(), tgt, pad_id, 0.0, 0.0, softcap, chunk_tokens)
    return loss, nll, tgt.ne(pad_id).sum()
