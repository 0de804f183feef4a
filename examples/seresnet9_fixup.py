"""SE-ResNet9-Fixup, the visual encoder of the bps-nav DD-PPO agent.

Re-implemented from the network's description in Shacklett et al., "Large Batch Simulation for
Deep Reinforcement Learning", ICLR 2021, arXiv 2103.07013 (the original is ``se_resnet9_fixup``
in bps-nav). Fixup: Zhang et al., "Fixup Initialization", ICLR 2019. Squeeze-and-excitation:
Hu et al., CVPR 2018.

Input (N, C, 64, 64) NCHW; ``se_resnet9_fixup`` returns (N, 512, 2, 2) and ``bps_visual_encoder``
(N, 512). The in-place ``relu_`` and ``nn.ReLU(inplace=True)`` of the original are kept on purpose:
the compiler must turn them into SSA form itself.

Use as a ``MODEL_REF`` for the CLI: ``examples.seresnet9_fixup:se_resnet9_fixup``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SpaceToDepth", "SqueezeExcitation", "SEFixupBlock", "SEResNet9Fixup",
           "se_resnet9_fixup", "bps_visual_encoder", "randomize_"]


class SpaceToDepth(nn.Module):
    """(N, C, H, W) -> (N, b*b*C, H/b, W/b) with
    ``out[(dh*b+dw)*C + c, hb, wb] = x[c, b*hb+dh, b*wb+dw]``."""

    def __init__(self, block: int = 4):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        b = self.block
        x = x.view(n, c, h // b, b, w // b, b)
        x = x.permute(0, 3, 5, 1, 2, 4)
        return x.reshape(n, b * b * c, h // b, w // b)


class SqueezeExcitation(nn.Module):
    """SE gate: ``x * sigmoid(fc2(relu(fc1(mean_hw(x)))))``, reduction ``r`` (both Linears with
    bias)."""

    def __init__(self, planes: int, reduction: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(planes, planes // reduction)
        self.fc2 = nn.Linear(planes // reduction, planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[:2]
        s = x.mean((2, 3))
        g = torch.sigmoid(self.fc2(F.relu(self.fc1(s), inplace=True)))
        return x * g.view(n, c, 1, 1)


class SEFixupBlock(nn.Module):
    """SE-Fixup basic block with five learnable scalars (bias1a, bias1b, bias2a, scale, bias2b)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, reduction: int = 16):
        super().__init__()
        self.bias1a = nn.Parameter(torch.zeros(1))
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bias1b = nn.Parameter(torch.zeros(1))
        self.relu = nn.ReLU(inplace=True)
        self.bias2a = nn.Parameter(torch.zeros(1))
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.scale = nn.Parameter(torch.ones(1))
        self.bias2b = nn.Parameter(torch.zeros(1))
        self.se = SqueezeExcitation(planes, reduction)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.AvgPool2d(3, stride=stride, padding=1),  # count_include_pad=True
                nn.Conv2d(inplanes, planes, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x + self.bias1a
        out = self.relu(self.conv1(a) + self.bias1b)
        out = self.conv2(out + self.bias2a)
        out = out * self.scale + self.bias2b
        identity = x if self.downsample is None else self.downsample(a)
        y = self.se(out) + identity
        y.relu_()
        return y


class SEResNet9Fixup(nn.Module):
    """Stem (SpaceToDepth(4), 1x1 conv 16C->64, ReLU) and four SE-Fixup blocks:
    (N,C,64,64) -> (N,512,2,2)."""

    def __init__(self, in_channels: int = 3, base_planes: int = 64):
        super().__init__()
        p = base_planes
        self.space_to_depth = SpaceToDepth(4)
        self.conv1 = nn.Conv2d(16 * in_channels, p, 1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.layer0 = SEFixupBlock(p, p, 1)
        self.layer1 = SEFixupBlock(p, 2 * p, 2)
        self.layer2 = SEFixupBlock(2 * p, 4 * p, 2)
        self.layer3 = SEFixupBlock(4 * p, 8 * p, 2)
        self._fixup_init(num_layers=4)

    def _fixup_init(self, num_layers: int) -> None:
        for m in (self.layer0, self.layer1, self.layer2, self.layer3):
            planes = m.conv1.out_channels
            std = math.sqrt(2.0 / (planes * 9)) * num_layers ** -0.5
            nn.init.normal_(m.conv1.weight, 0.0, std)
            nn.init.zeros_(m.conv2.weight)
            if m.downsample is not None:
                nn.init.normal_(m.downsample[1].weight, 0.0, math.sqrt(2.0 / planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv1(self.space_to_depth(x)))
        x = self.layer0(x)
        x = self.layer1(x)
        x = self.layer2(x)
        return self.layer3(x)


class BPSVisualEncoder(nn.Module):
    """The agent's encoder: ResNet, compression conv3x3 512->256 (bias) + ReLU, Flatten,
    Linear(1024->512, no bias), LayerNorm(512), ReLU. (N, C, 64, 64) -> (N, 512)."""

    def __init__(self, in_channels: int = 3):
        super().__init__()
        self.backbone = SEResNet9Fixup(in_channels)
        self.compression = nn.Sequential(nn.Conv2d(512, 256, 3, padding=1, bias=True),
                                         nn.ReLU(inplace=True))
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(256 * 2 * 2, 512, bias=False),
                                nn.LayerNorm(512), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.compression(self.backbone(x)))


def se_resnet9_fixup(in_channels: int = 3, base_planes: int = 64) -> SEResNet9Fixup:
    """The encoder backbone, output (N, 8*base_planes, H/32, W/32); 4,938,256 parameters for C=3."""
    return SEResNet9Fixup(in_channels, base_planes)


def bps_visual_encoder(in_channels: int = 3) -> BPSVisualEncoder:
    """The backbone plus the agent's compression and projection, output (N, 512)."""
    return BPSVisualEncoder(in_channels)


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter non-zero values (Fixup zeros hide bugs in numerics tests).

    Scalars are drawn from U(-0.5, 0.5) (``scale`` from U(0.5, 1.5)), zero-initialized conv2
    weights from N(0, 1/fan_in), and any other all-zero parameter (LayerNorm bias) from
    U(-0.5, 0.5).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.numel() == 1:
            base = 1.0 if name.endswith("scale") else 0.0
            p.copy_(base + torch.rand(p.shape, generator=gen) - 0.5)
        elif name.endswith("conv2.weight"):
            fan_in = p[0].numel()
            p.copy_(torch.randn(p.shape, generator=gen) * math.sqrt(1.0 / fan_in))
        elif not p.any():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return model


def randomized_se_resnet9_fixup() -> SEResNet9Fixup:
    """The RGB backbone (C=3) with :func:`randomize_` parameters: a ``MODEL_REF`` factory for
    ``fusion-compiler check`` and ``bench`` (Fixup's zero-initialized weights would leave outputs
    that prove nothing)."""
    return randomize_(se_resnet9_fixup(3))


def randomized_se_resnet9_fixup_depth() -> SEResNet9Fixup:
    """The depth backbone (C=11, the agent's depth and semantic channels), randomized likewise."""
    return randomize_(se_resnet9_fixup(11))
