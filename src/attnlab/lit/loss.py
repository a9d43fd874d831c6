"""The training loss: label-smoothed cross-entropy with z-loss over non-padding tokens, from logits
(`token_loss`) or, chunked so that the batch's logits are never held, from hidden states and the output
weight (`linear_cross_entropy`). No Lightning here; the LightningModules call these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss(
    logits: torch.Tensor, target: torch.Tensor, pad_id: int, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy over non-padding tokens, plus z_loss * log(Z)^2 (PaLM).

    Returns (loss_sum, nll_sum, n_tokens); the caller divides by the tokens of the batch. The smoothing is
    Szegedy et al. 2016's, as fairseq's: (1 - eps) * nll + eps * mean over the vocabulary of -log p.
    One fused log-softmax (its backward needs no second exp, unlike logsumexp's) and a multiplicative
    padding mask (no gather/scatter of rows): on a CPU this halves the loss's share of a small model's step.
    """
    V = logits.shape[-1]
    x = logits.reshape(-1, V).float()  # (N, V)
    tgt = target.reshape(-1)  # (N,)
    keep = tgt.ne(pad_id)  # (N,)
    w = keep.to(x.dtype)  # (N,)
    lp = F.log_softmax(x, dim=-1)  # (N, V)
    lp_tgt = lp.gather(1, tgt.clamp(0, V - 1)[:, None]).squeeze(1)  # (N,)
    nll = -lp_tgt * w  # (N,)
    loss = nll if not label_smoothing else ((1 - label_smoothing) * -lp_tgt - label_smoothing * lp.mean(-1)) * w
    loss = loss.sum()
    if z_loss:  # log Z = x_target - log p_target
        log_z = x.gather(1, tgt.clamp(0, V - 1)[:, None]).squeeze(1) - lp_tgt  # (N,)
        loss = loss + z_loss * (log_z.pow(2) * w).sum()
    return loss, nll.detach().sum(), keep.sum()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device_type`, or None when autocast is off there."""
    try:  # torch >= 2.4
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except (TypeError, AttributeError):  # torch 2.3: per-device functions
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


class _LinearCrossEntropy(torch.autograd.Function):
    """token_loss of the logits h @ W^T without ever holding them for the whole batch.

    The tokens are taken `chunk` at a time: logits of the chunk (in h's dtype, then fp32), their loss, and at
    once the gradient of the loss with respect to those logits, which goes straight into dL/dh (chunk rows)
    and dL/dW (summed); the chunk's logits are then dropped. The backward only scales the stored gradients
    by the incoming one (the loss is a scalar), so there are no more matmuls than the plain path has: one for
    the logits and two for their gradient. Peak extra memory is a few (chunk, V) fp32 blocks plus dL/dh and
    an fp32 dL/dW, instead of several (N, V) ones (bf16 logits, their fp32 copy, log-probs, gradient).

    Per kept token i (weight w_i: 0 at padding), with z the (soft-capped) logits, lse = log sum exp z:
      loss_i = w_i [(1 - eps) (lse - z_t) + eps (lse - mean z) + alpha lse^2]
      dloss_i/dz = w_i [softmax(z) (1 + 2 alpha lse) - (1 - eps) onehot(t) - eps / V]
    and with soft-capping z = c tanh(u / c) of the raw logits u, dz/du = 1 - (z / c)^2.
    """

    @staticmethod
    def forward(ctx, h, weight, target, pad_id, smoothing, z_loss, softcap, chunk, grads):
        N, V = h.shape[0], weight.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        nll = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if grads else None  # (N, d)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if grads else None  # (V, d)
        for s in range(0, N, chunk):
            hc, tc = h[s:s + chunk], target[s:s + chunk]  # (n, d), (n,)
            keep = tc.ne(pad_id)  # (n,)
            w = keep.float()  # (n,)
            t = tc.clamp(0, V - 1)[:, None]  # (n, 1)
            z = (hc @ weight.t()).float()  # (n, V)
            if softcap:  # Gemma 2: z = c tanh(u / c)
                z = z.div_(softcap).tanh_().mul_(softcap)
            lse = torch.logsumexp(z, dim=-1)  # (n,)
            z_t = z.gather(1, t).squeeze(1)  # (n,)
            nll_i = (lse - z_t) * w  # (n,)
            loss_i = nll_i if not smoothing else ((1 - smoothing) * (lse - z_t) + smoothing * (lse - z.mean(-1))) * w
            if z_loss:
                loss_i = loss_i + z_loss * lse.pow(2) * w
            loss += loss_i.sum()
            nll += nll_i.sum()
            if not grads:
                continue
            cap = (1 - (z / softcap).pow(2)) if softcap else None  # (n, V) dz/du
            g = z.sub_(lse[:, None]).exp_()  # (n, V) softmax, in z's memory
            g.mul_((w * (1 + 2 * z_loss * lse))[:, None])
            g.scatter_add_(1, t, (-(1 - smoothing) * w)[:, None])
            if smoothing:
                g.sub_((smoothing / V * w)[:, None])
            if cap is not None:
                g.mul_(cap)
            g = g.to(h.dtype)  # (n, V) the matmuls run in the activations' dtype, as the plain path's backward
            grad_h[s:s + chunk] = g @ weight  # (n, d)
            grad_w += (g.t() @ hc).float()  # (V, d)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is None:
            raise RuntimeError("linear_cross_entropy was called without gradients (grads=False); cannot backward")
        return (grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype),
                None, None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, pad_id: int, label_smoothing: float = 0.0,
    z_loss: float = 0.0, softcap: float = 0.0, chunk: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_loss(softcap(hidden @ weight^T), ...) computed `chunk` tokens at a time (see _LinearCrossEntropy).

    hidden (..., d) final hidden states, weight (V, d) the output projection (no bias), target (...) token ids.
    Same returns and semantics as token_loss: (loss_sum, nll_sum, n_tokens). Under autocast the logits are
    computed in the autocast dtype, as the output layer's F.linear would. The gradients are computed in the
    forward pass, only when autograd will need them."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, d)
    tgt = target.reshape(-1)  # (N,)
    if h.shape[0] != tgt.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but target has {tgt.shape[0]}")
    w = weight
    dtype = autocast_dtype(h.device.type)
    if dtype is not None:
        h, w = h.to(dtype), w.to(dtype)  # differentiable casts: gradients return to the inputs' dtypes
    grads = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    with torch.autocast(h.device.type, enabled=False):
        loss, nll = _LinearCrossEntropy.apply(h, w, tgt, pad_id, label_smoothing, z_loss, softcap, chunk, grads)
    return loss, nll, tgt.ne(pad_id).sum()
