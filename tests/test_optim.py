"""Schedules against their formulas, AdamW groups, and the loss against torch's cross-entropy."""


import pytest
import torch
import torch.nn.functional as F

from attnlab.config import ConfigError, ModelConfig, OptimConfig
from attnlab.experiment import load_experiment
from attnlab.lit.loss import token_loss
from attnlab.lit.optim import lr_factor, make_optimizer, make_scheduler, param_groups, scale_grads_
from attnlab.models.transformer import build_model
from dispatch_count import DispatchCount


def test_noam_is_the_paper_formula():
    f = lr_factor(OptimConfig(schedule="noam", warmup_steps=4000), 512)
    for s in (1, 100, 3999, 4000, 4001, 50000):
        assert f(s - 1) == pytest.approx(512**-0.5 * min(s**-0.5, s * 4000**-1.5))
    peak = max(f(s) for s in range(0, 8000))
    assert peak == pytest.approx(f(3999))


def test_inverse_sqrt_cosine_wsd_constant():
    inv = lr_factor(OptimConfig(schedule="inverse_sqrt", warmup_steps=10), 512)
    assert inv(4) == pytest.approx(0.5) and inv(9) == pytest.approx(1.0) and inv(39) == pytest.approx(0.5)
    cos = lr_factor(OptimConfig(schedule="cosine", warmup_steps=10, max_steps=110, min_lr_ratio=0.1), 512)
    assert cos(9) == pytest.approx(1.0) and cos(59) == pytest.approx(0.55) and cos(109) == pytest.approx(0.1)
    wsd = lr_factor(OptimConfig(schedule="wsd", warmup_steps=10, max_steps=100, decay_fraction=0.2), 512)
    assert wsd(50) == 1.0 and wsd(79) == 1.0 and wsd(89) == pytest.approx(0.5) and wsd(99) == pytest.approx(0.0)
    const = lr_factor(OptimConfig(schedule="constant", warmup_steps=0), 512)
    assert const(0) == const(1000) == 1.0


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(2, 2)
    cfg = OptimConfig(lr=2.0, schedule="noam", warmup_steps=4)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg, d_model=16)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.0 * 16**-0.5 * min(s**-0.5, s * 4**-1.5) for s in range(1, 7)])
    assert opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["eps"] == 1e-9


def test_no_weight_decay_for_norms_biases_embeddings():
    model = build_model(ModelConfig(vocab_size=20, d_model=16, n_heads=2, n_enc_layers=1, n_dec_layers=1))
    decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("weight") and p.dim() == 2 and "embed" not in names[id(p)]
               for p in decay["params"])
    assert any("embed" in names[id(p)] for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    (one,) = param_groups(model, OptimConfig(weight_decay=0.1, decay_norms_biases_embeddings=True))
    assert one["weight_decay"] == 0.1


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_matches_torch_cross_entropy_and_ignores_padding(eps):
    torch.manual_seed(0)
    logits, target = torch.randn(3, 5, 11), torch.randint(1, 11, (3, 5))
    target[0, 3:] = 0
    loss, nll, n = token_loss(logits, target, pad_id=0, label_smoothing=eps)
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0, label_smoothing=eps,
                          reduction="sum")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5) and n.item() == 13
    assert nll.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0,
                                                       reduction="sum").item(), rel=1e-5)
    # padding positions carry no loss whatever their logits
    logits2 = logits.clone()
    logits2[0, 3:] = 100.0
    assert token_loss(logits2, target, 0, eps)[0].item() == pytest.approx(loss.item(), rel=1e-6)


def test_z_loss_adds_alpha_log_z_squared():
    torch.manual_seed(0)
    logits, target = torch.randn(2, 4, 7), torch.randint(1, 7, (2, 4))
    base = token_loss(logits, target, 0)[0]
    with_z = token_loss(logits, target, 0, z_loss=1e-2)[0]
    assert (with_z - base).item() == pytest.approx(1e-2 * torch.logsumexp(logits, -1).pow(2).sum().item(), rel=1e-5)


def test_bad_optim_values_name_the_key():
    with pytest.raises(ConfigError, match="optim.schedule='linear'"):
        OptimConfig(schedule="linear")
    with pytest.raises(ConfigError, match="optim.warmupsteps.*did you mean optim.warmup_steps"):
        OptimConfig.from_dict({"warmupsteps": 10})
    with pytest.raises(ConfigError, match=r"optim.beta2=1.5 must be in \[0, 1\)"):
        OptimConfig(beta2=1.5)
    with pytest.raises(ConfigError, match=r"optim.eps=0.0 must be > 0"):
        OptimConfig(eps=0.0)
    assert OptimConfig().eps == 1e-9  # the paper's epsilon (section 5.3)


def test_gradient_scaling_at_base_shape_is_a_few_multi_tensor_kernels():
    """One optimizer step's gradient scaling and norm at the base Transformer's shape: two foreach kernels and a
    stack (6 non-view operators), where a per-tensor loop takes 2 per tensor and a stack and norm (388 for these
    193 tensors); the result equals the per-tensor computation, and no value is read back to the host."""
    cfg = load_experiment("experiments/wmt14_en_de_base.yaml").model.replace(vocab_size=1000)
    grads = [torch.randn_like(p) for p in build_model(cfg).parameters()]
    want = [g * 0.25 for g in grads]
    with DispatchCount() as loop:  # the per-tensor loop, for the README's comparison
        copies = [g.clone() for g in grads]
        norms = [torch.linalg.vector_norm(g.mul_(0.25)) for g in copies]
        torch.linalg.vector_norm(torch.stack(norms))
    assert loop.launches - len(grads) == 388  # less the clones
    with DispatchCount() as c:
        norm = scale_grads_(grads, torch.tensor(0.25))
    assert c.launches <= 6 and c.syncs == 0, (c.launches, c.ops)
    assert len(grads) == 193
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    exact = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w.double()) for w in want]))
    assert float(norm) == pytest.approx(float(exact), rel=2e-5)
