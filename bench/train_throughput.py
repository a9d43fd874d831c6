"""Training throughput of attnlab against its peers, in one process: forward + backward + AdamW step.

    python bench/train_throughput.py                      # CUDA: issue 7's shapes, eager and torch.compile
    python bench/train_throughput.py --cpu                # small shapes on the CPU, eager: runs anywhere
    python bench/train_throughput.py --modes compile --only encdec/ --json $OUT/train.json
    python bench/train_throughput.py --tasks encdec --recipe experiments/demo_en_de.yaml   # a recipe's shape

Shapes (full; --cpu or --size small shrinks every dimension):
  encdec  Transformer-base: 200 pairs x 64 source + 64 target tokens, shared 37k vocabulary, tied output,
          dropout 0.1, label smoothing 0.1. tokens/s counts target tokens.
          attnlab (the 2017 base config) | torch.nn.Transformer + embeddings/output layer | HF MarianMTModel
          (random weights from a config) | x-transformers XTransformer
  lm      decoder-only ~110M: d 768, 12 layers, 12 heads, SwiGLU ff 2048, RoPE, RMSNorm, vocab 32k tied;
          batch 16 x 1024. attnlab | HF LlamaForCausalLM | x-transformers TransformerWrapper
Every model gets the same batch (random ids, no padding), bf16 autocast on CUDA (fp32 on a CPU), the same
loss (label-smoothed CE over fp32 logits; attnlab's token_loss, F.cross_entropy for the peers) and AdamW
(fused on CUDA). "attnlab-chunked" computes the loss with trainer.loss_chunk's linear_cross_entropy; "attnlab-liger"
and "attnlab-cce" with trainer.fused_loss's libraries (attnlab.lit.fused_loss.fused_linear_cross_entropy, as the
trainer calls it on a step it does not log; the gpu extra; CUDA only, else skipped with the reason; CCE has no label
smoothing, so it skips the encdec task); "attnlab-liger-all" (lm, eager: it failed to compile) also swaps in
Liger's RMSNorm, fused SwiGLU and RoPE kernels (this benchmark only, see liger_everything).
Modes: eager; compile = torch.compile(model) for every model; compile also runs "attnlab-blocks", attnlab's
own trainer.compile (each block compiled, dynamic shapes), and "attnlab-blocks-liger", the same with the liger loss
(what a trainer.compile run on a GPU with the gpu extra trains). MFU = training FLOPs from
attnlab.models.accounting.training_flops over the matmul peak measured at the start of the run. Peak memory
is torch.cuda.max_memory_allocated from building the model to the last step (weights, AdamW state,
activations). --profile prints each attnlab row's top CUDA kernels (is SDPA's flash kernel the one chosen?).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Env,
    Missing,
    add_common_args,
    make_env,
    need,
    peak_memory_gib,
    print_table,
    reset_memory,
    run_row,
    selected,
    sync,
    time_steps,
    write_json,
)

from attnlab.config import ConfigError, ModelConfig  # noqa: E402
from attnlab.experiment import load_experiment  # noqa: E402
from attnlab.lit.fused_loss import LIGER_CHUNK_TOKENS, fused_linear_cross_entropy, resolve_fused_loss  # noqa: E402
from attnlab.lit.loss import linear_cross_entropy, token_loss  # noqa: E402
from attnlab.models import attention as attnlab_attention  # noqa: E402
from attnlab.models.accounting import training_flops  # noqa: E402
from attnlab.models.layers import FeedForward  # noqa: E402
from attnlab.models.tables import RMSNorm  # noqa: E402
from attnlab.models.transformer import build_model  # noqa: E402

PAD = 0
SHAPES = {
    "full": {"encdec": dict(batch=200, src=64, tgt=64, vocab=37000, d=512, heads=8, layers=6, ff=2048),
             "lm": dict(batch=16, seq=1024, vocab=32000, d=768, heads=12, layers=12, ff=2048)},
    "small": {"encdec": dict(batch=8, src=16, tgt=16, vocab=1000, d=64, heads=4, layers=2, ff=256),
              "lm": dict(batch=4, seq=64, vocab=1000, d=64, heads=4, layers=2, ff=192)},
}
SMOOTHING = {"encdec": 0.1, "lm": 0.0}


def encdec_config(s: dict) -> ModelConfig:
    """The 2017 base Transformer at shape `s` (post-norm, sinusoidal, ReLU, one shared table, dropout 0.1)."""
    return ModelConfig(vocab_size=s["vocab"], d_model=s["d"], n_heads=s["heads"], n_enc_layers=s["layers"],
                       n_dec_layers=s["layers"], d_ff=s["ff"], dropout=0.1, max_seq_len=max(s["src"], s["tgt"]))


def lm_config(s: dict) -> ModelConfig:
    """Llama-style: pre-RMSNorm, SwiGLU, RoPE, no biases, tied output, no dropout."""
    return ModelConfig(arch="decoder_only", vocab_size=s["vocab"], d_model=s["d"], n_heads=s["heads"],
                       n_dec_layers=s["layers"], d_ff=s["ff"], ffn="swiglu", norm="rmsnorm", norm_position="pre",
                       position="rope", attn_bias=False, ffn_bias=False, dropout=0.0, tie_embeddings="all",
                       scale_embeddings=False, init="normal", max_seq_len=s["seq"])


# ------------------------------------------------------------------------------------------ peers
class TorchSeq2Seq(nn.Module):
    """torch.nn.Transformer as a user completes it: one shared embedding (scaled), sinusoidal positions, tied output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, d, padding_idx=PAD)
        pos = torch.arange(cfg.max_seq_len)[:, None] * torch.exp(torch.arange(0, d, 2) * (-math.log(1e4) / d))
        pe = torch.zeros(cfg.max_seq_len, d)
        pe[:, 0::2], pe[:, 1::2] = pos.sin(), pos.cos()
        self.register_buffer("pe", pe, persistent=False)  # (L, d)
        self.net = nn.Transformer(d, cfg.n_heads, cfg.n_enc_layers, cfg.n_dec_layers, cfg.d_ff, cfg.dropout,
                                  batch_first=True)
        self.drop = nn.Dropout(cfg.dropout)
        self.scale = math.sqrt(d)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        S, T = src.shape[1], tgt.shape[1]
        src_pad = src.eq(PAD)  # (B, S)
        x = self.drop(self.embed(src) * self.scale + self.pe[:S])  # (B, S, d)
        y = self.drop(self.embed(tgt) * self.scale + self.pe[:T])  # (B, T, d)
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=tgt.device)  # (T, T)
        h = self.net(x, y, tgt_mask=causal, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
                     tgt_is_causal=True)  # (B, T, d)
        return F.linear(h, self.embed.weight)  # (B, T, V)


