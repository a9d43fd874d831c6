"""Training options the README promises, each run for real on the tiny recipe of test_train: optim.accumulate (one
step on the joined batch), optim.grad_clip (the norm the optimizer sees), trainer.keep_checkpoints (pruning),
trainer.max_time_min (a clean stop with checkpoints), trainer.compile (the eager losses), trainer.deterministic
(torch's flags during the fit only)."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from attnlab import intervals
from attnlab.checkpoints import load_checkpoint
from attnlab.evaluate import load_module
from attnlab.experiment import load_experiment
from attnlab.intervals import stretched
from attnlab.launch.requeue import unused_allocation
from attnlab.lit import Seq2SeqModule
from attnlab.train import fit, make_module, make_trainer, prepare
from test_train import read_metrics, write_recipe


class Grads(Callback):
    """The gradients as the optimizer used them (after normalisation and clipping), read at the end of each
    optimizer step: Lightning zeroes them only at the next step's start."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.grads.append({n: p.grad.clone() for n, p in pl_module.model.named_parameters()})


def one_step(exp, batches: list[dict], root, **overrides) -> tuple[Grads, dict[str, torch.Tensor], dict]:
    """One optimizer step of a fresh module (the seed's initial weights) over `batches`: the gradients it used, the
    weights after it and the metrics it logged."""
    dm, exp = prepare(exp.replace(optim=exp.optim.replace(**overrides)))
    module, grads = make_module(exp, dm), Grads()
    trainer = make_trainer(exp, root, extra_callbacks=[grads], logger=False, max_steps=1, enable_progress_bar=False)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return grads, {n: p.detach().clone() for n, p in module.model.named_parameters()}, trainer.callback_metrics


def joined(a: dict, b: dict) -> dict:
    """Two translation batches as one: each tensor padded (with 0 = PAD) to the wider one, rows stacked."""
    out = {}
    for k in ("src", "tgt_in", "tgt_out"):
        width = max(a[k].shape[1], b[k].shape[1])
        out[k] = torch.cat([torch.nn.functional.pad(x[k], (0, width - x[k].shape[1])) for x in (a, b)])
    return out


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    return write_recipe(root, model={"dropout": 0.0}, trainer={"val_every": 1000})


def two_batches(recipe) -> tuple[object, list[dict]]:
    exp = load_experiment(recipe)
    dm, _ = prepare(exp)
    loader = iter(dm.train_dataloader())
    a = next(loader)
    b = next(x for x in loader if int(x["tgt_out"].ne(0).sum()) != int(a["tgt_out"].ne(0).sum()))
    return exp, [{k: a[k] for k in ("src", "tgt_in", "tgt_out")}, {k: b[k] for k in ("src", "tgt_in", "tgt_out")}]


