"""SE-ResNet9-Fixup spelled the ways people write ResNet, SE and Fixup blocks: each a network of
the same function and the same parameters (in the same order) as
``examples.seresnet9_fixup.se_resnet9_fixup``. The spellings suite (``tests/test_spellings.py``)
holds each against the example: the same regions and the same kernels between them; the benchmark
times them (``python examples/benchmark.py --models spellings``). Each name of :data:`SPELLINGS` is
also a function of this module that makes the full-size RGB network (a ``MODEL_REF`` for the CLI,
e.g. ``examples.seresnet9_spellings:authors``).

Where a spelling comes from: the original bps-nav code (the scalar bias added once per reader,
``relu_`` at the end), torchvision's ResNet (``out += identity``, ``nn.ReLU(inplace=True)``
modules), timm's and torchvision's SE blocks (``nn.AdaptiveAvgPool2d(1)`` then ``flatten`` or
``view``, an ``nn.Sequential`` excitation ending in ``nn.Sigmoid``, the gate broadcast by
indexing or ``unsqueeze``), and scalars of other ranks (0-d, ``[1, 1, 1, 1]``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.seresnet9_fixup import SEFixupBlock, SqueezeExcitation, randomize_, se_resnet9_fixup


# --------------------------------------------------------------------------- SE gates

class PooledSE(nn.Module):
    """torchvision-style: adaptive pool, flatten, a Sequential excitation ending in Sigmoid."""

    def __init__(self, planes: int, reduction: int = 16):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Sequential(nn.Linear(planes, planes // reduction), nn.ReLU(inplace=True),
                                nn.Linear(planes // reduction, planes), nn.Sigmoid())

    def forward(self, x):
        g = self.fc(torch.flatten(self.pool(x), 1))
        return x * g[:, :, None, None]


class ViewSE(nn.Module):
    """The squeeze as ``adaptive_avg_pool2d(x, 1).view(n, c)``, the gate unsqueezed."""

    def __init__(self, planes: int, reduction: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(planes, planes // reduction)
        self.fc2 = nn.Linear(planes // reduction, planes)

    def forward(self, x):
        n, c, _, _ = x.size()
        s = F.adaptive_avg_pool2d(x, 1).view(n, c)
        g = torch.sigmoid(self.fc2(torch.relu(self.fc1(s))))
        return x * g.unsqueeze(-1).unsqueeze(-1)


class KeepdimSE(nn.Module):
    """The squeeze with ``keepdim=True`` and the excitation on the flattened squeeze."""

    def __init__(self, planes: int, reduction: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(planes, planes // reduction)
        self.fc2 = nn.Linear(planes // reduction, planes)

    def forward(self, x):
        s = x.mean(dim=(-2, -1), keepdim=True).flatten(1)
        g = self.fc2(F.relu(self.fc1(s))).sigmoid()
        return x * g.reshape(x.shape[0], -1, 1, 1)


# --------------------------------------------------------------------------- blocks

class AuthorsBlock(SEFixupBlock):
    """bps-nav's own spelling: the bias added to the input once per reader, ``relu_`` last."""

    def forward(self, x):
        out = self.relu(self.conv1(x + self.bias1a) + self.bias1b)
        out = self.conv2(out + self.bias2a)
        out = out * self.scale + self.bias2b
        identity = x if self.downsample is None else self.downsample(x + self.bias1a)
        out = self.se(out) + identity
        return out.relu_()


class TorchvisionBlock(SEFixupBlock):
    """torchvision's ResNet style: ``out += identity`` then an ``nn.ReLU(inplace=True)``."""

    def forward(self, x):
        identity = x
        x = x + self.bias1a
        out = self.conv1(x)
        out = self.relu(out + self.bias1b)
        out = self.conv2(out + self.bias2a)
        out = out * self.scale
        out = out + self.bias2b
        out = self.se(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class FunctionalBlock(SEFixupBlock):
    """Every activation through ``torch.nn.functional``, the scale written as ``torch.mul``."""

    def forward(self, x):
        a = torch.add(x, self.bias1a)
        out = F.relu(torch.add(self.conv1(a), self.bias1b))
        out = torch.add(torch.mul(self.conv2(torch.add(out, self.bias2a)), self.scale),
                        self.bias2b)
        identity = x if self.downsample is None else self.downsample(a)
        return F.relu(torch.add(self.se(out), identity))


def _with_scalars(shape: tuple[int, ...]) -> Callable[[nn.Module], nn.Module]:
    """A block whose five scalars have ``shape`` instead of ``[1]``."""

    def reshape(block: nn.Module) -> nn.Module:
        for name in ("bias1a", "bias1b", "bias2a", "scale", "bias2b"):
            old = getattr(block, name)
            setattr(block, name, nn.Parameter(old.detach().reshape(shape).clone()))
        return block
    return reshape


# --------------------------------------------------------------------------- networks

def _spelled(block: type[SEFixupBlock] | None = None, se: type[nn.Module] | None = None,
             scalars: tuple[int, ...] | None = None) -> Callable[..., nn.Module]:
    """A factory ``make(base_planes=64)``: the example network (RGB, randomized under a fixed
    seed), its blocks re-spelled as ``block`` with the SE gate ``se`` and scalars of shape
    ``scalars``, holding the example's values."""

    def make(base_planes: int = 64) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = randomize_(se_resnet9_fixup(3, base_planes=base_planes)).eval()
        for name in ("layer0", "layer1", "layer2", "layer3"):
            old: SEFixupBlock = getattr(model, name)
            planes, stride = old.conv1.out_channels, old.conv1.stride[0]
            reduction = planes // old.se.fc1.out_features
            new = (block or SEFixupBlock)(old.conv1.in_channels, planes, stride, reduction)
            if se is not None:
                new.se = se(planes, reduction)
            if scalars is not None:
                _with_scalars(scalars)(new)
            with torch.no_grad():
                for p, q in zip(new.parameters(), old.parameters(), strict=True):
                    p.copy_(q.reshape(p.shape))
            setattr(model, name, new.eval())
        return model
    return make


SPELLINGS: dict[str, Callable[..., nn.Module]] = {
    "example": _spelled(),
    "authors": _spelled(AuthorsBlock),
    "torchvision_block": _spelled(TorchvisionBlock),
    "functional_block": _spelled(FunctionalBlock),
    "pooled_se": _spelled(se=PooledSE),
    "view_se": _spelled(se=ViewSE),
    "keepdim_se": _spelled(se=KeepdimSE),
    "scalars_0d": _spelled(scalars=()),
    "scalars_4d": _spelled(scalars=(1, 1, 1, 1)),
    "authors_with_pooled_se": _spelled(AuthorsBlock, se=PooledSE),
}
"""Spelling name -> a factory of the network written so (eval mode, randomized values;
``base_planes`` 64 by default, the network's own size)."""

example, authors, torchvision_block, functional_block = (
    SPELLINGS[n] for n in ("example", "authors", "torchvision_block", "functional_block"))
pooled_se, view_se, keepdim_se = (SPELLINGS[n] for n in ("pooled_se", "view_se", "keepdim_se"))
scalars_0d, scalars_4d, authors_with_pooled_se = (
    SPELLINGS[n] for n in ("scalars_0d", "scalars_4d", "authors_with_pooled_se"))

assert SqueezeExcitation  # the example's own SE, which the spellings above re-spell
