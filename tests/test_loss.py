"""The fused loss op and test-time augmentation against torch."""
import pytest
import torch
from torch.nn import functional as F

from trainer import tta
from trainer.loss import cross_entropy_


def test_loss_gradient_and_metrics_equal_torch_with_label_smoothing():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 10, generator=g, requires_grad=True)
    labels = torch.randint(0, 10, (16,), generator=g, dtype=torch.int32)
    results = tuple(torch.zeros(1) for _ in range(3))
    grad = torch.empty(16, 10)
    scale = torch.tensor([8.0])
    cross_entropy_(logits, labels, 0.2, results, grad_out=grad, grad_scale=scale)
    expected = F.cross_entropy(logits, labels.long(), label_smoothing=0.2)
    expected.backward()
    torch.testing.assert_close(results[0], expected.detach().reshape(1))
    torch.testing.assert_close(grad, logits.grad * 8.0)
    top5 = torch.topk(logits, 5, 1).indices
    assert results[1].item() == (top5[:, 0] == labels).float().mean().item()
    assert results[2].item() == (top5 == labels[:, None]).any(1).float().mean().item()


def test_masked_examples_do_not_count():
    logits = torch.randn(6, 4)
    labels = torch.tensor([0, 1, 2, 3, 0, 1], dtype=torch.int32)
    mask = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.int8)
    results = tuple(torch.zeros(1) for _ in range(3))
    cross_entropy_(logits, labels, 0.0, results, mask=mask)
    torch.testing.assert_close(results[0], F.cross_entropy(logits[:4], labels[:4].long()).reshape(1))


def test_epoch_sums_count_hits_and_examples_exactly_against_float64():
    """ACCUM_METRICS: hits and examples are added as counts and the loss as a sum, so an
    epoch's accuracy, hits / examples on the host, is exact; a batch's top-1 is the float
    nearest its hits / examples. Summed as fp32 means times counts, 14 hits of 14 read 1.0000001."""
    g = torch.Generator().manual_seed(0)
    sums, expected = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    for n, padding, boost in ((14, None, 100.0), (14, None, 1.5), (10, 3, 1.5), (7, 7, 0.0), (13, 0, 100.0)):
        logits = torch.randn(n, 10, generator=g, dtype=torch.float64)
        labels = torch.randint(0, 10, (n,), generator=g)
        logits[torch.arange(n), labels] += boost  # 100: every example a hit
        mask = None if padding is None else (torch.arange(n) < n - padding).to(torch.int8)
        results = tuple(torch.zeros(1) for _ in range(3))
        cross_entropy_(logits.float(), labels, 0.0, results, mask=mask, sums=sums)
        keep = torch.ones(n, dtype=torch.bool) if mask is None else mask.bool()
        x = logits.float().double()[keep]
        hits = torch.topk(x, 5, 1).indices == labels[keep, None]
        top1, top5, examples = hits[:, 0].sum().item(), hits.any(1).sum().item(), keep.sum().item()
        expected += torch.tensor([F.cross_entropy(x, labels[keep], reduction="sum").item(), top1, top5, examples],
                                 dtype=torch.float64)
        if examples:
            assert results[1].item() == torch.tensor(top1 / examples, dtype=torch.float32).item()
            assert results[2].item() == torch.tensor(top5 / examples, dtype=torch.float32).item()
    assert torch.equal(sums[1:].double(), expected[1:])
    torch.testing.assert_close(sums[0].double(), expected[0], rtol=1e-6, atol=0)
    assert expected[1] < expected[3], "some batches have misses"


def test_non_finite_loss_raises_the_sticky_flag():
    flag = torch.zeros(1, dtype=torch.int8)
    results = tuple(torch.zeros(1) for _ in range(3))
    cross_entropy_(torch.full((2, 3), float("nan")), torch.tensor([0, 1]), 0.0, results, nan_seen=flag)
    assert flag.item() == 1
    cross_entropy_(torch.randn(2, 3), torch.tensor([0, 1]), 0.0, results, nan_seen=flag)
    assert flag.item() == 1, "a finite loss after a NaN one leaves the flag raised"


def test_tta_logits_are_the_weighted_average_of_the_views():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(5))
    x = torch.randn(2, 3, 8, 8)
    model(x)
    assert torch.equal(tta.logits(model, x, 0), model(x))
    torch.testing.assert_close(tta.logits(model, x, 1), (model(x) + model(x.flip(-1))) / 2)
    pad = F.pad(x, (1, 1, 1, 1), mode="reflect")
    up_left, down_right = pad[..., :8, :8], pad[..., 2:, 2:]
    translated = sum(model(v) + model(v.flip(-1)) for v in (up_left, down_right)) / 4
    torch.testing.assert_close(tta.logits(model, x, 2), 0.5 * (model(x) + model(x.flip(-1))) / 2 + 0.5 * translated)


@pytest.mark.parametrize("level", [1, 2])
def test_tta_views_share_one_layout_so_a_compiled_model_compiles_once(level):
    """The arena's input: channels-last NHWC storage padded to 4 channels, seen as 3."""
    x = torch.randn(2, 8, 8, 4)[..., :3].permute(0, 3, 1, 2)
    layouts = {(v.shape, v.stride()) for _, v in tta.views(x, level)}
    assert len(layouts) == 1