class Marian(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tr = need("transformers", "pip install transformers")
        mc = tr.MarianConfig(
            vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
            encoder_layers=cfg.n_enc_layers, decoder_layers=cfg.n_dec_layers, encoder_attention_heads=cfg.n_heads,
            decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
            max_position_embeddings=cfg.max_seq_len, activation_function="relu", dropout=cfg.dropout,
            attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
            forced_eos_token_id=None)
        self.net = tr.MarianMTModel(mc)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt).logits  # (B, T, V)


class XSeq2Seq(nn.Module):
    """x-transformers' XTransformer with its defaults (pre-norm, learned positions), output tied to the table."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        xt = need("x_transformers", "carry .whl, see bench/README.md")
        side = dict(num_tokens=cfg.vocab_size, max_seq_len=cfg.max_seq_len, depth=cfg.n_enc_layers,
                    heads=cfg.n_heads, attn_dim_head=cfg.d_k, ff_mult=cfg.d_ff / cfg.d_model, attn_flash=True,
                    emb_dropout=cfg.dropout, ff_dropout=cfg.dropout)
        kw = {f"enc_{k}": v for k, v in side.items()} | {f"dec_{k}": v for k, v in side.items()}
        kw["dec_depth"] = cfg.n_dec_layers
        self.net = xt.XTransformer(dim=cfg.d_model, tie_token_emb=True, pad_value=PAD, **kw)
        dec = self.net.decoder.net
        del dec.to_logits  # its own output matrix: replaced by the shared table, as the others have
        dec.to_logits = lambda h: h @ dec.token_emb.emb.weight.t()

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = src.ne(PAD)  # (B, S) True = keep
        memory = self.net.encoder(src, mask=mask, return_embeddings=True)  # (B, S, d)
        return self.net.decoder.net(tgt, context=memory, context_mask=mask)  # (B, T, V)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tr = need("transformers", "pip install transformers")
        lc = tr.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_dec_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=1,
            eos_token_id=2)
        self.net = tr.LlamaForCausalLM(lc)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids).logits  # (B, T, V)


class XLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        xt = need("x_transformers", "carry .whl, see bench/README.md")
        layers = xt.Decoder(dim=cfg.d_model, depth=cfg.n_dec_layers, heads=cfg.n_heads, attn_dim_head=cfg.d_k,
                            ff_mult=cfg.d_ff / cfg.d_model, ff_glu=True, ff_swish=True, ff_no_bias=True,
                            rotary_pos_emb=True, use_rmsnorm=True, attn_flash=True)
        self.net = xt.TransformerWrapper(num_tokens=cfg.vocab_size, max_seq_len=cfg.max_seq_len, attn_layers=layers,
                                         tie_embedding=True, use_abs_pos_emb=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)  # (B, T, V)


PEERS = {"encdec": {"torch": TorchSeq2Seq, "marian": Marian, "x-transformers": XSeq2Seq},
         "lm": {"llama": Llama, "x-transformers": XLM}}


# ------------------------------------------------------------------------------------------ Liger's other kernels
def liger_everything(model: nn.Module) -> contextlib.AbstractContextManager:
    """Liger Kernel's RMSNorm, fused SwiGLU and RoPE in an attnlab decoder, for the attnlab-liger-all row only.

    Every RMSNorm becomes a LigerRMSNorm (llama casting: statistics in fp32, cast back, then the weight, as
    attnlab's), each gated FFN's silu(gate) * up over fc1's fused halves one LigerFusedGateUpSiLUMulFunction. RoPE:
    the returned context replaces attention.apply_rope while the row runs. attnlab rotates queries and keys in two
    calls and Liger's kernel rotates both in one, so each call hands it a one-head dummy as its keys: each rotation
    does 1/H more work than Liger's own use would (a fair comparison would need a joint rotation in models/)."""
    rms = importlib.import_module("liger_kernel.transformers.rms_norm")
    swiglu = importlib.import_module("liger_kernel.ops.swiglu")
    rope = importlib.import_module("liger_kernel.ops.rope")
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                fast = rms.LigerRMSNorm(child.weight.shape[0], eps=child.eps, casting_mode="llama")
                fast.weight.data.copy_(child.weight.data)
                setattr(parent, child_name, fast)
            elif isinstance(child, FeedForward) and child.gated and child.act is F.silu:
                def ffn(self, x: torch.Tensor) -> torch.Tensor:
                    y = self.fc1(x)  # (B, T, 2 ff): Liger's function takes (tokens, 2 ff) only
                    h = swiglu.LigerFusedGateUpSiLUMulFunction.apply(y.reshape(-1, y.shape[-1]))  # (B*T, ff)
                    return self.fc2(h.view(*y.shape[:-1], -1))  # (B, T, d)

                child.forward = types.MethodType(ffn, child)

    def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # cos, sin: (T, hd) rotate-half tables, Liger's layout (HF Llama); x (B, H, T, hd)
        return rope.LigerRopeFunction.apply(x, x[:, :1], cos.to(x.dtype), sin.to(x.dtype))[0]

    @contextlib.contextmanager
    def patched():
        plain = attnlab_attention.apply_rope
        attnlab_attention.apply_rope = apply_rope
        try:
            yield
        finally:
            attnlab_attention.apply_rope = plain

    return patched()


def loss_kernel(name: str) -> str:
    """How an attnlab row computes its loss: plain | chunked | liger | cce."""
    for kernel in ("chunked", "liger", "cce"):
        if name == f"attnlab-{kernel}" or name.startswith(f"attnlab-{kernel}-") or name.endswith(f"-{kernel}"):
            return kernel
    return "plain"


# ------------------------------------------------------------------------------------------ one row
def make_batch(task: str, s: dict, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    if task == "encdec":
        src = torch.randint(3, s["vocab"], (s["batch"], s["src"]), generator=g)  # (B, S)
        tgt = torch.randint(3, s["vocab"], (s["batch"], s["tgt"] + 1), generator=g)  # (B, T+1)
        return src.to(device), tgt[:, :-1].to(device), tgt[:, 1:].to(device)
    ids = torch.randint(3, s["vocab"], (s["batch"], s["seq"] + 1), generator=g)  # (B, T+1)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def build(task: str, name: str, cfg: ModelConfig, mode: str, loss_chunk: int, compile_kw: dict | None = None,
          chunk_tokens: int = LIGER_CHUNK_TOKENS):
    """(model, forward callable, loss function of (forward, batch))."""
    smoothing = SMOOTHING[task]
    if name.startswith("attnlab"):
        model = build_model(cfg)
        kernel = loss_kernel(name)

        def loss_fn(fwd, batch):
            out = fwd(*batch[:-1], return_hidden=kernel != "plain")  # (B, T, d) hidden or (B, T, V) logits
            w = model.head.weight if model.head is not None else model.output_embedding().weight  # (V, d)
            if kernel == "chunked":
                loss_sum, _, n = linear_cross_entropy(out, w, batch[-1], PAD, smoothing, chunk=loss_chunk)
            elif kernel in ("liger", "cce"):
                loss_sum, _, n = fused_linear_cross_entropy(out, w, batch[-1], PAD, smoothing, impl=kernel,
                                                            with_nll=False, chunk_tokens=chunk_tokens)
            else:
                loss_sum, _, n = token_loss(out, batch[-1], PAD, smoothing)
            return loss_sum / n
    else:
        model = PEERS[task][name](cfg)

        def loss_fn(fwd, batch):
            logits = fwd(*batch[:-1])  # (B, T, V)
            return F.cross_entropy(logits.float().flatten(0, 1), batch[-1].flatten(), ignore_index=PAD,
                                   label_smoothing=smoothing)
    if mode == "compile" and name.startswith("attnlab-blocks"):  # attnlab's trainer.compile: each block, dynamic
        for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)):
            if stack is not None:
                for layer in stack.layers:
                    layer.compile(dynamic=True, **(compile_kw or {}))
        return model, model, loss_fn
    return model, (torch.compile(model, **(compile_kw or {})) if mode == "compile" else model), loss_fn


