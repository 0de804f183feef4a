"""The ``fusion-compiler`` command line: ``dump`` shows what the compiler does to a model,
``check`` compares its numerics with an fp64 reference per region, ``bench`` times it against eager
PyTorch and ``torch.compile``.

``MODEL_REF`` is ``package.module:factory``, resolved from the current directory (the convention
of uvicorn/gunicorn); the factory is called without arguments and must return an ``nn.Module``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ..config import DEFAULT_BACKENDS, CompileOptions
from ..ir.errors import FusionError, condense
from .report import DEFAULT_STAGES, STAGES_HELP

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
    except Exception as exc:  # the module's own code failed at import: a SyntaxError, a file
        raise ValueError(f"importing {module_name} raised {type(exc).__name__}: {exc}") from exc
    try:
        model = factory() if callable(factory) and not isinstance(factory, torch.nn.Module) \
            else factory
    except Exception as exc:  # the user's factory failed: say so in its words
        raise ValueError(f"{ref} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{ref!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _load(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.Tensor], str]:
    """The model of ``args.model`` on the device in the dtype (train mode with ``--train``) and
    random inputs of the ``--input`` shapes (seeded: the same in every process)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine "
                         f"(torch {torch.__version__}); use --device cpu")
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(0)
    model = load_model(args.model).to(device=device, dtype=dtype)
    if getattr(args, "channels_last", False):
        model = model.to(memory_format=torch.channels_last)
    model.train(args.train)
    try:
        inputs = [torch.randn(shape, dtype=dtype, device=device) for shape in args.input]
    except (RuntimeError, MemoryError) as exc:  # (torch.OutOfMemoryError is a RuntimeError)
        shapes = ", ".join("x".join(map(str, shape)) for shape in args.input)
        raise ValueError(f"--input {shapes}: the inputs cannot be made on {device} "
                         f"({type(exc).__name__}: {exc})") from exc
    return model, inputs, device


def _options(args: argparse.Namespace) -> dict:
    return {"backends": args.backends, "autotune": args.autotune,
            "fuse_prologue": args.fuse_prologue, "fuse_reduction": args.fuse_reduction,
            "horizontal_fusion": not args.no_horizontal_fusion}


def _device(text: str) -> str:
    """An ``argparse`` type: ``cpu``, ``cuda`` or ``cuda:N``."""
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def _check_out(args: argparse.Namespace) -> None:
    """Raises ValueError before any work when ``--out`` cannot be written: a file in a missing
    folder, a folder where a file is written (``dump``, ``check``), a file where ``bench``
    writes a folder."""
    out = args.out
    if out is None:
        return
    folder = args.func is _bench
    if folder and out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: bench writes a folder there, and it is a file")
    if not folder and out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name")
    if not folder and not out.parent.is_dir():
        raise ValueError(f"--out {out}: the folder {out.parent} does not exist")


def _emit(text: str, out: Path | None) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)


def _dump(args: argparse.Namespace) -> int:
    from .dump import specialize_for_dump  # noqa: PLC0415
    from .report import describe, format_text  # noqa: PLC0415

    model, inputs, device = _load(args)
    spec = specialize_for_dump(model, inputs, **_options(args))
    title = f"{args.model} on {device}, {args.dtype}, {'train' if args.train else 'eval'}"
    if torch.device(device).type != "cuda":  # what the dump shows, and what runs here instead
        title += (": the regions a CUDA GPU gets (the CUDA pass pipeline); on this device "
                  "compile() runs every region as its own PyTorch ops")
    if args.format == "dot":
        from .dot import to_dot  # noqa: PLC0415

        _emit(to_dot(spec, title), args.out)
        if args.out is not None:
            _render_svg(args.out)
        return 0
    report = describe(spec, args.stage)
    if args.format == "json":
        _emit(json.dumps({"model": args.model, "device": device, "dtype": args.dtype, **report},
                         indent=1) + "\n", args.out)
    else:
        _emit(format_text(report, title=title), args.out)
    return 0


def _render_svg(dot_file: Path) -> None:
    """Render ``dot_file`` to SVG beside it when Graphviz's ``dot`` is installed."""
    exe = shutil.which("dot")
    if exe is None:
        print("Graphviz `dot` not found: render with `dot -Tsvg FILE -o FILE.svg`",
              file=sys.stderr)
        return
    svg = dot_file.with_suffix(".svg")
    subprocess.run([exe, "-Tsvg", str(dot_file), "-o", str(svg)], check=True)
    print(f"wrote {svg}", file=sys.stderr)


def _check(args: argparse.Namespace) -> int:
    from .check import check  # noqa: PLC0415

    model, inputs, device = _load(args)
    report = check(model, *inputs, train=args.train, **_options(args))
    if args.format == "json":
        _emit(json.dumps({"model": args.model, **report.to_json()}, indent=1) + "\n", args.out)
    else:
        _emit(report.format(title=args.model), args.out)
    return 0 if report.ok else 1


