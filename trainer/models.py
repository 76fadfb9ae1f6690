"""The model group: torchvision ResNets, CIFAR-style ResNets and a fast conv-BN-GELU net."""
import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet (depth 6n+2: 20, 32, 56, 110); `width` 16 is the original,
    larger widths give the wide variants, smaller the narrow ones."""

    def __init__(self, depth: int = 20, width: int = 16, num_classes: int = 10):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, 56, 110), not {depth}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if stage and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class BiasBatchNorm(nn.BatchNorm2d):
    """BatchNorm whose scale is fixed at 1: only the bias is learned. The speedruns freeze
    BN weights; a weight that never trains is simply not a parameter. Their BN uses a
    faster-moving average (momentum 0.4) and a tiny eps."""

    def __init__(self, channels: int):
        super().__init__(channels, eps=1e-12, momentum=0.4)
        del self.weight
        self.register_parameter("weight", None)

    def forward(self, x):
        # CUDA's batch-norm backward returns no bias gradient without a weight: pass ones.
        ones = torch.ones_like(self.bias)
        return F.batch_norm(x, self.running_mean, self.running_var, ones, self.bias, self.training,
                            self.momentum, self.eps)


class DiracConv(nn.Conv2d):
    """3x3 conv, no bias, initialized with an identity in its first in_channels filters,
    so that each group starts close to passing its input through."""

    def __init__(self, cin: int, cout: int):
        super().__init__(cin, cout, 3, padding=1, bias=False)
        w = self.weight.data
        nn.init.dirac_(w[:min(cin, cout)])


class ConvGroup(nn.Module):
    """conv-pool-BN-GELU, conv-BN-GELU: the speedrun net's unit of work."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = DiracConv(cin, cout)
        self.bn1 = BiasBatchNorm(cout)
        self.conv2 = DiracConv(cout, cout)
        self.bn2 = BiasBatchNorm(cout)

    def forward(self, x):
        x = nn.functional.gelu(self.bn1(nn.functional.max_pool2d(self.conv1(x), 2)))
        return nn.functional.gelu(self.bn2(self.conv2(x)))


class FastNet(nn.Module):
    """A VGG-like net for small images after the CIFAR-10 speedruns (airbench): a 2x2 stem
    conv of 2*3*2*2 = 24 filters (patch-whitened from the data when the recipe asks),
    conv-BN-GELU groups with max-pooling, a bias-free linear head whose logits are scaled
    by logit_scale (1/9; the Muon recipe 1/256). Where airbench gives the stem conv a bias,
    trained for the first epochs, the stem here is followed by a bias-only BatchNorm
    (stem_norm="bias": the planner places BN biases) or by nothing (stem_norm="none"):
    then a frozen stem has no parameter upstream of it, and backward skips the first
    group's input gradient and the stem's BatchNorm, 8% of the CIFAR recipe's training time
    (docs/BENCHMARKS.md). The recipes keep the bias and get most of that back by freezing
    the BatchNorm after a few epochs (trainer.stem_norm_freeze_epochs), statistics included."""

    def __init__(self, widths=(64, 256, 256), stem_width: int = 24, num_classes: int = 10,
                 logit_scale: float = 1 / 9, stem_norm: str = "bias", head_std: float = 0.0):
        super().__init__()
        self.stem = nn.Conv2d(3, stem_width, 2, bias=False)
        self.stem_bn = BiasBatchNorm(stem_width) if stem_norm == "bias" else nn.Identity()
        groups, cin = [], stem_width
        for w in widths:
            groups.append(ConvGroup(cin, w))
            cin = w
        self.groups = nn.Sequential(*groups)
        self.fc = nn.Linear(cin, num_classes, bias=False)
        if head_std:  # airbench94_muon starts its head at unit std; torch's is 1/sqrt(3 fan_in)
            with torch.no_grad():
                self.fc.weight.mul_(head_std / self.fc.weight.std())
        self.logit_scale = logit_scale

    def forward(self, x):
        x = self.groups(nn.functional.gelu(self.stem_bn(self.stem(x))))
        # max_pool2d over the whole map, not adaptive_max_pool2d: inductor compiles the first,
        # while the second's backward stays an atomic ATen kernel (5% of the compiled step)
        x = torch.flatten(nn.functional.max_pool2d(x, x.shape[2:]), 1)
        # scaled before the head, not after: in fp16 the unscaled logits of a large head overflow
        return self.fc(x * self.logit_scale)


TORCHVISION_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101")


def build_model(name: str, num_classes: int, depth: int = 20, width: int = 16, widths=(64, 256, 256),
                stem: str = "imagenet", stem_norm: str = "bias", logit_scale: float = 1 / 9,
                head_std: float = 0.0) -> nn.Module:
    """`stem=cifar` gives torchvision ResNets a 3x3 stride-1 first conv and no max-pool,
    the usual adaptation to 32x32 images."""
    if name in TORCHVISION_RESNETS:
        import torchvision  # slow to import: only for the models that need it
        model = getattr(torchvision.models, name)(num_classes=num_classes)
        if stem == "cifar":
            model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            model.maxpool = nn.Identity()
        return model
    if name == "cifar_resnet":
        return CifarResNet(depth, width, num_classes)
    if name == "fastnet":
        return FastNet(tuple(widths), num_classes=num_classes, logit_scale=logit_scale, stem_norm=stem_norm,
                       head_std=head_std)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(TORCHVISION_RESNETS)}, cifar_resnet, fastnet")
