"""The SpaceToDepth stem alone, three ways, on a CUDA GPU: why it runs as one Triton kernel.

    python examples/space_to_depth_stem.py                 # depth stem: N=512, C=11, 64x64
    python examples/space_to_depth_stem.py --batch 128 --channels 3

The stem is ``relu(conv1x1(SpaceToDepth4(x), w) + b)`` with 64 output channels, fp16:

* ``copy + 1x1 conv``: the SpaceToDepth as Inductor's copy straight to channels_last, then
  PyTorch's (cuDNN) 1x1 convolution on ``16*C`` channels: what the graph held before the Triton
  stem (there the convolution was a cuDNN region);
* ``4x4/s4 conv``: the folded form (``passes/pre_fusion/rewrites.py``), PyTorch's (cuDNN)
  convolution on the ``C``-channel NCHW image;
* ``Triton stem``: ``fusion_compiler::space_to_depth_conv``
  (``fusion_compiler/kernels/space_to_depth.py``), one kernel.

Each is timed in CUDA-graph replays (``backends.timing.paired_time_ms``: replays alternating, so
drift hits all alike); prints a table of medians in us with the GPU's name, and each one's max
relative error against fp32.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.seresnet9_fixup import SpaceToDepth  # noqa: E402
from fusion_compiler.backends.timing import paired_time_ms  # noqa: E402
from fusion_compiler.kernels.space_to_depth import space_to_depth_conv  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--channels", type=int, default=11)
    parser.add_argument("--size", type=int, default=64, help="image height and width")
    parser.add_argument("--out-channels", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    n, c, s, k = args.batch, args.channels, args.size, args.out_channels
    x = torch.randn(n, c, s, s, device="cuda", dtype=torch.half)
    w4 = (torch.randn(k, c, 4, 4, device="cuda") / (16 * c) ** 0.5).half()
    b = torch.randn(k, device="cuda").half()
    # SpaceToDepth's channel order: (dh*4 + dw)*C + c
    w1 = w4.permute(0, 2, 3, 1).reshape(k, 16 * c, 1, 1).contiguous(memory_format=torch.channels_last)
    s2d = SpaceToDepth(4)
    copy = torch.compile(lambda t: s2d(t).contiguous(memory_format=torch.channels_last))
    runs = {
        "copy + 1x1 conv": lambda: torch.relu(F.conv2d(copy(x), w1, b)),
        "4x4/s4 conv": lambda: torch.relu(F.conv2d(x, w4, b, stride=4)),
        "Triton stem": lambda: space_to_depth_conv(x, w1, [b.view(1, -1, 1, 1)], [1, 5], [2], 4)[0],
    }
    want = torch.relu(F.conv2d(x.float(), w4.float(), b.float(), stride=4))
    errors = {name: ((run().float() - want).abs().max() / want.abs().max()).item()
              for name, run in runs.items()}
    times = paired_time_ms(list(runs.values()), reps=5)
    table = Table(title=f"SpaceToDepth(4) stem, N={n} C={c} {s}x{s} -> {k} channels, fp16, "
                        f"{torch.cuda.get_device_name()}")
    for col in ("implementation", "us per call (median)", "max rel. error vs fp32"):
        table.add_column(col)
    for (name, err), ms in zip(errors.items(), times):
        table.add_row(name, f"{ms * 1000:.1f}", f"{err:.2e}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
