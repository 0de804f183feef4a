"""The ``fusion-compiler`` command line: ``dump`` shows what the compiler does to a model.

``MODEL_REF`` is ``package.module:factory``, resolved from the current directory (the convention
of uvicorn/gunicorn); the factory is called without arguments and must return an ``nn.Module``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

from .backends.cudnn import DEFAULT_AUTOTUNE
from .report import DEFAULT_STAGES, dump, format_text

__all__ = ["main", "load_model", "parse_shape"]

_DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "float32": torch.float32, "float": torch.float32}


def parse_shape(text: str) -> tuple[int, ...]:
    """``"128x3x64x64"`` -> ``(128, 3, 64, 64)``; raises ``argparse.ArgumentTypeError``."""
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"bad input shape {text!r}: write it like 128x3x64x64")
    return shape


def load_model(ref: str) -> torch.nn.Module:
    """Import ``module:factory`` (from the current directory first) and call the factory.

    Raises:
        ValueError: ``ref`` is malformed, cannot be imported, or the factory returns no Module.
    """
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"MODEL_REF must look like package.module:factory, got {ref!r}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {ref!r}: {exc}") from exc
    model = factory() if callable(factory) and not isinstance(factory, torch.nn.Module) else factory
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{ref!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _dump(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[args.dtype]
    model = load_model(args.model).to(device=device, dtype=dtype)
    model.train(args.train)
    inputs = [torch.randn(shape, dtype=dtype, device=device) for shape in args.input]
    report = dump(model, inputs, backend=args.backend, stages=args.stage, autotune=args.autotune,
                  fuse_prologue=args.fuse_prologue, fuse_reduction=args.fuse_reduction)
    if args.format == "json":
        print(json.dumps({"model": args.model, "device": device, "dtype": args.dtype, **report},
                         indent=1))
    else:
        print(format_text(report, title=f"{args.model} on {device}, {args.dtype}"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion-compiler",
                                     description="Fuse convolution chains of PyTorch models into "
                                                 "cuDNN graphs.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="show captured/fused/lowered graphs and the region table",
                       description="Compile MODEL_REF for the given input shapes and print its "
                                   "graphs, regions, cuDNN graph JSON and what is left to PyTorch. "
                                   "Works without a GPU.")
    d.add_argument("model", metavar="MODEL_REF", help="package.module:factory, e.g. "
                   "examples.seresnet9_fixup:se_resnet9_fixup")
    d.add_argument("--input", type=parse_shape, action="append", required=True,
                   help="input shape like 128x3x64x64; repeat for several inputs")
    d.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.add_argument("--backend", choices=["auto", "cudnn", "reference"], default="auto")
    d.add_argument("--stage", type=lambda s: [x for x in s.split(",") if x],
                   default=list(DEFAULT_STAGES),
                   help="comma-separated graphs to show: captured, normalize, fold_bn, "
                        "space_to_depth, avgpool_conv, fused, lowered (default: %(default)s)")
    d.add_argument("--format", choices=["text", "json"], default="text")
    d.add_argument("--train", action="store_true", help="compile in training mode (default: eval)")
    d.add_argument("--fuse-prologue", action="store_true",
                   help="fuse pointwise ops on a conv's input into its region (off by default: "
                        "slower on an H100 with cuDNN 9.19)")
    d.add_argument("--fuse-reduction", action="store_true",
                   help="fuse the H, W sum after a conv into its region (off by default: slower "
                        "on an H100 with cuDNN 9.19)")
    d.add_argument("--autotune", type=int, default=DEFAULT_AUTOTUNE,
                   help="cuDNN plans built and timed per region on a GPU (default %(default)s)")
    d.set_defaults(func=_dump)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"fusion-compiler: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
