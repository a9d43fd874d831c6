"""Multi-head attention: self or cross, MHA/GQA/MQA, QK-norm, RoPE, ALiBi, soft-capping, KV cache.

Backends: `sdpa` (torch.nn.functional.scaled_dot_product_attention, which picks the flash or
memory-efficient kernel when the inputs allow), `flash_attn` (the flash-attn package), and `eager`
(reference math in plain PyTorch that can return the attention weights).

On a GPU, `sdpa` runs with SDPA's cuDNN kernel switched off (SDPA_GPU_BACKENDS): cuDNN builds an execution plan
for every new shape, ~0.4 s each on an H100 (torch 2.11), and batches made by token count, validation decoding
and a growing KV cache bring a new shape nearly every call. Left on, it made a bf16 `attnlab fit` of the demo
recipe run 2-5k tokens/s on an H100 (bench/RESULTS.md); flash and memory-efficient kernels need no plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import ModelConfig
from .layers import apply_rope, make_norm

# SDPA takes fewer K/V heads itself from torch 2.5 (enable_gqa); before that the heads are repeated here
SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
# the SDPA kernels allowed off the CPU, in SDPA's own order: no cuDNN (a plan per new shape; see the docstring)
SDPA_GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class Mask:
    """What a query may attend to, built once per forward and shared by every layer.

    `causal`: query i of Tq sees keys j <= i + (Tk - Tq), i.e. the mask is aligned bottom-right, so new
    queries after a cached prefix see the whole prefix (flash-attn's convention). Backends apply it
    themselves: no (Tq, Tk) tensor is built when a kernel can do it, so SDPA may pick its flash kernel.
    `bias` is None or a tensor broadcastable to (B, H, Tq, Tk): bool (True = attend) or float (added to
    the scores: ALiBi and -inf for hidden keys).
    `key_pad` (B, Tk), True at padding, is kept for backends that take lengths instead of a mask.
    A query that may see no key at all (a source made only of padding) gets a zero output on every backend.
    """

    causal: bool = False
    bias: torch.Tensor | None = None
    key_pad: torch.Tensor | None = None
    # flash_attn's varlen inputs (kept key rows, cumulative lengths), made once from key_pad for every layer
    varlen: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    # a bool bias as SDPA's additive mask, per dtype, made at the first layer's call for every layer
    additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def additive_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The bool bias as the float mask SDPA makes of it at each call (0 where True, -inf where False, in the
        queries' dtype: the same results), made once per forward instead of once per layer."""
        if dtype not in self.additive:
            hidden = ~self.bias  # (B|1, H|1, Tq|1, Tk)
            self.additive[dtype] = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
                hidden, float("-inf"))
        return self.additive[dtype]

    def unpadded_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index of each kept key in the flattened (B*Tk) keys, cu_seqlens (B+1,) int32), computed at the
        first call: one host sync (the number of kept keys) per forward, not one per layer."""
        if self.varlen is None:
            keep = ~self.key_pad  # (B, Tk)
            rows = keep.flatten().nonzero().squeeze(1)  # (N,) the one sync: N is read back
            cu = F.pad(keep.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))  # (B+1,)
            self.varlen = (rows, cu)
        return self.varlen


def causal_allowed(Tq: int, Tk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(Tq, Tk) bool, True = attend: the bottom-right aligned causal mask of `Mask.causal`."""
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(Tk - Tq)  # (Tq, Tk)


