"""Range ops against torch.optim and float64 references, byte-exact targeting, AMP skips."""
import pytest
import torch
from torch.nn import functional as F

import kernels.reference as reference
from tests.helpers import arena_step, batches, bound, hyper, small_cnn
from trainer.plan import Baseline as B
from trainer.range_ops import RangeOps
from trainer.regions import Region as R

STEPS = 20


def decay_groups(model, wd):
    """The trainer's split: weight decay on conv and FC weights, none on biases and BN."""
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() <= 1]
    return [dict(params=biases, weight_decay=0.0), dict(params=weights, weight_decay=wd)]


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_optimizer_equals_torch_optim(name):
    ref, model = small_cnn(), small_cnn()
    adam = name in ("adam", "adamw")
    h = hyper(lr=1e-3 if adam else 0.05, wd=1e-2)
    groups = decay_groups(ref, h.weight_decay)
    if adam:
        adam_class = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        opt = adam_class(groups, lr=h.lr_weight, betas=(0.9, 0.999), eps=1e-8)
    else:
        opt = torch.optim.SGD(groups, lr=h.lr_weight, momentum=0.0 if name == "sgd" else 0.9,
                              nesterov=name == "nesterov")
    _, _, ops = bound(model, optimizer=name)
    ops.init_scalars(h, [h.lr_weight] * STEPS, 1.0)
    for x, y in batches(STEPS):
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        arena_step(model, ops, x, y)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6, msg=f"{name}: {n}")


def lars_float64(params, grads_seq, h):
    """MLPerf LARS in float64: trust ratio on weights, momentum with lr inside on biases."""
    ws = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(w) for w in ws]
    for grads in grads_seq:
        for w, m, g in zip(ws, ms, grads):
            g = g.double()
            if w.dim() > 1:
                wn, gn = w.norm(), g.norm()
                trust = h.lars_eta * wn / (gn + h.weight_decay * wn) if wn > 0 and gn > 0 else 1.0
                m.mul_(h.momentum).add_(h.lr_weight * trust * (g + h.weight_decay * w))
            else:
                m.mul_(h.momentum).add_(h.lr_bias * g)
            w.sub_(m)
        yield ws


@pytest.mark.parametrize("name", ["nesterov", "adamw"])
def test_amp_update_reads_the_half_gradients_unscaled(name):
    """Under AMP backward leaves the weight block's gradients half precision and scaled,
    with no fp32 copy; the update unscales them as it reads them. The fp32 masters then
    move as torch.optim moves fp32 weights from the unscaled gradients (GradScaler's
    unscale_, then step)."""
    model = small_cnn()
    plans, arena, ops = bound(model, amp=True, optimizer=name)
    h = hyper(lr=1e-3 if name == "adamw" else 0.05)
    ops.init_scalars(h, [h.lr_weight] * STEPS, 1024.0)
    params = plans.tensors["train_base"].params
    masters = {n: arena[t.w] for n, t in params.items()}
    ref = {n: w.detach().clone().requires_grad_() for n, w in masters.items()}
    groups = [dict(params=[p for p in ref.values() if p.dim() <= 1], weight_decay=0.0),
              dict(params=[p for p in ref.values() if p.dim() > 1], weight_decay=h.weight_decay)]
    opt = torch.optim.AdamW(groups, lr=h.lr_weight, eps=1e-8) if name == "adamw" else \
        torch.optim.SGD(groups, lr=h.lr_weight, momentum=0.9, nesterov=True)
    for x, y in batches(3):
        ops.schedule()
        ops.clear_grads()
        (F.cross_entropy(model(x.half()).float(), y) * ops.s[B.LOSS_SCALE]).backward()
        for n, p in model.named_parameters():
            assert p.grad.dtype == (torch.float16 if p.dim() > 1 else torch.float32), n
            ref[n].grad = p.grad.float() / 1024
        ops.grad_scaling()
        ops.update()
        ops.cast_weights()
        ops.advance()
        opt.step()
        for n in ref:
            torch.testing.assert_close(masters[n], ref[n].detach(), rtol=2e-5, atol=2e-6, msg=f"{name}: {n}")
    assert ops.s[B.OVERFLOW].item() == 0 and ops.s[B.LOSS_SCALE].item() == 1024.0