def _bench(args: argparse.Namespace) -> int:
    """Benchmark, print the tables, write ``--out``; exit status 0 (a variant that fails is
    reported in the table, not by the exit status)."""
    from .bench import BenchRecipe, bench, format_results, write  # noqa: PLC0415

    model, inputs, device = _load(args)
    recipe = None if args.no_compile_times or args.train else BenchRecipe(
        args.model, tuple(args.input), args.dtype, device, args.channels_last)
    result = bench(model, inputs, train=args.train, variants=args.variants,
                   fusion_variants={"fusion_compiler": _options(args)}, reps=args.reps,
                   iters=args.iters, recipe=recipe, profile=args.profile)
    result["label"] = args.model
    print(format_results([result]))
    for name, table in result.get("profiles", {}).items():
        print(f"kernel profile, {name}, 20 calls:\n{table}")
    if args.out is not None:
        for path in write([result], args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _common(p: argparse.ArgumentParser, out_help: str) -> None:
    """The arguments every command takes: the model, its inputs and how to compile it."""
    p.add_argument("model", metavar="MODEL_REF", help="package.module:factory, e.g. "
                   "examples.seresnet9_fixup:se_resnet9_fixup")
    p.add_argument("--input", type=parse_shape, action="append", required=True,
                   help="input shape like 128x3x64x64 (random normal values); repeat for several "
                        "inputs")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                   help="dtype of the model and its inputs (default %(default)s)")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu or cuda (default: cuda when available)")
    p.add_argument("--train", action="store_true", help="training mode (default: eval)")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), metavar="NAMES",
                   help="comma-separated backends lowering may give a region, in the order it "
                        "asks them; several that take a region are timed against each other "
                        "(default %(default)s; also triton_conv, off by default: cuDNN was "
                        "faster on every region measured; '' runs every region as PyTorch ops)")
    p.add_argument("--fuse-prologue", action="store_true",
                   help="fuse pointwise ops on a conv's input into its region (off by default: "
                        "slower, docs/decisions.md)")
    p.add_argument("--fuse-reduction", action="store_true",
                   help="fuse the H, W sum after a conv into its region (off by default: "
                        "slower, docs/decisions.md)")
    p.add_argument("--no-horizontal-fusion", action="store_true",
                   help="keep convolutions that read the same image apart (on by default in "
                        "CUDA inference: one convolution with their weights concatenated, "
                        "docs/options.md)")
    p.add_argument("--autotune", type=int, default=CompileOptions.autotune,
                   help="cuDNN plans built and timed per region on a GPU (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help=out_help)
    p.add_argument("--debug", action="store_true",
                   help="on an error, show the traceback instead of one line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusion-compiler",
                                     description="Fuse convolution chains of PyTorch models into "
                                                 "cuDNN graphs.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="what the compiler does to a model: coverage summary, region "
                                    "table, ops left to PyTorch by reason, graphs",
                       description="Compile MODEL_REF for the given input shapes and print a "
                                   "summary (convolutions and FLOPs in regions, regions per "
                                   "backend), the region table and the ops left to PyTorch "
                                   "grouped by reason; graph code with --stage. Works without a "
                                   "GPU.")
    _common(d, "write the output to this file (with --format dot, also FILE.svg when Graphviz "
               "is installed)")
    d.add_argument("--stage", type=lambda s: [x for x in s.split(",") if x],
                   default=list(DEFAULT_STAGES),
                   help=f"comma-separated graphs whose code to show: {STAGES_HELP} "
                        "(default: none)")
    d.add_argument("--format", choices=["text", "json", "dot"], default="text",
                   help="text (default), json, or Graphviz dot with each region a cluster")
    d.set_defaults(func=_dump)

    c = sub.add_parser("check", help="numerics of the compiled model against an fp64 reference, "
                                     "per region; exit 1 on a mismatch",
                       description="Run the compiled model and an fp64 copy; compare the outputs "
                                   "and every region's outputs (with --train also every "
                                   "gradient) against the tolerance of the dtype. Exits 1 and "
                                   "names the regions outside it on a mismatch. Works on CPU "
                                   "(reference backend) and GPU.")
    _common(c, "write the report to this file")
    c.add_argument("--format", choices=["text", "json"], default="text")
    c.set_defaults(func=_check)

    b = sub.add_parser("bench", help="time eager, torch.compile and fusion_compiler side by side",
                       description="Time MODEL_REF's forward (with --train a forward and "
                                   "backward) in eager PyTorch, eager in a CUDA graph, "
                                   "torch.compile (default, reduce-overhead) and fusion_compiler "
                                   "with its defaults, in one process: medians and spread, compile "
                                   "times (cold and warm, in new processes), the GPU's name. "
                                   "Shows on stderr which variant is building and for how long. "
                                   "Writes bench.json, bench.txt and, with matplotlib, bench.png "
                                   "to --out.")
    _common(b, "directory to write bench.json (every result, as JSON), bench.txt (the tables "
               "printed) and, with matplotlib installed, bench.png (a bar plot of the medians) "
               "(default: none written)")
    from .bench import add_arguments  # noqa: PLC0415

    add_arguments(b)
    b.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status. A user's error (a model that cannot be
    loaded or traced, inputs it does not take, an unavailable device, a bad option) is one line
    on stderr and exit status 2; ``--debug`` or ``FUSION_COMPILER_LOG=debug`` raises it with
    its traceback instead."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("FUSION_COMPILER_LOG", "").lower() == "debug"
    try:
        _check_out(args)
        return args.func(args)
    except (ValueError, FusionError) as exc:
        if debug:
            raise
        parser.exit(2, f"fusion-compiler: error: {condense(str(exc), 1000)}\n")


if __name__ == "__main__":
    sys.exit(main())
