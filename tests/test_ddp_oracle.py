"""A DDP step checked against an oracle that is not the code under test: the same model in one process, on the
concatenation of both ranks' batches, its loss written here with torch's own cross-entropy (label smoothing,
z-loss) and normalised as attnlab normalises it: summed over every target token of the step, divided by their
count over both ranks (not a mean of each rank's mean). Its gradients and its weights after one plain AdamW step
must equal those of attnlab's 2-rank DDP fit (gloo, on this CPU). A DDP that does not all-reduce (a no-op
communication hook) leaves each rank with its own gradient and fails here, as does any other normalisation."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from attnlab.experiment import load_experiment
from attnlab.train import fit, make_module, prepare
from test_train import write_recipe

TESTS = Path(__file__).resolve().parent

DRIVER = """
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[3])
from lightning.pytorch.callbacks import Callback

from attnlab.experiment import load_experiment
from attnlab.train import fit
from test_ddp_oracle import Record

fit(load_experiment(sys.argv[1]), callbacks=[Record(Path(sys.argv[2]))])
"""


def noop_hook(state, bucket):  # no return annotation: DDP would check it, and this file's are strings
    """A DDP communication hook that leaves each rank's gradient bucket as it is (no all-reduce)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class Record(Callback):
    """Saves, per rank, the initial weights, the step's batches, and the gradients and weights after the step
    (on_train_batch_end of its last micro-batch: the optimizer has stepped, the gradients are not yet zeroed)."""

    def __init__(self, out: Path) -> None:
        self.out, self.batches = out, []

    def on_train_start(self, trainer, pl_module):
        self.init = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        if os.environ.get("ATTNLAB_ORACLE_NOOP_HOOK"):  # the defect the oracle must catch: DDP all-reduces nothing
            trainer.strategy.model.register_comm_hook(None, noop_hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = list(pl_module.model.named_parameters())
        torch.save({"world": trainer.world_size, "host": socket.gethostname(), "init": self.init,
                    "batches": self.batches,
                    "grads": {n: p.grad.clone() for n, p in params if p.grad is not None},
                    "after": {n: p.detach().clone() for n, p in params}},
                   self.out / f"rank{trainer.global_rank}.pt")


SMOOTHING, Z_LOSS, LR = 0.1, 1e-3, 2e-3
# Adam's first update is lr * g / (|g| + eps): with the default eps 1e-9 a gradient that is zero up to rounding
# (the attention's key bias: softmax ignores it) becomes +-lr either way; with 1e-6 such noise (1e-9) moves a
# weight by at most lr / 1000, so the weights are compared to 1e-5 (a wrong gradient moves them by up to 2 lr)
EPS = 1e-6


def summed_loss(model, batch, pad_id: int) -> tuple[torch.Tensor, int]:
    """(the batch's loss summed over its target tokens, their count): torch's cross-entropy, not attnlab's."""
    logits = model(batch["src"], batch["tgt_in"], src_padded=batch.get("src_padded", True)).float()  # (B, T, V)
    logits, target = logits.reshape(-1, logits.shape[-1]), batch["tgt_out"].reshape(-1)
    keep = target != pad_id
    ce = F.cross_entropy(logits, target, ignore_index=pad_id, label_smoothing=SMOOTHING, reduction="sum")
    z = torch.logsumexp(logits[keep], dim=-1)  # PaLM's z-loss: alpha * log(Z)^2 per token
    return ce + Z_LOSS * z.pow(2).sum(), int(keep.sum())


def oracle_grads(model, batches, pad_id: int, per_rank_mean: bool = False) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    sums, counts = zip(*(summed_loss(model, b, pad_id) for b in batches), strict=True)
    if per_rank_mean:  # what the oracle must tell apart: each rank's mean, averaged over the ranks
        loss = sum(s / n for s, n in zip(sums, counts, strict=True)) / len(batches)
    else:
        loss = sum(sums) / sum(counts)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def oracle_recipe(tmp_path: Path, **trainer) -> Path:
    return write_recipe(tmp_path, n_pairs=900, model={"dropout": 0.0, "z_loss": Z_LOSS},
                        optim={"lr": LR, "schedule": "constant", "warmup_steps": 0, "label_smoothing": SMOOTHING,
                               "eps": EPS, "accumulate": trainer.pop("accumulate", 1)},
                        trainer={"accelerator": "cpu", "max_steps": 1, "val_every": 1000, "ckpt_every": 1000,
                                 **trainer},
                        decode={"val_sentences": 0})


def check_against_the_oracle(exp, dm, batches: list[dict], saved: list[dict]) -> None:
    """Every saved rank holds the oracle's gradients on `batches` joined, and its weights after one AdamW step."""
    pad = exp.model.pad_id
    counts = [int((b["tgt_out"] != pad).sum()) for b in batches]
    assert counts[0] != counts[1], f"the batches have {counts} target tokens: equal counts test no weighting"
    model = make_module(exp, dm).model.float()
    model.load_state_dict(saved[0]["init"])
    want = oracle_grads(model, batches, pad)
    for s in saved:  # the gradient of the joined batch
        assert set(s["grads"]) == set(want)
        for name, g in want.items():
            torch.testing.assert_close(s["grads"][name], g, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    wrong = oracle_grads(model, batches, pad, per_rank_mean=True)
    assert max(float((wrong[n] - g).abs().max()) for n, g in want.items()) > 1e-4, "a mean of means would pass"

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(exp.optim.beta1, exp.optim.beta2),
                            eps=exp.optim.eps, weight_decay=0.0, foreach=False)
    model.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        p.grad = want.get(n)
    opt.step()
    moved = max(float((p.detach() - saved[0]["init"][n]).abs().max()) for n, p in model.named_parameters())
    assert moved > LR / 2, f"the step moved no weight by more than {moved}"
    for s in saved:  # the same weights after the step
        for name, p in model.named_parameters():
            torch.testing.assert_close(s["after"][name], p.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n} after the step: {m}")


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_a_two_rank_ddp_step_equals_one_process_on_both_batches(tmp_path):
    recipe = oracle_recipe(tmp_path, devices=2, strategy="ddp", run_name="ddp")
    dm, exp = prepare(load_experiment(recipe))  # caches built once, before two processes start
    (tmp_path / "driver.py").write_text(DRIVER, encoding="utf-8")
    r = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(recipe), str(tmp_path), str(TESTS)],
                       cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{k}.pt", weights_only=False) for k in (0, 1)]
    assert [s["world"] for s in ranks] == [2, 2] and [len(s["batches"]) for s in ranks] == [1, 1]
    check_against_the_oracle(exp, dm, [s["batches"][0] for s in ranks], ranks)


def test_an_accumulated_step_equals_one_step_on_both_micro_batches(tmp_path):
    """The DDP test's fast twin, in this process: optim.accumulate 2 goes through the same normalisation (the
    tokens of the whole optimizer step), without the ranks."""
    recipe = oracle_recipe(tmp_path, accumulate=2, run_name="acc")
    dm, exp = prepare(load_experiment(recipe))
    fit(exp, callbacks=[Record(tmp_path)])
    (saved,) = [torch.load(tmp_path / "rank0.pt", weights_only=False)]
    assert saved["world"] == 1 and len(saved["batches"]) == 2
    check_against_the_oracle(exp, dm, saved["batches"], [saved])