def test_lars_equals_float64_reference():
    model = small_cnn()
    h = hyper(lr=2.0, wd=5e-4, eta=0.02)
    _, _, ops = bound(model, optimizer="lars")
    ops.init_scalars(h, [h.lr_weight] * STEPS, 1.0)
    initial = [p.detach().clone() for p in model.parameters()]
    grads_seq = [arena_step(model, ops, x, y) for x, y in batches(STEPS)]
    # Replay the same gradients through the float64 rule.
    *_, final = lars_float64(initial, grads_seq, h)
    for p, w in zip(model.parameters(), final):
        torch.testing.assert_close(p.double(), w, rtol=1e-5, atol=1e-6)


def poisoned(config: dict, classes=5):
    """Every region filled with its own value (finite, nonzero), so any byte an op writes
    that it should not shows up; the skip flag cleared so updates happen."""
    model = small_cnn()
    plans, arena, ops = bound(model, **config)
    for r in R:
        if plans.main.region_bytes(r):
            arena.flat(r).fill_(int(r) if r.name.endswith(("INT32", "INT8", "LABEL")) else 0.01 * int(r))
    ops.init_scalars(hyper(), [0.05] * STEPS, 1.0)
    ops.s[B.OVERFLOW].zero_()
    ops.s[B.STEP].zero_()
    ops.s[B.OPT_STEP].fill_(1)
    return model, plans, arena, ops


def changed_outside(arena, before, targets):
    """Bytes that changed although they lie outside every target range; and how many changed inside."""
    changed = (arena.storage != before).nonzero().flatten()
    inside = torch.zeros_like(changed, dtype=torch.bool)
    for start, end in targets:
        offset, nbytes = arena.plan.range(start, end)
        inside |= (changed >= offset) & (changed < offset + nbytes)
    return changed[~inside], int(inside.sum())


def scalar_range(plan, *baselines):
    return [(plan[b].region, plan[b].region) for b in baselines]


POISON_CASES = {
    "clear_grads": (dict(amp=True), lambda ops: ops.clear_grads(),
                    [(R.G_BN_BIAS, R.G_DEEP_CONV), (R.G_FC_WEIGHT_FP16, R.G_DEEP_CONV_FP16)]),
    "cast_weights": (dict(amp=True), lambda ops: ops.cast_weights(), [(R.A_FC_WEIGHT, R.A_DEEP_CONV)]),
    "update_adamw": (dict(optimizer="adamw"), lambda ops: ops.update(),
                     [(R.W_BN_BIAS, R.W_DEEP_CONV), (R.M_BN_BIAS, R.M_DEEP_CONV), (R.V_BN_BIAS, R.V_DEEP_CONV)]),
    "update_lars": (dict(optimizer="lars"), lambda ops: ops.update(),
                    [(R.W_BN_BIAS, R.W_DEEP_CONV), (R.M_BN_BIAS, R.M_DEEP_CONV), (R.N_FC_WEIGHT, R.N_DEEP_CONV)]),
    "update_muon": (dict(optimizer="muon"), lambda ops: ops.update(),
                    [(R.W_BN_BIAS, R.W_DEEP_CONV), (R.M_BN_BIAS, R.M_DEEP_CONV)]),
    # under AMP the update reads the half gradients (never writes them) and then moves the loss scale
    **{f"update_{opt}_amp": (dict(optimizer=opt, amp=True), lambda ops: ops.update(),
                             [(R.W_BN_BIAS, R.W_DEEP_CONV), (R.M_BN_BIAS, R.M_DEEP_CONV),
                              (R.N_FC_WEIGHT, R.N_DEEP_CONV), (R.S_SCALAR_FP32, R.S_SCALAR_INT32)])
       for opt in ("lars", "muon")},
    "ema": (dict(ema=True), lambda ops: ops.ema(), [(R.E_BN_BIAS, R.E_DEEP_CONV), (R.B_PREV_MEAN, R.B_PREV_VAR)]),
    "bn_stats": (dict(), lambda ops: ops.bn_stats_to_prev(), [(R.B_PREV_MEAN, R.B_PREV_VAR)]),
}