def select_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t.index_select(0, index), through a 2-D view where t is contiguous: on a CPU torch copies a 4-D index_select
    element by element (7x slower at (512, 4, 40, 32), the beam-4 cache of 128 sentences) and a 2-D one by rows."""
    if not t.is_contiguous():
        return t.index_select(0, index)
    return t.view(t.shape[0], -1).index_select(0, index).view(index.shape[0], *t.shape[1:])


class KVCache:
    """Keys and values per decoder layer for incremental decoding.

    Self-attention entries grow by the new tokens at each step; cross-attention entries are computed
    once from the encoder output and reused. `pos` counts the tokens already in the cache.
    """

    def __init__(self, n_layers: int) -> None:
        self.self_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.cross_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers
        self.pos: int | torch.Tensor = 0
        self.cross_mask: Mask | None = None  # the cross-attention mask of the last step's source padding

    def source_mask(self, memory_pad: torch.Tensor) -> Mask:
        """The cross-attention mask of memory_pad (B, S), True at padding: made once and kept while the steps pass the
        same padding tensor (a search passes it again until sentences leave), not rebuilt at every step."""
        if self.cross_mask is None or self.cross_mask.key_pad is not memory_pad:
            self.cross_mask = Mask(bias=~memory_pad[:, None, None, :], key_pad=memory_pad)  # (B, 1, 1, S)
        return self.cross_mask

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, mask: Mask
    ) -> tuple[torch.Tensor, torch.Tensor, Mask]:
        """Add the new keys/values (B, Hkv, T, hd) of `layer`; return every key/value so far and the mask to use."""
        past = self.self_kv[layer]
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # (B, Hkv, Tpast + T, hd)
            v = torch.cat((past[1], v), dim=2)
        self.self_kv[layer] = (k, v)
        return k, v, mask

    def reorder(self, index: torch.Tensor, self_only: bool = False) -> None:
        """Select batch rows (beam search: keep the surviving hypotheses). `self_only` leaves the
        cross-attention entries alone: right when they hold one row per sentence, shared by its beams
        (select those rows with `select_cross`)."""
        for i, kv in enumerate(self.self_kv):
            if kv is not None:
                self.self_kv[i] = (select_rows(kv[0], index), select_rows(kv[1], index))
        if not self_only:
            self.select_cross(index)

    def select_cross(self, index: torch.Tensor) -> None:
        """Keep the cross-attention rows `index` (the sentences still decoding)."""
        self.cross_mask = None  # of the rows before
        for i, kv in enumerate(self.cross_kv):
            if kv is not None:
                self.cross_kv[i] = (select_rows(kv[0], index), select_rows(kv[1], index))


class StaticKVCache(KVCache):
    """Self-attention keys and values preallocated for `max_len` positions, written in place.

    The growing KVCache copies its whole prefix at every step (torch.cat); this one writes only the new
    keys. The buffers, (B, Hkv, max_len, hd) per layer, are allocated at the first write, in the dtype and on
    the device of the keys. Cross-attention entries are kept as in KVCache. Two ways to hold the position:
      `pos` an int (the default): a call writes its keys at [pos, pos + T) and attends over the first pos + T,
        the same values in the same order as KVCache, so the same results.
      `pos` a 0-d long tensor on the device (`device_position()`): a call writes at pos + arange(T) with
        index_copy_ and attends over the whole buffer, hiding the slots after each query. No shape and no
        Python number changes from one step to the next, so one decoding step can be captured in a CUDA
        graph (or compiled once) and replayed. Not for masks with a bias (ALiBi) or for flash_attn.
    """

    def __init__(self, n_layers: int, max_len: int) -> None:
        super().__init__(n_layers)
        if max_len < 1:
            raise ValueError(f"max_len={max_len} must be >= 1")
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    def device_position(self, device: torch.device | str) -> None:
        """Hold the position as a 0-d tensor on `device` from now on (see the class note)."""
        if not isinstance(self.pos, torch.Tensor):
            self.pos = torch.tensor(self.pos, dtype=torch.long, device=device)

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, mask: Mask
    ) -> tuple[torch.Tensor, torch.Tensor, Mask]:
        B, Hkv, T, hd = k.shape
        if self.keys[layer] is None:
            self.keys[layer] = k.new_zeros(B, Hkv, self.max_len, hd)  # (B, Hkv, L, hd)
            self.values[layer] = v.new_zeros(B, Hkv, self.max_len, v.shape[-1])  # (B, Hkv, L, hd_v)
        keys, values = self.keys[layer], self.values[layer]
        if not isinstance(self.pos, torch.Tensor):
            end = self.pos + T
            if end > self.max_len:
                raise ValueError(f"the static KV cache holds {self.max_len} positions; position {end - 1} is past it")
            keys[:, :, self.pos:end] = k
            values[:, :, self.pos:end] = v
            return keys[:, :, :end], values[:, :, :end], mask  # (B, Hkv, pos + T, hd) views
        if mask.bias is not None:
            raise ValueError("a StaticKVCache with a device-side position takes no mask bias (ALiBi, key padding)")
        at = self.pos + torch.arange(T, device=k.device)  # (T,) positions of the new queries and keys
        keys.index_copy_(2, at, k)
        values.index_copy_(2, at, v)
        allowed = torch.arange(self.max_len, device=k.device)[None, :] <= at[:, None]  # (T, L) causal and written
        return keys, values, Mask(bias=allowed)

    def reorder(self, index: torch.Tensor, self_only: bool = False) -> None:
        super().reorder(index, self_only)  # cross-attention entries
        n = self.max_len if isinstance(self.pos, torch.Tensor) else self.pos
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                if buf is None:
                    continue
                if len(index) == buf.shape[0]:
                    buf[:, :, :n] = select_rows(buf[:, :, :n], index)  # in place: the buffers keep their address
                else:  # fewer rows (finished sentences leave the batch): new buffers
                    store[i] = buf.new_zeros(len(index), *buf.shape[1:])  # (B', Hkv, L, hd)
                    store[i][:, :, :n] = select_rows(buf[:, :, :n], index)


def flash_attn_module(softcap: bool = False):
    """Import flash-attn or fail with the install hint. Soft-capping needs flash-attn >= 2.6."""
    try:
        import flash_attn
    except ImportError as e:
        raise ImportError(
            "model.attention_backend=flash_attn needs the flash-attn package: pip install 'attnlab[flash]' "
            "(CUDA only), or use attention_backend=sdpa"
        ) from e
    version = getattr(flash_attn, "__version__", None)
    if softcap and version is not None:
        major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
        if major_minor < (2, 6):
            raise ImportError(
                f"model.attn_softcap with model.attention_backend=flash_attn needs flash-attn >= 2.6 "
                f"(installed: {version}): pip install -U flash-attn, or use attention_backend=eager"
            )
    return flash_attn


class Attention(nn.Module):
    """Scaled dot-product attention (Vaswani et al. 2017, section 3.2) with grouped K/V heads.

    GQA (Ainslie et al. 2023, arXiv:2305.13245) shares each K/V head among n_heads / n_kv_heads query
    heads; MQA (Shazeer 2019, arXiv:1911.02150) is n_kv_heads = 1. QK-norm normalises queries and keys
    per head before RoPE (Dehghani et al. 2023, arXiv:2302.05442; as in Qwen3).
    """

    def __init__(self, cfg: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        self.cross = cross
        self.n_heads, self.n_kv, self.hd, self.hd_v = cfg.n_heads, cfg.kv_heads, cfg.d_k, cfg.d_v
        d, q_dim, k_dim, v_dim = cfg.d_model, cfg.n_heads * cfg.d_k, cfg.kv_heads * cfg.d_k, cfg.kv_heads * cfg.d_v
        if cross:  # queries from the decoder, keys/values from the encoder output
            self.q_proj = nn.Linear(d, q_dim, bias=cfg.attn_bias)
            self.kv_proj = nn.Linear(d, k_dim + v_dim, bias=cfg.attn_bias)
        else:  # one fused projection: a single matmul for Q, K and V
            self.qkv_proj = nn.Linear(d, q_dim + k_dim + v_dim, bias=cfg.attn_bias)
        self.out_proj = nn.Linear(cfg.n_heads * cfg.d_v, d, bias=cfg.attn_bias)
        self.q_norm = make_norm(cfg, self.hd) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.hd) if cfg.qk_norm else None
        self.backend = cfg.attention_backend
        self.softcap = cfg.attn_softcap
        self.dropout = cfg.attn_dropout
        self.keep_weights = False  # eager backend: store the last attention weights in .weights
        self.weights: torch.Tensor | None = None
        if self.backend == "flash_attn":
            flash_attn_module(softcap=self.softcap > 0)

    def forward(
        self,
        x: torch.Tensor,
        mask: Mask,
        memory: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if self.cross:
            cached = cache.cross_kv[layer] if cache is not None else None
            if cached is None:
                assert memory is not None, "cross-attention needs the encoder output"
                k, v = self.memory_kv(memory)  # (B, Hkv, S, hd|hd_v)
                if cache is not None:
                    cache.cross_kv[layer] = (k, v)
            else:
                k, v = cached
            # cached K/V may have fewer rows than x (Bs = B / g: a sentence's g beams share its row): its g rows of
            # queries attend as g*T queries of one row, so the keys are read once per sentence, not once per beam
            if B * T == k.shape[0] and self.q_norm is None:  # one query a row (greedy): as it lies, one op
                q = self.q_proj(x).view(B, self.n_heads, 1, self.hd)  # (Bs, H, 1, hd)
            else:
                q = self.q_proj(x).view(k.shape[0], -1, self.n_heads, self.hd)  # (Bs, g*T, H, hd)
                q = self.q_norm(q) if self.q_norm is not None else q
                q = q.transpose(1, 2)  # (Bs, H, g*T, hd)
        else:
            qkv = self.qkv_proj(x)  # (B, T, (H + Hkv) hd + Hkv hd_v)
            q, k, v = qkv.split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd_v], dim=-1)
            if T == 1 and self.q_norm is None:  # a decoding step: (B, 1, H*hd) is (B, H, 1, hd) as it lies, one op
                q, k, v = q.view(B, self.n_heads, 1, self.hd), k.view(B, self.n_kv, 1, self.hd), v.view(
                    B, self.n_kv, 1, self.hd_v)  # (B, H|Hkv, 1, hd|hd_v)
            else:
                q = q.view(B, T, self.n_heads, self.hd)  # (B, T, H, hd)
                k = k.view(B, T, self.n_kv, self.hd)  # (B, T, Hkv, hd)
                if self.q_norm is not None:
                    q, k = self.q_norm(q), self.k_norm(k)
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, self.n_kv, self.hd_v).transpose(1, 2)
            if rope is not None:  # rotate new queries and keys at their absolute positions
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # (B, H|Hkv, T, hd)
            if cache is not None:  # every key/value so far, (B, Hkv, Tk, hd); a static cache may replace the mask
                k, v, mask = cache.append(layer, k, v, mask)
        y = self._attend(q, k, v, mask)  # (B|Bs, H, T|g*T, hd_v)
        if y.shape[2] == 1:  # one query a row: (B, H, 1, hd_v) is (B, 1, H*hd_v) as it lies
            y = y.reshape(B, T, self.n_heads * self.hd_v)  # (B, 1, H*hd_v)
        else:
            y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd_v)  # (B, T, H*hd_v)
        return self.out_proj(y)  # (B, T, d)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of the encoder output memory (B, S, d): (B, Hkv, S, hd|hd_v) each."""
        B, S, _ = memory.shape
        k, v = self.kv_proj(memory).split([self.n_kv * self.hd, self.n_kv * self.hd_v], dim=-1)
        k, v = k.view(B, S, self.n_kv, self.hd), v.view(B, S, self.n_kv, self.hd_v)  # (B, S, Hkv, hd|hd_v)
        k = self.k_norm(k) if self.k_norm is not None else k
        return k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S, hd|hd_v)

    # ------------------------------------------------------------------------------------------
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.backend == "eager" or self.keep_weights:
            return self._eager(q, k, v, mask, p)
        if self.backend == "flash_attn":
            return self._flash(q, k, v, mask, p)
        gqa = {}
        if self.n_kv != self.n_heads:
            # enable_gqa runs in SDPA's flash and math kernels only: with a mask on CUDA (padding) the K/V heads are
            # repeated instead, so the memory-efficient kernel takes it rather than the math fallback
            if SDPA_GQA and not (mask.bias is not None and q.is_cuda):
                gqa = {"enable_gqa": True}
            else:
                rep = self.n_heads // self.n_kv
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, Tk, hd)
        attn_mask, is_causal = mask.bias, mask.causal
        Tq, Tk = q.shape[2], k.shape[2]
        if is_causal and (Tq != Tk or attn_mask is not None):  # SDPA's is_causal is top-left aligned
            allowed = causal_allowed(Tq, Tk, q.device)  # (Tq, Tk)
            if attn_mask is None:
                attn_mask = allowed
            elif attn_mask.dtype == torch.bool:
                attn_mask = attn_mask & allowed  # (B|1, H|1, Tq, Tk)
            else:
                attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
            is_causal = False
        if attn_mask is mask.bias and attn_mask is not None and attn_mask.dtype == torch.bool \
                and not torch.compiler.is_compiling():
            attn_mask = mask.additive_bias(q.dtype)  # (B|1, H|1, Tq|1, Tk)
        if q.device.type == "cpu":
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal, **gqa
            )  # (B, H, T, hd)
        with sdpa_kernel(SDPA_GPU_BACKENDS):  # ~17 us of host time (a CPU core); torch.compile traces it
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal, **gqa
            )  # (B, H, T, hd)

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, p: float) -> torch.Tensor:
        """Reference math: softmax(q k^T / sqrt(hd) + bias) v, in fp32 for the softmax."""
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, Tk, hd)
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(self.hd)  # (B, H, Tq, Tk)
        if self.softcap:  # Gemma 2 (arXiv:2408.00118): keep scores in (-c, c)
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if mask.causal:
            scores = scores.masked_fill(~causal_allowed(*scores.shape[-2:], q.device), float("-inf"))
        if mask.bias is not None:
            if mask.bias.dtype == torch.bool:
                scores = scores.masked_fill(~mask.bias, float("-inf"))
            else:
                scores = scores + mask.bias
        if mask.bias is None:
            w = scores.softmax(dim=-1)  # (B, H, Tq, Tk)
        else:  # a row with every key hidden: zeros, as SDPA and flash-attn give, not NaN, and so is its gradient
            empty = scores.isneginf().all(-1, keepdim=True)  # (B, H, Tq, 1)
            w = scores.masked_fill(empty, 0.0).softmax(dim=-1).masked_fill(empty, 0.0)  # (B, H, Tq, Tk)
        if self.keep_weights:
            self.weights = w.detach()
        w = F.dropout(w, p) if p else w
        return w.to(v.dtype) @ v  # (B, H, Tq, hd)

    def _flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, p: float) -> torch.Tensor:
        """flash-attn (Dao 2023): (B, T, H, hd) layout; padded keys go through the varlen kernel."""
        from flash_attn import flash_attn_func, flash_attn_varlen_func

        if mask.bias is not None and mask.key_pad is None:
            raise ValueError("attention_backend=flash_attn cannot apply an arbitrary mask; use sdpa or eager")
        B, H, Tq, hd = q.shape
        # the kernel takes one 16-bit dtype: under autocast a norm's output (QK-norm) is fp32 while v is bf16
        q, k = q.to(v.dtype), k.to(v.dtype)
        causal = mask.causal  # bottom-right aligned, as flash-attn aligns it
        extra = {"softcap": self.softcap} if self.softcap else {}
        qf, kf, vf = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H|Hkv, hd)
        if mask.key_pad is None:
            # flash-attn aligns a causal mask bottom-right, which is what a cached prefix needs
            return flash_attn_func(qf, kf, vf, dropout_p=p, causal=causal, **extra).transpose(1, 2)
        rows, cu_k = mask.unpadded_keys()  # (N,), (B+1,)
        cu_q = torch.arange(0, (B + 1) * Tq, Tq, dtype=torch.int32, device=q.device)  # every query kept
        Tk = kf.shape[1]  # max_seqlen_k is a bound for the kernel's grid: the padded length serves, with no sync
        out = flash_attn_varlen_func(
            qf.reshape(B * Tq, H, hd), kf.flatten(0, 1)[rows], vf.flatten(0, 1)[rows], cu_q, cu_k, Tq, Tk,
            dropout_p=p, causal=causal, **extra,
        )  # (B*Tq, H, hd)
        return out.view(B, Tq, H, hd).transpose(1, 2)  # (B, H, Tq, hd)
