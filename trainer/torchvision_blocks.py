"""torchvision's ResNet blocks, each BatchNorm applying the ReLU after it and the last one
the residual add (trainer/norm.py's BatchNorm2d). Imported only for a model built of them:
torchvision takes a second to import, and its ops import torch._dynamo."""
import torchvision


class Bottleneck(torchvision.models.resnet.Bottleneck):
    """torchvision's, with each BatchNorm applying the ReLU after it, and bn3 the residual add."""

    def forward(self, x):
        out = self.conv3(self.bn2(self.conv2(self.bn1(self.conv1(x)))))
        return self.bn3(out, x if self.downsample is None else self.downsample(x))


class BasicBlock(torchvision.models.resnet.BasicBlock):
    """torchvision's, with each BatchNorm applying the ReLU after it, and bn2 the residual add."""

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x))), x if self.downsample is None else self.downsample(x))


# block class -> (its fused twin, the BatchNorms whose ReLU (and residual add) the twin leaves to them)
FUSED = {torchvision.models.resnet.Bottleneck: (Bottleneck, ("bn1", "bn2", "bn3")),
         torchvision.models.resnet.BasicBlock: (BasicBlock, ("bn1", "bn2"))}