def test_accumulate_equals_one_step_on_the_joined_batch(recipe, tmp_path):
    """optim.accumulate 2 over two batches of different token counts: the optimizer steps with the gradients of
    one step on the two batches joined (a mean of the two batches' means would differ). The gradients are compared:
    Adam's first update, g / (|g| + eps), turns float noise in a near-zero gradient into a full step."""
    exp, (a, b) = two_batches(recipe)
    n_a, n_b = (int(x["tgt_out"].ne(0).sum()) for x in (a, b))
    acc, _, _ = one_step(exp, [a, b], tmp_path / "acc", accumulate=2)
    one, _, _ = one_step(exp, [joined(a, b)], tmp_path / "one", accumulate=1)
    assert len(acc.grads) == len(one.grads) == 1
    for name, g in one.grads[0].items():
        torch.testing.assert_close(acc.grads[0][name], g, rtol=1e-4, atol=1e-7, msg=name)
    # per-batch means averaged would weight the batches' tokens 1/(2 n_a) and 1/(2 n_b) instead of 1/(n_a + n_b)
    only_a, _, _ = one_step(exp, [a], tmp_path / "a")
    only_b, _, _ = one_step(exp, [b], tmp_path / "b")
    name = "decoder.layers.0.ffn.fc2.weight"
    mean_of_means = (only_a.grads[0][name] + only_b.grads[0][name]) / 2
    token_weighted = (n_a * only_a.grads[0][name] + n_b * only_b.grads[0][name]) / (n_a + n_b)
    torch.testing.assert_close(acc.grads[0][name], token_weighted, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(acc.grads[0][name], mean_of_means, rtol=1e-3, atol=1e-6)


def test_val_every_counts_optimizer_steps_with_accumulation(tmp_path):
    """trainer.val_every 2 with optim.accumulate 2: a validation every 2 optimizer steps (4 batches), at the same
    steps as without accumulation; Lightning's val_check_interval counts batches (it validated every step). Within
    one epoch: at an epoch's end Lightning steps on a partial window, and batches and steps drift apart."""
    at = {}
    for k in (1, 2):
        recipe = write_recipe(tmp_path, f"acc{k}", optim={"accumulate": k},
                              trainer={"max_steps": 4, "val_every": 2, "ckpt_every": 4, "run_name": f"acc{k}"},
                              decode={"val_sentences": 0})
        at[k] = sorted(read_metrics(fit(load_experiment(recipe)) / "logs" / "metrics.csv")["val/loss"])
    assert at[2] == at[1] == [1, 3], at


def test_grad_clip_caps_the_norm_the_optimizer_sees(recipe, tmp_path):
    """optim.grad_clip c: the logged train/grad_norm is the norm before clipping; the optimizer steps with the
    gradients scaled down to norm c; without clipping it steps with the unclipped ones."""
    exp, (a, _) = two_batches(recipe)
    free, w_free, m_free = one_step(exp, [a], tmp_path / "free")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in free.grads[0].values()]))
    assert float(m_free["train/grad_norm"]) == pytest.approx(float(norm), rel=1e-5)
    c = float(norm) / 4
    clipped, w_clipped, m_clipped = one_step(exp, [a], tmp_path / "clipped", grad_clip=c)
    assert float(m_clipped["train/grad_norm"]) == pytest.approx(float(norm), rel=1e-5)  # logged before clipping
    for name, g in free.grads[0].items():
        torch.testing.assert_close(clipped.grads[0][name], g * (c / norm), rtol=1e-4, atol=1e-8, msg=name)
    assert any(not torch.allclose(w_clipped[n], w_free[n]) for n in w_free)  # Adam's first step sees the difference


def test_keep_checkpoints_keeps_the_newest_step_checkpoints(tmp_path, caplog):
    recipe = write_recipe(tmp_path, trainer={"max_steps": 8, "ckpt_every": 2, "keep_checkpoints": 2,
                                             "val_every": 1000}, decode={"average_last": 3})
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        run_dir = fit(load_experiment(recipe))
    assert "trainer.keep_checkpoints=2 keeps fewer step checkpoints than decode.average_last=3" in caplog.text
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step=6.ckpt", "step=8.ckpt"]
    assert load_checkpoint(run_dir / "checkpoints" / "step=6.ckpt")["global_step"] == 6


def test_max_time_min_stops_cleanly_with_checkpoints(tmp_path):
    """trainer.max_time_min 0.05 (3 s) with a step budget it cannot reach: training stops on time, and the final
    state is saved as a step checkpoint and last.ckpt."""
    recipe = write_recipe(tmp_path, trainer={"max_steps": 100_000, "max_time_min": 0.05, "val_every": 100_000,
                                             "ckpt_every": 100_000})
    t0 = time.perf_counter()
    run_dir = fit(load_experiment(recipe))
    elapsed = time.perf_counter() - t0
    steps = sorted(read_metrics(run_dir / "logs" / "metrics.csv")["train/loss"])
    last = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert 0 < len(steps) < 100_000 and last["global_step"] == len(steps)
    assert (run_dir / "checkpoints" / f"step={len(steps)}.ckpt").exists()
    assert 3.0 <= elapsed < 60.0


