"""The built-in demo model: a small ResNet-style CNN that is fast on CPU.

Its top-level children mirror torchvision's ResNet (``conv1, bn1, relu,
maxpool, layer1..layer4, avgpool, fc``) so tutorials and selectors carry over,
and its weights are a pure function of ``seed`` so a client can rebuild it.
"""

from __future__ import annotations

import torch
from torch import nn

#: Input signature of the demo model: NCHW float images, batch free.
DEMO_INPUT_SHAPE: tuple[int, ...] = (-1, 3, 32, 32)
DEMO_NUM_CLASSES = 10


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projected) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out: torch.Tensor = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        y: torch.Tensor = self.relu(out + identity)
        return y


class DemoResNet(nn.Module):
    """ResNet-style CNN for 32x32 RGB inputs with ``layer1..layer4``."""

    def __init__(self, num_classes: int = DEMO_NUM_CLASSES, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=False)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        widths = [width, width * 2, width * 4, width * 8]
        self.layer1 = self._stage(width, widths[0], stride=1)
        self.layer2 = self._stage(widths[0], widths[1], stride=2)
        self.layer3 = self._stage(widths[1], widths[2], stride=2)
        self.layer4 = self._stage(widths[2], widths[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3], num_classes)

    @staticmethod
    def _stage(in_planes: int, planes: int, stride: int) -> nn.Sequential:
        return nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return logits


def build_demo_model(seed: int = 0) -> DemoResNet:
    """Build the demo model with weights drawn deterministically from ``seed``.

    BatchNorm running statistics are randomised too, so eval-mode activations
    are not trivially normalised and layers have distinct distributions.
    """
    gen = torch.Generator().manual_seed(seed)
    model = DemoResNet()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
            elif name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                assert module.running_mean is not None and module.running_var is not None
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=gen))
                module.running_var.copy_(1.0 + 0.1 * torch.rand(module.running_var.shape, generator=gen))
    return model.eval()
