"""The CIFAR-10 speed recipes' tricks on the CPU: patch whitening, decoupled hyperparameters,
the bias block's learning-rate scale, the EMA's warm-up and period, fractional epochs, the
fast net's head, the Muon recipe's units."""
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import kernels.reference as reference
from tests.helpers import bound, hyper, small_cnn
from trainer.config import OptimizerConfig, compose_config
from trainer.dist import Dist
from trainer.plan import Baseline as B
from trainer.range_ops import RangeOps
from trainer.schedule import hyperparameters, total_steps
from trainer.setup import assemble
from trainer.whitening import whiten_first_conv


# -- patch whitening ---------------------------------------------------------------------
def correlated_images(n=64, size=9, seed=0) -> torch.Tensor:
    """Channels mixed and neighbouring pixels smoothed together, plus a little noise, so the
    patch covariance has eigenvalues from about 1 down to about eps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size + 1, size + 1, generator=g)
    x = (x[..., 1:, 1:] + x[..., :-1, 1:] + x[..., 1:, :-1] + x[..., :-1, :-1]) / 4  # spatial correlation
    mix = torch.tensor([[1.0, 0.8, 0.6], [0.8, 1.0, 0.7], [0.6, 0.7, 1.0]])
    x = torch.einsum("oc,nchw->nohw", mix, x)  # channel correlation
    return x + 0.02 * torch.randn(x.shape, generator=g)


def patch_covariance_eigenvalues(images: torch.Tensor, k: int) -> torch.Tensor:
    """Eigenvalues, largest first, of the (uncentered) covariance of every k x k patch, in
    float64; F.unfold orders a patch (c, kh, kw) as a conv's filter does."""
    patches = F.unfold(images.double(), k).transpose(1, 2).reshape(-1, images.shape[1] * k * k)
    return torch.linalg.eigvalsh(patches.T @ patches / len(patches)).flip(0)


def test_whitened_first_conv_decorrelates_the_patches():
    images, eps = correlated_images(), 5e-4
    conv = nn.Conv2d(3, 24, 2, bias=False)
    whiten_first_conv(conv, images, eps=eps)
    w = conv.weight.detach()
    assert torch.equal(w[12:], -w[:12]), "filters 12..23 are the negations of filters 0..11"
    # The conv's own outputs over every patch, in float64: their covariance is diagonal,
    # lambda / (lambda + eps) for the patch eigenvalues, largest component first.
    out = F.conv2d(images.double(), w.double()).permute(0, 2, 3, 1).reshape(-1, 24)[:, :12]
    covariance = out.T @ out / len(out)
    eigenvalues = patch_covariance_eigenvalues(images, 2)
    assert eigenvalues[-1] < 10 * eps < 0.1 < eigenvalues[0], "the data must make eps matter for some components"
    expected = torch.diag(eigenvalues / (eigenvalues + eps))
    torch.testing.assert_close(covariance, expected, rtol=0, atol=2e-4)


def test_whitening_keeps_the_init_of_filters_beyond_twice_the_patch_size():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 28, 2, bias=False)
    init = conv.weight.detach().clone()
    whiten_first_conv(conv, correlated_images())
    assert torch.equal(conv.weight[24:], init[24:])
    assert not torch.equal(conv.weight[:24], init[:24])