@pytest.mark.parametrize("case", sorted(POISON_CASES))
def test_range_op_writes_exactly_its_regions(case):
    config, op, targets = POISON_CASES[case]
    _, _, arena, ops = poisoned(config)
    before = arena.storage.clone()
    op(ops)
    outside, inside = changed_outside(arena, before, targets)
    assert outside.numel() == 0, f"{case} wrote {outside.numel()} bytes outside its regions"
    assert inside > 0, f"{case} changed nothing"


def test_grad_scaling_writes_gradients_and_state_scalars_only():
    _, plans, arena, ops = poisoned(dict(amp=True))
    before = arena.storage.clone()
    ops.grad_scaling()
    # the bias block's gradients, unscaled in place; the weight block's half ones are read only
    targets = [(R.G_BN_BIAS, R.G_FC_BIAS)] + scalar_range(plans.main, B.OVERFLOW, B.OPT_STEP)
    outside, inside = changed_outside(arena, before, targets)
    assert outside.numel() == 0 and inside > 0


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
@pytest.mark.parametrize("layer", [0, 3], ids=["first_conv", "deep_conv"])
def test_amp_overflow_skips_the_update_and_backs_off_the_scale(optimizer, layer):
    model = small_cnn(layers=3)
    plans, arena, ops = bound(model, amp=True, optimizer=optimizer)
    ops.init_scalars(hyper(lr=1e-3), [1e-3] * STEPS, 1024.0)
    (x, y), (x2, y2) = batches(2)
    x, x2 = x.half(), x2.half()
    moments = [(R.M_BN_BIAS, R.M_DEEP_CONV)] + ([(R.V_BN_BIAS, R.V_DEEP_CONV)] if optimizer == "adam" else [])
    state = lambda: torch.cat([arena.flat(R.W_BN_BIAS, R.W_DEEP_CONV)] + [arena.flat(*m) for m in moments]).clone()
    before = state()
    ops.schedule()
    ops.clear_grads()
    (F.cross_entropy(model(x).float(), y) * ops.s[B.LOSS_SCALE]).backward()
    # one fp16 gradient overflows: in the first conv (SGD's under Muon) or a deep one (Muon's)
    model[layer].weight.grad[0, 0, 0, 1] = float("inf")
    ops.grad_scaling()
    ops.update()
    ops.cast_weights()
    ops.advance()
    assert torch.equal(state(), before), "an overflowing step must leave weights and moments bit-identical"
    assert ops.s[B.OVERFLOW].item() == 1 and ops.s[B.LOSS_SCALE].item() == 512.0
    assert ops.s[B.OPT_STEP].item() == 0 and ops.s[B.STEP].item() == 1
    ops.schedule()
    ops.clear_grads()
    (F.cross_entropy(model(x2).float(), y2) * ops.s[B.LOSS_SCALE]).backward()
    ops.grad_scaling()
    ops.update()
    assert ops.s[B.OVERFLOW].item() == 0 and ops.s[B.OPT_STEP].item() == 1
    assert not torch.equal(state(), before), "the next clean step updates"


def test_loss_scale_grows_after_clean_steps():
    model = small_cnn()
    plans, arena, ops = bound(model, amp=True)
    ops.growth_interval = 3
    ops.init_scalars(hyper(), [0.05] * STEPS, 256.0)
    for _ in range(3):
        ops.clear_grads()
        ops.grad_scaling()
        ops.update()
    assert ops.s[B.LOSS_SCALE].item() == 512.0 and ops.s[B.GOOD_STEPS].item() == 0