def test_deterministic_turns_torchs_deterministic_algorithms_on_for_the_fit_only(tmp_path):
    """trainer.deterministic: torch's deterministic algorithms, cuDNN's autotuner off and cuBLAS's fixed workspace
    in every training and validation step (where a GPU's nondeterministic kernels would run); torch's flags as they
    were after the fit. Without it the fit leaves them alone. (Two such runs on a GPU: tests/test_gpu.py.)"""
    def flags() -> tuple:
        return (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    seen: list[tuple] = []

    class Flags(Callback):
        def on_train_batch_start(self, *args) -> None:
            seen.append(flags())

        def on_validation_batch_start(self, *args) -> None:
            seen.append(flags())

    before = flags()
    torch.backends.cudnn.benchmark = True  # a caller's own setting, to be given back
    callers = (before[0], True, before[2])  # the flags as this process has them (deterministic off: pytest's)
    try:
        for det in (True, False):
            recipe = write_recipe(tmp_path, name=f"d{int(det)}", trainer={"max_steps": 2, "val_every": 2,
                                                                          "deterministic": det})
            fit(load_experiment(recipe), callbacks=[Flags()])
            assert flags() == callers
            assert len(seen) >= 3 and set(seen) == ({(True, False, ":4096:8")} if det else {callers})
            seen.clear()
    finally:
        torch.backends.cudnn.benchmark = before[1]


@pytest.mark.slow
def test_compile_gives_the_eager_losses_and_a_checkpoint_that_loads_everywhere(tmp_path, monkeypatch):
    """trainer.compile (each block through torch.compile, the default inductor backend, on the CPU): the same
    per-step training losses as the eager run; blocks keep their class and parameter names, so the compiled run's
    checkpoint loads like any other (load_module: test, translate, demo, export, the final evaluation); the
    validation's beam search runs the blocks eagerly, so decoding compiles no graph per length."""
    losses, kinds, graphs, decoding = {}, {}, {}, []
    translate_ids = Seq2SeqModule.translate_ids

    def counted(self, *args, **kwargs):  # graphs compiled while the validation decodes
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out = translate_ids(self, *args, **kwargs)
        decoding.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        return out

    monkeypatch.setattr(Seq2SeqModule, "translate_ids", counted)

    class Kind(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            kinds[compiled] = {(type(b).__name__, b._compiled_call_impl is not None)
                               for s in (pl_module.model.encoder, pl_module.model.decoder) for b in s.layers}

    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        recipe = write_recipe(tmp_path, name=f"c{int(compiled)}", model={"dropout": 0.0},
                              trainer={"max_steps": 3, "val_every": 3, "compile": compiled},
                              decode={"val_sentences": 8, "val_beam": 2, "max_len_b": 10})
        run_dir = fit(load_experiment(recipe), callbacks=[Kind()])
        graphs[compiled] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        logged = read_metrics(run_dir / "logs" / "metrics.csv")
        losses[compiled] = [v[0] for _, v in sorted(logged["train/loss"].items())]
        assert "val/bleu" in logged  # the validation decoded
        module = load_module(run_dir / "checkpoints" / "last.ckpt")  # strict: every weight by its plain name
        assert all("_orig_mod" not in k for k in module.state_dict())
    assert kinds == {False: {("Block", False)}, True: {("Block", True)}}
    assert len(losses[True]) == 3 and losses[True] == pytest.approx(losses[False], rel=1e-5)
    # decoding through the compiled blocks compiled 3 graphs even in this 10-token beam search (and one per new
    # cache state and length on longer ones); eagerly, none. Training and the validation loss compile the encoder
    # and decoder blocks in train and eval mode, each for a batch with and without padding (no mask) and a source
    # as long as the target or not (dynamic shapes guard on that equality)
    assert decoding and set(decoding) == {0}, decoding
    assert graphs[False] == 0 and 0 < graphs[True] <= 8, graphs


def test_a_checkpoint_of_blocks_wrapped_by_torch_compile_loads_with_plain_names(tmp_path):
    """Checkpoints written while compiled blocks were wrapped (`layers.N._orig_mod.<name>`) load everywhere."""
    recipe = write_recipe(tmp_path, trainer={"max_steps": 1, "val_every": 100})
    ckpt_path = fit(load_experiment(recipe)) / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    plain = dict(ckpt["state_dict"])
    ckpt["state_dict"] = {re.sub(r"(layers\.\d+)\.", r"\1._orig_mod.", k): v for k, v in plain.items()}
    assert any("._orig_mod." in k for k in ckpt["state_dict"])
    wrapped = tmp_path / "wrapped.ckpt"
    torch.save(ckpt, wrapped)
    module = load_module(wrapped)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in plain.items())


def test_fit_in_a_batch_script_without_srun_warns_and_does_not_wait_for_absent_tasks(tmp_path, monkeypatch, caplog):
    """`attnlab fit` run by an sbatch script itself (no srun step) in a 2-task, 4-GPU allocation: a warning at
    the default level names what goes unused and the fix, and the Trainer is one process (it does not take
    SLURM's 2 tasks for its own and wait for a second rank that never starts). Under srun: no warning."""
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    exp = load_experiment(write_recipe(tmp_path, trainer={"max_steps": 1, "val_every": 100}))
    assert make_trainer(exp, tmp_path / "run").world_size == 1
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        fit(exp)  # trains, on one device
    [warning] = [r for r in caplog.records if "not under srun" in r.getMessage()]
    assert "job 77" in warning.getMessage() and "2 tasks, 4 GPUs on this node" in warning.getMessage()
    assert "srun attnlab fit" in warning.getMessage() and warning.levelno == logging.WARNING
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # a task of an srun step
    assert unused_allocation() is None


def test_stretched_intervals_are_the_smallest_multiple_lasting_the_minimum():
    assert stretched(100, 0.1, 0.145) == 100  # the CPU the demo is sized for: 14.5 s >= 6 s, unchanged
    assert stretched(100, 0.1, 0.005) == 1200  # 100 steps of 5 ms last 0.5 s: 12 x 100 last 6 s
    assert stretched(500, 0.0, 0.005) == 500 and stretched(7, 1.0, 60.0) == 7
    # a fixed budget caps it at its last multiple: the ablation trial of 800 steps at 34 ms a step on an H100
    # (val_every 400, val_every_min 0.5) validated every 1,200 steps, so never, and every trial failed
    assert stretched(400, 0.5, 0.034, last=800) == 800 and stretched(400, 0.5, 0.034, last=1000) == 800
    assert stretched(400, 0.5, 0.034, last=-1) == 1200 and stretched(400, 0.5, 0.034, last=300) == 1200
    # where `every` divides the budget the stretched interval does too, so the last step validates: 300 steps,
    # every 15 wanting 45 gives 60 (validations at 60 ... 300), not 45 (the last at 270)
    assert stretched(15, 0.75, 1.0, last=300) == 60 and stretched(15, 0.75, 1.0, last=310) == 45
    assert stretched(10, 1.0, 0.1, last=70) == 70  # 60 wanted; 70 is the only multiple of 10 dividing 70 from 60 on
    # a run that ends at a time limit, not at max_steps (the demo: 10 minutes, max_steps 100,000): as wanted
    assert stretched(500, 0.5, 0.005, last=100_000) == 10_000 and stretched(500, 0.5, 0.005, 100_000, False) == 6_000


def test_only_a_run_without_a_time_limit_stretches_to_intervals_dividing_max_steps(tmp_path):
    for minutes, divide in ((0, True), (10, False)):
        exp = load_experiment(write_recipe(tmp_path, trainer={"max_time_min": minutes, "val_every_min": 0.5}))
        trainer = make_trainer(exp, tmp_path / f"run{minutes}", logger=False)
        [stretch] = [c for c in trainer.callbacks if isinstance(c, intervals.StretchIntervals)]
        assert stretch.divide is divide


def test_val_and_ckpt_every_min_stretch_the_step_intervals_of_a_fast_run(tmp_path, monkeypatch):
    """A run timed at 0.1 s a step (a fake clock over its steps 5..25): val_every 5 with val_every_min 0.05 (3 s)
    becomes every 30 steps, ckpt_every 5 with ckpt_every_min 0.02 (1.2 s) every 15; before the timing the step
    intervals hold. A resume from a checkpoint keeps the stretched intervals."""
    clock = iter([0.0, 2.0])
    monkeypatch.setattr(intervals, "perf_counter", lambda: next(clock))
    recipe = write_recipe(tmp_path, model={"dropout": 0.0},
                          trainer={"max_steps": 60, "val_every": 5, "ckpt_every": 5, "keep_checkpoints": 100,
                                   "val_every_min": 0.05, "ckpt_every_min": 0.02})
    run_dir = fit(load_experiment(recipe))
    ckpts = sorted(int(p.stem.split("=")[1]) for p in (run_dir / "checkpoints").glob("step=*.ckpt"))
    assert ckpts == [5, 10, 15, 20, 25, 30, 45, 60]
    vals = sorted(read_metrics(run_dir / "logs" / "metrics.csv")["val/loss"])  # CSV steps count from 0
    assert [s + 1 for s in vals] == [5, 10, 15, 20, 25, 30, 60]
    assert load_checkpoint(run_dir / "checkpoints" / "step=30.ckpt")["callbacks"]["StretchIntervals"] == {
        "steps": {"val": 30, "ckpt": 15}}
    for step in (45, 60):
        (run_dir / "checkpoints" / f"step={step}.ckpt").unlink()
    monkeypatch.setattr(intervals, "perf_counter", lambda: pytest.fail("a resumed run timed its steps again"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(load_experiment(recipe), ckpt_path=str(run_dir / "checkpoints" / "step=30.ckpt"))
    # the ModelCheckpoint's state was found under its (stretched) state key and restored
    assert not [w for w in caught if "callbacks used to create the checkpoint" in str(w.message)]
    ckpts = sorted(int(p.stem.split("=")[1]) for p in (run_dir / "checkpoints").glob("step=*.ckpt"))
    assert ckpts == [5, 10, 15, 20, 25, 30, 45, 60]  # not 35, 40: the stretched interval came back


def test_a_stretched_validation_interval_still_validates_at_the_end_of_a_step_budget(tmp_path, monkeypatch):
    """A run so fast that val_every_min would stretch val_every 5 past its 60-step budget (a fake clock over its
    steps 5..25: 0.1 s a step, 1 minute wanted: every 600 steps) validates at step 60, its last multiple of 5 (an
    ablation trial reads its metric from that validation)."""
    clock = iter([0.0, 2.0])
    monkeypatch.setattr(intervals, "perf_counter", lambda: next(clock))
    recipe = write_recipe(tmp_path, model={"dropout": 0.0},
                          trainer={"max_steps": 60, "val_every": 5, "ckpt_every": 5, "val_every_min": 1.0})
    run_dir = fit(load_experiment(recipe))
    vals = sorted(read_metrics(run_dir / "logs" / "metrics.csv")["val/loss"])  # CSV steps count from 0
    assert [s + 1 for s in vals] == [5, 10, 15, 20, 25, 60]  # unstretched until timed, then the capped 60


class _Micro(Callback):
    """Records each micro-batch's first ids; sends this process SIGTERM after micro-batch `kill_after`."""

    def __init__(self, kill_after: int | None = None) -> None:
        self.ids, self.kill_after = [], kill_after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ids.append(tuple(batch["ids"][:3].tolist()))
        if len(self.ids) == self.kill_after:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal: Lightning's handler records it


def test_sigterm_inside_an_accumulation_window_stops_after_its_step_and_resumes_exactly(tmp_path):
    """optim.accumulate 2, SIGTERM after the 5th micro-batch (inside step 3's window): the fit stops once step 3 is
    done, 6 micro-batches in, and the resumed run trains the uninterrupted run's micro-batches, in order, to the
    same weights. Stopped at once, the checkpoint recorded 5 micro-batches drawn but 2 steps' gradients, and the
    resumed run skipped the 5th micro-batch."""
    recipe = write_recipe(tmp_path, optim={"accumulate": 2}, model={"dropout": 0.0},
                          trainer={"max_steps": 5, "val_every": 1000, "ckpt_every": 1000})
    exp = load_experiment(recipe)
    full = _Micro()
    fit(exp.replace(trainer=exp.trainer.replace(run_name="full")), callbacks=[full])
    cut, rest = _Micro(kill_after=5), _Micro()
    with pytest.raises(SystemExit) as e:
        fit(exp.replace(trainer=exp.trainer.replace(run_name="cut")), callbacks=[cut])
    assert e.value.code == 128 + signal.SIGTERM
    saved = load_checkpoint(tmp_path / "runs" / "cut" / "checkpoints" / "last.ckpt")
    assert (saved["global_step"], saved["TranslationDataModule"]["batches"], len(cut.ids)) == (3, 6, 6)
    fit(exp.replace(trainer=exp.trainer.replace(run_name="cut")), ckpt_path="last", callbacks=[rest])
    assert cut.ids + rest.ids == full.ids
    a, b = (load_checkpoint(tmp_path / "runs" / n / "checkpoints" / "last.ckpt")["state_dict"] for n in ("full", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)