# -- decoupled hyperparameters -----------------------------------------------------------
def moved_per_1024_examples(h, batch: int, grad: float, weight: float = 0.0) -> float:
    """How far torch.optim.SGD (Nesterov, as the recipe) with these hyperparameters moves a
    weight over 1024 examples, once momentum has reached its steady state; the weight is
    held at `weight` (as the rest of training would hold it), so the decay term is constant."""
    w = torch.full((1,), weight, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=h.lr_weight, momentum=h.momentum, weight_decay=h.weight_decay, nesterov=True)
    moved = 0.0
    for step in range(600 + 1024 // batch):  # mu**600 < 1e-27: the momentum buffer has settled
        w.grad = torch.full_like(w, grad)
        opt.step()
        if step >= 600:
            moved += w.item() - weight
        with torch.no_grad():
            w.fill_(weight)
    return moved


def momentum_normalized(momentum: float) -> float:
    """What a decoupled value becomes per 1024 examples: a steady momentum step is
    m = 1/(1-mu) times lr * gradient, and a kilostep (airbench's kilostep_scale) counts
    1024 examples as 1 + m such steps, so the weight moves by the decoupled value times
    m / (1 + m). Independent of the batch size; of momentum only nearly (0.87 at mu=0.85,
    0.91 at mu=0.9)."""
    m = 1 / (1 - momentum)
    return m / (1 + m)


@pytest.mark.parametrize("momentum", [0.85, 0.9])
@pytest.mark.parametrize("batch", [256, 1024])
def test_decoupled_lr_is_the_move_per_1024_examples_whatever_the_batch(batch, momentum):
    lr, grad = 11.5, 0.3  # grad: of the batch-mean loss, so the same for every batch size
    h = hyperparameters(OptimizerConfig(name="nesterov", lr=lr, momentum=momentum, weight_decay=0.0,
                                        decoupled=True), batch)
    moved = moved_per_1024_examples(h, batch, grad)
    assert moved == pytest.approx(-lr * grad * momentum_normalized(momentum), rel=1e-9)


@pytest.mark.parametrize("momentum", [0.85, 0.9])
@pytest.mark.parametrize("batch", [256, 1024])
@pytest.mark.parametrize("lr", [2.0, 11.5])
def test_decoupled_weight_decay_is_the_shrink_per_1024_examples_whatever_the_lr(lr, batch, momentum):
    """Decoupled: weight decay removes wd of a weight per 1024 examples (in the same
    momentum-normalized units as the lr), whatever the learning rate and the batch size."""
    wd, weight = 0.0153, 2.0
    h = hyperparameters(OptimizerConfig(name="nesterov", lr=lr, momentum=momentum, weight_decay=wd,
                                        decoupled=True), batch)
    moved = moved_per_1024_examples(h, batch, grad=0.0, weight=weight)
    assert moved == pytest.approx(-wd * weight * momentum_normalized(momentum), rel=1e-9)


# -- the bias block's learning-rate scale ---------------------------------------------------
def recipe_engine(bias_weight_decay: bool):
    cfg = compose_config(["data.train_size=256", "data.val_size=64", "trainer.batch_size=32",
                          "optimizer.decoupled=true", "optimizer.lr=11.5", "optimizer.momentum=0.85",
                          "optimizer.weight_decay=0.0153", "optimizer.bias_lr_scale=64",
                          f"optimizer.bias_weight_decay={str(bias_weight_decay).lower()}"])
    return assemble(cfg, torch.device("cpu"))


def one_update(ops, weights: float, grads: float):
    """The arena's update from rest (zero momentum) with every weight and gradient set."""
    ops.s[B.STEP].zero_()
    ops.schedule()
    ops.w_all.fill_(weights)
    ops.g_all.fill_(grads)
    ops.m_bias.zero_()
    ops.m_weight.zero_()
    ops.s[B.OVERFLOW].zero_()
    ops.update()
    return ops.w_bias.clone(), ops.w_weight.clone()


@pytest.mark.parametrize("bias_weight_decay", [True, False])
def test_bias_block_learns_64x_faster_and_decays_per_step_like_the_weights(bias_weight_decay):
    ops = recipe_engine(bias_weight_decay).ops
    # The same gradient moves the bias block 64 times as far as the weights.
    bias, weight = one_update(ops, weights=0.0, grads=1.0)
    assert (weight < 0).all()
    torch.testing.assert_close(bias, torch.full_like(bias, 64 * weight[0].item()), rtol=1e-5, atol=0)
    # No gradient: decay shrinks the bias block by the same fraction per step as the
    # weights (lr_bias * wd_bias = lr * wd), or not at all without bias_weight_decay.
    bias, weight = one_update(ops, weights=1.0, grads=0.0)
    shrink = 1 - weight[0].item()
    assert shrink > 1e-4 and (weight == weight[0]).all()
    torch.testing.assert_close(bias, torch.full_like(bias, 1 - shrink if bias_weight_decay else 1.0),
                               rtol=0, atol=1e-6)


def test_bias_hyperparameters_scale_the_lr_and_keep_the_decay_per_step():
    o = OptimizerConfig(name="nesterov", lr=11.5, momentum=0.85, weight_decay=0.0153, decoupled=True,
                        bias_weight_decay=True, bias_lr_scale=64.0)
    h = hyperparameters(o, 1024)
    assert h.lr_bias == pytest.approx(64 * h.lr_weight)
    assert h.lr_bias * h.weight_decay_bias == pytest.approx(h.lr_weight * h.weight_decay) and h.weight_decay > 0
    o.bias_weight_decay = False
    assert hyperparameters(o, 1024).weight_decay_bias == 0.0


# -- EMA: its period and warm-up ------------------------------------------------------------
def test_ema_updates_every_few_steps_with_a_warming_up_decay():
    steps, every, power, decay = 20, 3, 2.0, 0.9
    model = small_cnn()
    plans, arena, _ = bound(model, steps=steps, ema=True)
    ops = RangeOps(plans.main, arena, reference, ema_every=every, ema_warmup_power=power)
    ops.init_scalars(hyper(), [0.05] * steps, 1.0)
    ops.set_ema_decay(decay)
    ops.e_all.copy_(torch.randn(ops.e_all.shape, generator=torch.Generator().manual_seed(3)))
    average = ops.e_all.double().clone()
    g = torch.Generator().manual_seed(1)
    for step in range(10):  # the program's order: update, ema, advance
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
        ops.schedule()
        ops.clear_grads()
        F.cross_entropy(model(x), y).backward()
        ops.grad_scaling()
        ops.update()
        live, before = ops.w_all.double().clone(), ops.e_all.clone()
        ops.ema()
        if step % every:
            assert torch.equal(ops.e_all, before), f"step {step}: no EMA update between periods"
        else:
            d = decay ** every * (step / steps) ** power  # 0 at step 0: the average starts as the weights
            average = d * average + (1 - d) * live
        torch.testing.assert_close(ops.e_all.double(), average, rtol=1e-6, atol=1e-7, msg=f"step {step}")
        ops.advance()
    assert not torch.allclose(ops.e_all, ops.w_all), "the average lags the live weights"


# -- fractional epochs ----------------------------------------------------------------------
def test_the_learning_rate_table_follows_each_schedule():
    """Spot values of each schedule's closed form, in float64, for the table the step indexes."""
    from trainer.config import ScheduleConfig
    from trainer.schedule import lr_multipliers
    warm = lr_multipliers(ScheduleConfig(name="cosine", warmup_epochs=1, warmup_start_fraction=0.1,
                                         final_fraction=0.2), 110, 10)
    assert warm.dtype == torch.float64 and len(warm) == 110
    assert warm[0] == 0.1 and warm[5] == pytest.approx(0.55) and warm[10] == 1  # linear from 0.1 over 10 steps
    assert warm[60] == pytest.approx(0.6) and warm[109] == pytest.approx(0.2 + 0.4 * (1 + math.cos(math.pi * 0.99)))
    step = lr_multipliers(ScheduleConfig(name="step", milestones=[1, 3], gamma=0.1), 50, 10)
    assert (step[9], step[10], step[29], step[30]) == pytest.approx((1, 0.1, 0.1, 0.01))
    assert lr_multipliers(ScheduleConfig(name="step", milestones=[1], gamma=math.inf), 20, 10)[9] == 1
    assert lr_multipliers(ScheduleConfig(name="linear"), 100, 10)[99] == pytest.approx(0.01)
    assert lr_multipliers(ScheduleConfig(name="poly", power=2, final_fraction=0.5), 100, 10)[50] == pytest.approx(
        0.5 + 0.5 * 0.25)
    assert torch.equal(lr_multipliers(ScheduleConfig(name="constant"), 7, 10), torch.ones(7, dtype=torch.float64))
    long = lr_multipliers(ScheduleConfig(), 10 ** 7, 100)  # a Python loop took seconds and gigabytes here
    assert long[0] == 1 and long[-1] == pytest.approx(0, abs=1e-12)


def test_a_milestone_that_falls_on_a_step_decays_the_learning_rate_from_that_step():
    """2.2 epochs of 25 steps are 55.00000000000001 in floating point (0.28 of them 7.000000000000001):
    the learning rate fell a step after its milestone, and a milestone on the run's last step was
    said to fall after its end."""
    from trainer.config import ScheduleConfig, unreached
    from trainer.schedule import lr_multipliers
    table = lr_multipliers(ScheduleConfig(name="step", milestones=[0.28, 2.2], gamma=0.1), 75, 25)
    assert (table[6], table[7], table[54], table[55]) == pytest.approx((1, 0.1, 0.1, 0.01))
    cfg = compose_config(["schedule=step", "schedule.milestones=[2.2]", "trainer.epochs=2.24"])
    assert unreached(cfg, 25, 56) == []


def test_total_steps_rounds_a_fractional_epoch_up():
    assert total_steps(1.5, 7) == 11 and total_steps(1.5, 8) == 12
    assert total_steps(9.9, 48) == 476  # the recipe: 9.9 epochs of 48 steps (49,152 of 50,000 examples)
    assert total_steps(2.0, 7) == 14 and total_steps(0.01, 7) == 1
    # 2.2 * 25 is 55.00000000000001 in floating point: one step more than asked, before the rounding
    assert total_steps(2.2, 25) == 55 and total_steps(0.28, 25) == 7 and total_steps(4.4, 25) == 110


def test_fractional_epochs_stop_the_last_epoch_part_way(tmp_path):
    from trainer.loop import Trainer
    # 56 examples in batches of 8: 7 steps an epoch, so 1.5 epochs are ceil(10.5) = 11 steps
    cfg = compose_config(["data.train_size=56", "data.val_size=16", "trainer.batch_size=8", "data.resolution=16",
                          "trainer.epochs=1.5"])
    trainer = Trainer(cfg, tmp_path, Dist())
    summary = trainer.fit()
    assert trainer.per_epoch == 7
    assert summary["steps"] == 11 == math.ceil(1.5 * 7)
    assert summary["epochs"] == round(11 / 7, 3) and [r["epoch"] for r in trainer.history] == [1, 2]
    assert trainer.images == 11 * 8, "the second epoch trains 4 of its 7 batches"
    assert trainer.ops.s[B.LR_SCHEDULE].numel() == 11


# -- the fast net's head -----------------------------------------------------------------
def test_fastnet_head_starts_at_head_std_and_takes_scaled_features():
    """head_std sets the head's initial std (0 keeps torch's); the logit scale multiplies the
    head's input, not its output, so that in fp16 the unscaled logits never exist."""
    from trainer.models import build_model
    torch.manual_seed(0)
    model = build_model("fastnet", 10, widths=(16, 32, 32), logit_scale=1 / 256, head_std=1.0).eval()
    assert model.fc.weight.std().item() == pytest.approx(1.0, rel=1e-5)
    assert build_model("fastnet", 10, widths=(16, 32, 32)).fc.weight.std() < 0.2, "0 keeps torch's init"
    seen = []
    model.fc.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    x = torch.randn(2, 3, 32, 32)
    logits = model(x)
    with torch.no_grad():
        features = model.groups(F.gelu(model.stem_bn(model.stem(x)))).amax((2, 3))
    torch.testing.assert_close(seen[0], features / 256)
    torch.testing.assert_close(logits, features @ model.fc.weight.T / 256)


def test_muon_recipe_is_airbench94_muon_in_mean_loss_units():
    """airbench94_muon sums its loss over 2000 examples with head lr 0.67, bias lr 0.053 and
    decay 2e-6 x 2000 per unit lr; ours is the batch mean, so the SGD part's lr is 2000x and
    the decay per step (lr x decay) the same 0.004 in both blocks."""
    cfg = compose_config(["+experiment=cifar10_speed", "data.root=/data"])
    h = hyperparameters(cfg.optimizer, cfg.trainer.batch_size)
    assert cfg.trainer.batch_size == 2000 and cfg.optimizer.name == "muon"
    assert h.lr_weight == pytest.approx(0.67 * 2000) and h.lr_bias == pytest.approx(0.053 * 2000, rel=1e-3)
    assert h.lr_weight * h.weight_decay == pytest.approx(0.004, rel=1e-3)
    assert h.lr_bias * h.weight_decay_bias == pytest.approx(0.004, rel=1e-3)
    assert (h.lr_muon, h.muon_momentum, cfg.optimizer.newton_schulz_steps) == (0.24, 0.6, 3)
