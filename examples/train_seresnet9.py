"""Train SE-ResNet9-Fixup plus a small head on synthetic data, eager and compiled side by side.

Both copies start from the same weights and see the same batches; the script prints both loss
curves (they must track each other up to fp16 noise) and, with ``--out``, plots them.

    python examples/train_seresnet9.py                              # GPU, pure fp16 weights
    python examples/train_seresnet9.py --precision autocast-bf16     # fp32 weights, autocast
    python examples/train_seresnet9.py --device cpu --batch 8 --steps 20 --precision fp32

Precision modes (``--precision``):

* ``fp16`` (default on a GPU): pure fp16 weights, as the reference agent trains. The optimizer
  keeps fp32 master copies of the weights; the loss is scaled by ``torch.amp.GradScaler``, whose
  ``step`` unscales the fp32 master gradients and skips steps with non-finite ones
  (:class:`MasterWeightOptimizer`).
* ``autocast-fp16`` / ``autocast-bf16``: fp32 weights, forward under ``torch.autocast`` (with a
  ``GradScaler`` for fp16).
* ``fp32``: no reduced precision (the CPU default).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fusion_compiler as fc  # noqa: E402
from examples.seresnet9_fixup import se_resnet9_fixup  # noqa: E402

PRECISIONS = ("fp16", "autocast-fp16", "autocast-bf16", "fp32")


class MasterWeightOptimizer:
    """An optimizer over fp32 master copies of a model's low-precision parameters.

    ``backward(loss)`` scales the loss and backpropagates into the model's fp16 gradients;
    ``step()`` copies them into the fp32 masters' gradients, unscales them, steps the inner
    optimizer and copies the masters back into the model (each copy one ``torch._foreach_copy_``
    over all parameters).

    With ``dynamic=True`` the scale is a ``torch.amp.GradScaler``'s: its ``step`` skips steps with
    inf/NaN gradients and halves the scale, and the scale doubles every ``growth_interval`` clean
    steps. That check reads the GPU from the host once per step, so a step cannot be captured in
    a CUDA graph; ``dynamic=False`` keeps ``init_scale`` fixed and never skips, which can.

    Args:
        params: the model's fp16/bf16 parameters (those with ``requires_grad`` are optimized).
        make_optimizer: ``list[Parameter] -> torch.optim.Optimizer`` over the masters.
        init_scale: the (first) loss scale.
        dynamic: dynamic loss scaling with overflow checks (see above).
    """

    def __init__(self, params, make_optimizer, init_scale: float = 2.0 ** 12,
                 dynamic: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.optimizer = make_optimizer(self.masters)
        self.scale = init_scale
        self.scaler = (torch.amp.GradScaler(self.params[0].device.type, init_scale=init_scale)
                       if dynamic else None)

    def zero_grad(self) -> None:
        """Drop the model's gradients: the next backward hands autograd's own gradient tensors
        over instead of adding them into zeros (one kernel less per parameter). ``step`` copies
        them into the masters' gradients, which keep their storage (CUDA-graph friendly)."""
        for p in self.params:
            p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss * self.scale).backward()

    @torch.no_grad()
    def step(self) -> None:
        pairs = []
        for m, p in zip(self.masters, self.params):
            if p.grad is None:
                m.grad = None
            else:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                pairs.append((m.grad, p.grad))
        if pairs:  # one multi-tensor kernel for every fp16 -> fp32 gradient copy, not one each
            torch._foreach_copy_(*map(list, zip(*pairs)))
        if self.scaler is None:
            grads = [m.grad for m in self.masters if m.grad is not None]
            torch._foreach_mul_(grads, 1.0 / self.scale)
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        torch._foreach_copy_(self.params, self.masters)


class Trainer:
    """One model, its optimizer and precision mode: ``step(x, y) -> loss`` (a float)."""

    def __init__(self, model: nn.Module, run, precision: str, lr: float):
        self.model, self.run, self.precision = model, run, precision
        sgd = lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)  # noqa: E731
        if precision == "fp16":
            self.optimizer = MasterWeightOptimizer(model.parameters(), sgd)
        else:
            self.optimizer = sgd(list(model.parameters()))
            device = next(model.parameters()).device.type
            self.scaler = torch.amp.GradScaler(device, enabled=precision == "autocast-fp16")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        if self.precision.startswith("autocast"):
            dtype = torch.float16 if self.precision == "autocast-fp16" else torch.bfloat16
            with torch.autocast(x.device.type, dtype=dtype):
                loss = nn.functional.mse_loss(self.run(x).float(), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss = nn.functional.mse_loss(self.run(x).float(), y)
            if self.precision == "fp16":
                self.optimizer.backward(loss)
            else:
                loss.backward()
            self.optimizer.step()
        return loss.item()


def build_model(in_channels: int = 3, outputs: int = 16, seed: int = 0) -> nn.Module:
    """The encoder backbone (N,C,64,64) -> (N,512,2,2) plus a linear head -> (N, outputs)."""
    torch.manual_seed(seed)
    return nn.Sequential(se_resnet9_fixup(in_channels), nn.Flatten(), nn.Linear(2048, outputs))


def synthetic_data(batches: int, batch: int, device, dtype, outputs: int = 16, seed: int = 1):
    """``batches`` fixed (image, target) pairs: images ~ N(0,1), targets a fixed random linear
    map of the 8x8-average-pooled image (so the loss can go down)."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(3 * 8 * 8, outputs, generator=gen) / 8
    data = []
    for _ in range(batches):
        x = torch.randn(batch, 3, 64, 64, generator=gen)
        y = nn.functional.avg_pool2d(x, 8).flatten(1) @ proj
        data.append((x.to(device, dtype), y.to(device)))
    return data


def train(steps: int, batch: int, precision: str, device: str, lr: float,
          log_every: int) -> list[tuple[int, float, float]]:
    """Train an eager and a compiled copy side by side; returns ``(step, eager, compiled)``
    losses."""
    weights = torch.float16 if precision == "fp16" else torch.float32
    eager = build_model().to(device, weights).train()
    twin = copy.deepcopy(eager)
    compiled = fc.compile(twin)
    trainers = [Trainer(eager, eager, precision, lr), Trainer(twin, compiled, precision, lr)]
    data = synthetic_data(8, batch, device, weights)
    curve = []
    for step in range(steps):
        x, y = data[step % len(data)]
        losses = [t.step(x, y) for t in trainers]
        if step % log_every == 0 or step == steps - 1:
            curve.append((step, *losses))
            print(f"step {step:4d}  eager {losses[0]:.5f}  fusion_compiler {losses[1]:.5f}  "
                  f"rel. diff {abs(losses[1] - losses[0]) / abs(losses[0]):.1e}", flush=True)
    regions = compiled.last.regions
    print(f"{sum(r.backend == 'cudnn' for r in regions)}/{len(regions)} regions on cuDNN; "
          f"backward pieces on cuDNN: "
          f"{sum(p.backend == 'cudnn' for r in regions for p in r.gradients)}")
    return curve


def plot(curve, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, eager, ours = zip(*curve)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, eager, label="eager PyTorch")
    ax.plot(steps, ours, "--", label="fusion_compiler")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="default: fp16 on a GPU, fp32 on the CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--out", type=Path, help="write loss_curves.png here")
    args = parser.parse_args()
    precision = args.precision or ("fp16" if args.device.startswith("cuda") else "fp32")
    curve = train(args.steps, args.batch, precision, args.device, args.lr, args.log_every)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        plot(curve, args.out / "loss_curves.png",
             f"SE-ResNet9-Fixup, batch {args.batch}, {precision}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