def recipe_shape(recipe: Path, length: int) -> tuple[dict, ModelConfig]:
    """The encdec shape of a translation recipe: its model, its data.vocab_size, and a batch of data.max_tokens
    tokens as pairs of `length` source and target tokens (what its token-count batches hold at that length)."""
    exp = load_experiment(recipe)
    if exp.task != "translation":
        raise SystemExit(f"--recipe {recipe}: a translation recipe is needed (model.arch=encoder_decoder)")
    s = dict(batch=max(1, exp.data.max_tokens // length), src=length, tgt=length, vocab=exp.data.vocab_size)
    cfg = exp.model.replace(vocab_size=s["vocab"], src_vocab_size=0, max_seq_len=max(exp.model.max_seq_len, length))
    return s, cfg


def measure(env: Env, task: str, name: str, mode: str, args: argparse.Namespace) -> dict:
    s = SHAPES["small" if env.small else "full"][task]
    cfg = encdec_config(s) if task == "encdec" else lm_config(s)
    if args.recipe is not None and task == "encdec":
        s, cfg = recipe_shape(args.recipe, args.length)
    if name == "attnlab-liger-all" and mode == "compile":  # its compile spent a minute of device time, then failed
        raise Missing("Liger's RMSNorm, SwiGLU and RoPE failed under torch.compile(model) (torch 2.11 on an H100, "
                      "2026-11-26: InductorError KeyError 'op541'); the eager row runs them")
    kernel = loss_kernel(name) if name.startswith("attnlab") else "plain"
    if kernel in ("liger", "cce"):  # skipped, with the reason, where the library cannot run this loss here
        try:
            resolve_fused_loss(kernel, env.device.type, SMOOTHING[task])
        except ConfigError as e:
            raise Missing(str(e)) from None
    reset_memory(env.device)
    torch.manual_seed(0)
    compile_kw = {"backend": args.compile_backend, "mode": args.compile_mode}
    model, fwd, loss_fn = build(task, name, cfg, mode, args.loss_chunk or (16 if env.small else 4096), compile_kw,
                                args.liger_chunk_tokens)
    kernels = liger_everything(model) if name == "attnlab-liger-all" else contextlib.nullcontext()
    model.to(env.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=env.cuda or None)
    batch = make_batch(task, s, env.device)

    def step():
        with torch.autocast(env.device.type, dtype=env.amp or torch.float32, enabled=env.amp is not None):
            loss = loss_fn(fwd, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with kernels:
        warm, per_step = time_steps(step, args.warmup, args.steps, env.device)
        if args.profile and name.startswith("attnlab"):
            profile(step, f"{task}/{name} ({mode})", env.device, per_step)
    T = s["tgt"] if task == "encdec" else s["seq"]
    flops = training_flops(cfg, T, s["src"] if task == "encdec" else None)["total"] * s["batch"]
    out = {"params_M": sum(p.numel() for p in model.parameters()) / 1e6, "tokens_per_s": s["batch"] * T / per_step,
           "mfu_pct": 100 * flops / per_step / env.peak_flops, "peak_mem_GiB": peak_memory_gib(env.device),
           "warmup_s": warm}
    return out


def profile(step, title: str, device: torch.device, per_step: float) -> None:
    """Top kernels (CUDA) or operators (CPU) of one step by self time, whether a flash attention kernel ran, and on
    CUDA the kernels' summed time against the timed step's: near 100% the GPU is busy (faster kernels help), far
    below the host launches too slowly to keep it busy (fewer launches, CUDA graphs help)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    cuda = device.type == "cuda"
    with prof_ctx(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        sync(device)
    events = prof.key_averages()
    flash = any("flash" in e.key.lower() for e in events)
    print(f"\n--- profile of one step: {title}; a flash attention kernel ran: {flash}")
    if cuda:
        busy = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                   for e in events) / 1e6  # us -> s
        print(f"kernels {1e3 * busy:.2f} ms of a {1e3 * per_step:.2f} ms step: the GPU busy "
              f"{100 * busy / per_step:.0f}% of it")
    for sort in (("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)):
        try:
            print(events.table(sort_by=sort, row_limit=15, max_name_column_width=90), flush=True)
            return
        except (AttributeError, KeyError, ValueError):
            continue


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--modes", default="", help="eager,compile (default: both on CUDA, eager on a CPU)")
    p.add_argument("--tasks", default="encdec,lm")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first, compiling included (default 3; 2 small)")
    p.add_argument("--loss-chunk", type=int, default=0, help="tokens per chunk of attnlab-chunked (default 4096)")
    p.add_argument("--liger-chunk-tokens", type=int, default=LIGER_CHUNK_TOKENS,
                   help=f"tokens of each chunk of the liger rows (default {LIGER_CHUNK_TOKENS}; 0: liger's default)")
    p.add_argument("--profile", action="store_true", help="top kernels (CPU: ops) of a step of each attnlab row")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: trace only)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--recipe", type=Path, help="encdec rows at this translation recipe's model and batch size")
    p.add_argument("--length", type=int, default=32, help="with --recipe: source and target tokens per pair")
    args = p.parse_args(argv)
    env = make_env(args)
    args.steps = args.steps or 10
    args.warmup = args.warmup or (2 if env.small else 3)
    modes = [m for m in (args.modes or ("eager,compile" if env.cuda else "eager")).split(",") if m]
    print(env.describe(), flush=True)
    rows: list[dict] = []
    for task in args.tasks.split(","):
        names = ["attnlab", "attnlab-chunked", "attnlab-liger", "attnlab-cce",
                 *(["attnlab-liger-all"] if task == "lm" else []), *PEERS[task]]
        for mode in modes:
            for name in names + (["attnlab-blocks", "attnlab-blocks-liger"] if mode == "compile" else []):
                if selected(f"{task}/{name}", args.only):
                    run_row(rows, {"task": task, "model": name, "mode": mode},
                            lambda t=task, n=name, m=mode: measure(env, t, n, m, args))
    print()
    print(env.describe())
    print_table(rows, [("task", "task"), ("model", "model"), ("mode", "mode"), ("params_M", "params (M)"),
                       ("tokens_per_s", "tokens/s"), ("mfu_pct", "MFU %"), ("peak_mem_GiB", "peak mem (GiB)"),
                       ("warmup_s", "warm-up s"), ("status", "status")])
    write_json(args.json, env, rows, sys.argv)
    return rows


if __name__ == "__main__":
    main()