def count_ops(fn) -> int:
    """Operators the range ops call directly (top-level in the profile): a loop over
    parameters would multiply these. Operators' internal helpers are left out, since
    CPU reductions split large inputs differently."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


@pytest.mark.parametrize("config", [dict(optimizer="momentum", ema=True), dict(optimizer="lars", amp=True),
                                    dict(optimizer="adamw", amp=True)])
def test_kernel_count_does_not_grow_with_layers(config):
    counts = []
    for layers in (50, 200):
        _, _, ops = bound(small_cnn(layers=layers), **config)
        ops.init_scalars(hyper(), [0.05] * STEPS, 1.0)

        def step():
            ops.schedule()
            ops.clear_grads()
            ops.grad_scaling()
            ops.update()
            if config.get("ema"):
                ops.ema()
            ops.cast_weights()
        counts.append(count_ops(step))
    assert counts[0] == counts[1], f"range ops issued {counts} operators for 50 and 200 layers"


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov", "adam", "adamw", "lars"])
def test_short_run_lowers_the_loss(name):
    model = small_cnn(classes=2)
    _, _, ops = bound(model, steps=60, optimizer=name, classes=2)
    lr = {"adam": 3e-3, "adamw": 3e-3, "lars": 1.0}.get(name, 0.1)
    ops.init_scalars(hyper(lr=lr, wd=1e-4, eta=0.01), [lr] * 60, 1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()  # learnable: the sign of the red channel's mean
    losses = []
    for _ in range(60):
        losses.append(F.cross_entropy(model(x), y).item())
        arena_step(model, ops, x, y)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, f"{name}: {losses[0]:.3f} -> {losses[-1]:.3f}"


@pytest.mark.parametrize("lookahead", [False, True])
def test_ema_averages_the_bn_statistics_and_lookahead_resets_them(lookahead):
    model = small_cnn()
    plans, arena, _ = bound(model, ema=True)
    ops = RangeOps(plans.main, arena, reference, ema_every=2, lookahead=lookahead)
    ops.init_scalars(hyper(), [0.05] * STEPS, 1.0)
    ops.set_ema_decay(0.8)
    stats = arena.flat(R.B_NEXT_MEAN, R.B_NEXT_VAR)
    average = stats.double().clone()
    for step, (x, y) in enumerate(batches(6)):  # the program's order: update, ema, advance
        ops.schedule()
        ops.clear_grads()
        F.cross_entropy(model(x), y).backward()
        ops.update()
        live = stats.double().clone()
        ops.ema()
        if step % 2 == 0:  # due every 2nd step, with the decay raised to that power
            average = 0.8 ** 2 * average + (1 - 0.8 ** 2) * live
            if lookahead:
                torch.testing.assert_close(stats.double(), average, rtol=1e-6, atol=1e-7)
        ops.advance()
    torch.testing.assert_close(arena.flat(R.B_PREV_MEAN, R.B_PREV_VAR).double(), average, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(stats.double(), average) or lookahead
    ops.bn_stats_to_prev()  # evaluation keeps the average
    torch.testing.assert_close(arena.flat(R.B_PREV_MEAN, R.B_PREV_VAR).double(), average, rtol=1e-6, atol=1e-7)


def test_sema_switch_is_an_exact_involution_and_evaluates_ema_weights():
    model = small_cnn()
    plans, arena, ops = bound(model, amp=True, ema=True)
    ops.init_scalars(hyper(), [0.05] * STEPS, 1.0)
    ops.set_ema_decay(0.5)
    for x, y in batches(3):
        arena_step(model, ops, x.half(), y)
        ops.ema()
    live = arena.storage.clone()
    ema_all = arena.flat(R.E_BN_BIAS, R.E_DEEP_CONV).clone()
    ema_weights = arena.flat(R.E_FC_WEIGHT, R.E_DEEP_CONV).clone()
    assert not torch.equal(ema_all, arena.flat(R.W_BN_BIAS, R.W_DEEP_CONV))
    ops.sema_switch()
    assert torch.equal(arena.flat(R.W_BN_BIAS, R.W_DEEP_CONV), ema_all)
    assert torch.equal(arena.flat(R.A_FC_WEIGHT, R.A_DEEP_CONV), ema_weights.half())
    ops.sema_switch()
    # E16 is scratch for the live half weights while EMA is in use; all else is restored.
    offset, nbytes = plans.main.range(R.E_FC_WEIGHT_FP16, R.E_DEEP_CONV_FP16)
    keep = torch.ones_like(live, dtype=torch.bool)
    keep[offset:offset + nbytes] = False
    assert torch.equal(arena.storage[keep], live[keep]), "switching twice restores every byte"
