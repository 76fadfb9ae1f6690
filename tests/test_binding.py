"""bind(): the model computes in the arena exactly what it computed before."""
import copy

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import bound, small_cnn
from trainer.models import build_model
from trainer.regions import Region as R


@pytest.mark.parametrize("name", ["resnet18", "cifar_resnet", "fastnet"])
def test_bound_model_computes_what_it_computed_before(name):
    torch.manual_seed(0)
    model = build_model(name, 10).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    bound(model, classes=10, resolution=32)
    x = torch.randn(4, 3, 32, 32).to(memory_format=torch.channels_last)
    for mode in ("eval", "train"):
        getattr(model, mode)()
        getattr(reference, mode)()
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    # training-mode BN updated the running statistics in the arena like the original's
    ours = dict(model.named_buffers())
    for n, rb in reference.named_buffers():
        if not n.endswith("num_batches_tracked"):  # the trainer's step count replaces these
            torch.testing.assert_close(ours[n], rb, rtol=0, atol=0, msg=n)


def test_parameters_gradients_and_statistics_are_arena_views():
    model = small_cnn()
    plans, arena, _ = bound(model, amp=True)
    storage = arena.storage.untyped_storage().data_ptr()
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == storage and p.grad.untyped_storage().data_ptr() == storage
    conv = model[0]
    assert conv.weight.dtype == torch.float16 and conv.weight.grad.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32, "BN weights stay fp32 under AMP"
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert model[1].running_mean.untyped_storage().data_ptr() == storage
    # backward accumulates straight into the gradient regions
    F.cross_entropy(model(torch.randn(2, 3, 8, 8).half()).float(), torch.tensor([0, 1])).backward()
    assert arena.flat(R.G_FC_WEIGHT_FP16, R.G_DEEP_CONV_FP16).abs().sum() > 0
    assert arena.flat(R.G_BN_BIAS, R.G_BN_WEIGHT).abs().sum() > 0


def test_amp_model_matches_fp32_to_half_precision():
    model, reference = small_cnn(), small_cnn()
    bound(model, amp=True)
    x = torch.randn(4, 3, 8, 8)
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(x.half()).float(), reference(x), rtol=2e-2, atol=2e-2)


def test_under_amp_the_first_conv_reads_the_padded_input_buffer_in_place():
    """The input buffer holds 4 channels under AMP, the 4th zero; the first conv reads all
    4 as they lie (a step on 3 of them would copy the batch) and computes what it computes
    on the 3 real channels, gradients included."""
    model = small_cnn()
    plans, arena, _ = bound(model, amp=True)
    slot = arena.view(plans.tensors["train_base"].input.data["A"], padded=True)
    assert slot.shape[-1] == 4
    slot[..., :3].copy_(torch.randn(slot[..., :3].shape))
    x4 = slot.permute(0, 3, 1, 2)
    x3 = x4[:, :3].contiguous(memory_format=torch.channels_last)
    y = torch.arange(len(x4)) % 5
    grads = []
    for x in (x4, x3):
        model[0].weight.grad.zero_()
        logits = model(x)
        F.cross_entropy(logits.float(), y).backward()
        grads.append((logits.detach().clone(), model[0].weight.grad.clone()))
    assert grads[0][0].shape == (len(x4), 5)
    for ours, packed in zip(*grads):
        torch.testing.assert_close(ours, packed, rtol=0, atol=0)


@pytest.mark.parametrize("amp", [False, True])
def test_the_gradient_handover_fills_the_slots_as_accumulating_would_with_one_copy_per_dtype(amp):
    """Backward with the preset .grad adds each gradient into its arena slot, one kernel per
    parameter; the handover lets autograd keep the gradients it computes and copies them all
    in with one foreach copy per gradient dtype: the same values, and .grad is the slot again."""
    from trainer.binding import GradientHandover
    model = small_cnn()
    plans, arena, _ = bound(model, amp=amp)
    tensors = plans.tensors[plans.variants[0].name]
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float16 if amp else torch.float32), torch.tensor([0, 1, 2, 3])
    slots = [arena[t.g] for t in tensors.params.values()]
    F.cross_entropy(model(x).float(), y).backward()
    want = [s.clone() for s in slots]
    for s in slots:
        s.zero_()
    handover = GradientHandover(model, tensors, arena)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        handover.release()
        F.cross_entropy(model(x).float(), y).backward()
        handover.gather()
    assert all(torch.equal(s, w) for s, w in zip(slots, want)) and any(w.abs().sum() > 0 for w in want)
    assert all(p.grad.data_ptr() == arena[tensors.params[n].g].data_ptr() for n, p in model.named_parameters())
    events = prof.events()
    assert sum(e.name == "aten::_foreach_copy_" for e in events) == (2 if amp else 1)
    assert not [e for e in events if e.name == "aten::add_" and "AccumulateGrad" in getattr(e.cpu_parent, "name", "")]
