"""The project's benchmark: ``fusion_compiler.tools.bench`` on a fixed list of models, each in a
process of its own, with more fusion_compiler variants than ``fusion-compiler bench`` times.

    python examples/benchmark.py --out bench_out                 # every model
    python examples/benchmark.py --models seresnet9-rgb --profile
    python examples/benchmark.py --models seresnet9-rgb-train    # forward + backward, N=2048
    python examples/benchmark.py --models zoo --variants eager,"torch.compile reduce-overhead",fusion_compiler
    python examples/benchmark.py --models spellings       # SE-ResNet9 as people write it
    python examples/benchmark.py --models amp             # fp32 weights under autocast
    python examples/benchmark.py --models timm            # timm CNNs, N=32

Everything is fp16 (inputs NCHW; ``--channels-last`` stores the parameters channels_last), but
the ``-amp`` models: fp32 parameters and inputs, every call under ``torch.autocast`` (fp16), and
each training step with a ``GradScaler`` and an SGD step (``bench(..., amp=True)``).
torchvision and timm models have random weights and batch-norm statistics calibrated on random data
(:func:`calibrate_batch_norm`), so their fp16 activations do not overflow.
Timing, variants and compile times are those of :mod:`fusion_compiler.tools.bench`; the extra
fusion_compiler variants (``FUSION_VARIANTS``) show what each default is worth. Each model runs
in a new process: torch.compile's caches and CUDA graph pools from one model's variants would
otherwise carry over to the next (measurements: docs/decisions.md, "Benchmarked models in
processes of their own"). Prints the tables, per model the autotuning table (inference) or the
per-region backward table (training) and, with ``--profile``, the kernels of 20 calls of the
CUDA-graph variants; writes ``bench.json``, ``bench.txt`` and ``bench.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fusion_compiler.tools.bench import BenchRecipe, bench, format_results, write  # noqa: E402
from fusion_compiler.tools.cli import load_model  # noqa: E402

MODELS = {
    # name: (MODEL_REF, input shape, training step?)
    "seresnet9-rgb": ("examples.seresnet9_fixup:randomized_se_resnet9_fixup", (128, 3, 64, 64),
                      False),
    "seresnet9-depth": ("examples.seresnet9_fixup:randomized_se_resnet9_fixup_depth",
                        (512, 11, 64, 64), False),
    "resnet50": ("torchvision.models:resnet50", (128, 3, 224, 224), False),
    "resnet50-n32": ("torchvision.models:resnet50", (32, 3, 224, 224), False),
    "resnet50-n1": ("torchvision.models:resnet50", (1, 3, 224, 224), False),
    "mobilenet_v2": ("torchvision.models:mobilenet_v2", (32, 3, 224, 224), False),
    "efficientnet_b0": ("torchvision.models:efficientnet_b0", (32, 3, 224, 224), False),
    "regnet_y_400mf": ("torchvision.models:regnet_y_400mf", (32, 3, 224, 224), False),
    "densenet121": ("torchvision.models:densenet121", (32, 3, 224, 224), False),
    "convnext_tiny": ("torchvision.models:convnext_tiny", (32, 3, 224, 224), False),
    "seresnext26d_32x4d": ("timm.models:seresnext26d_32x4d", (32, 3, 224, 224), False),
    # timm networks built from BatchNormAct2d (batch norm + activation in one module)
    "timm-efficientnet_b0": ("timm.models:efficientnet_b0", (32, 3, 224, 224), False),
    "timm-regnety_008": ("timm.models:regnety_008", (32, 3, 224, 224), False),
    "timm-mobilenetv3_large_100": ("timm.models:mobilenetv3_large_100", (32, 3, 224, 224),
                                   False),
    "timm-cspresnet50": ("timm.models:cspresnet50", (32, 3, 224, 224), False),
    "seresnet9-rgb-train": ("examples.seresnet9_fixup:randomized_se_resnet9_fixup",
                            (2048, 3, 64, 64), True),
    "seresnet9-rgb-amp": ("examples.seresnet9_fixup:randomized_se_resnet9_fixup",
                          (128, 3, 64, 64), False),
    "seresnet9-rgb-train-amp": ("examples.seresnet9_fixup:randomized_se_resnet9_fixup",
                                (2048, 3, 64, 64), True),
    "seresnet9-rgb-train-amp-n1024": ("examples.seresnet9_fixup:randomized_se_resnet9_fixup",
                                      (1024, 3, 64, 64), True),
}
AMP = ["seresnet9-rgb-amp", "seresnet9-rgb-train-amp-n1024", "seresnet9-rgb-train-amp"]
"""``--models amp``: fp32 parameters under autocast (fp16), the recipe most networks run with."""
ZOO = ["resnet50-n32", "resnet50", "mobilenet_v2", "efficientnet_b0", "regnet_y_400mf",
       "densenet121", "convnext_tiny"]
"""``--models zoo``: the torchvision CNNs (random weights, batch-norm statistics calibrated)."""
TIMM = ["seresnext26d_32x4d", "timm-efficientnet_b0", "timm-regnety_008",
        "timm-mobilenetv3_large_100", "timm-cspresnet50"]
"""``--models timm``: timm CNNs (random weights, batch-norm statistics calibrated)."""
SPELLING_NAMES = ["example", "authors", "torchvision_block", "functional_block", "pooled_se",
                  "view_se", "keepdim_se", "scalars_0d", "scalars_4d", "authors_with_pooled_se"]
for _name in SPELLING_NAMES:  # SE-ResNet9-Fixup RGB as people write it, N=128
    MODELS[f"spelling-{_name}"] = (f"examples.seresnet9_spellings:{_name}", (128, 3, 64, 64),
                                   False)
SPELLINGS = [f"spelling-{n}" for n in SPELLING_NAMES]
"""``--models spellings``: SE-ResNet9-Fixup's spellings (examples/seresnet9_spellings.py)."""
# label -> compile() options; the first is compile(model) with no options
FUSION_VARIANTS = {
    "fusion_compiler": {},
    "fusion_compiler glue=None": {"glue_backend": None},
    "fusion_compiler cuda_graph=False": {"cuda_graph": False},  # glue "auto": eager ops
    "fusion_compiler cuda_graph=False glue=inductor": {"cuda_graph": False,
                                                      "glue_backend": "inductor"},
    "fusion_compiler +triton_conv": {"backends": ("triton_stem", "triton_conv", "dense",
                                                  "triton_depthwise", "cudnn")},
    "fusion_compiler +hopper_conv": {"backends": ("triton_stem", "dense", "triton_depthwise",
                                                  "hopper_conv", "cudnn")},
    "fusion_compiler -dense": {"backends": ("triton_stem", "triton_depthwise", "cudnn")},
    "fusion_compiler -triton_depthwise": {"backends": ("triton_stem", "dense", "cudnn")},
    "fusion_compiler horizontal_fusion=False": {"horizontal_fusion": False},
}
TRAIN_FUSION_VARIANTS = {"fusion_compiler": {}, "fusion_compiler glue=None": {"glue_backend": None},
                         "fusion_compiler cuda_graph=False": {"cuda_graph": False}}


def run_one(name: str, args: argparse.Namespace) -> dict:
    """Benchmark model ``name`` in this process."""
    ref, shape, train = MODELS[name]
    torch.manual_seed(0)
    model = load_model(ref).cuda()
    if ref.startswith(("torchvision", "timm")):
        calibrate_batch_norm(model, shape)
    amp = name in AMP
    dtype = torch.float32 if amp else torch.half
    model = model.to(dtype).train(train)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    recipe = BenchRecipe(ref, (shape,), "float16", "cuda", args.channels_last)
    options = {} if args.autotune is None else {"autotune": args.autotune}
    variants = TRAIN_FUSION_VARIANTS if train else FUSION_VARIANTS
    chosen = args.variants.split(",") if args.variants else None
    labels = [v for v in ("fusion_compiler", "fusion_compiler glue=None")
              if v in variants and (chosen is None or v in chosen)]
    result = bench(model, [x], train=train, reps=args.reps, iters=args.iters, variants=chosen,
                   fusion_variants={k: {**v, **options} for k, v in variants.items()
                                    if chosen is None or k in chosen or k == "fusion_compiler"},
                   recipe=None if train or amp or args.no_compile_times else recipe,
                   profile=args.profile, compile_labels=labels or None, amp=amp)
    result["label"] = name + (", params channels_last" if args.channels_last else "")
    return result


@torch.no_grad()
def calibrate_batch_norm(model: torch.nn.Module, shape: tuple[int, ...], steps: int = 4) -> None:
    """Give a randomly initialized model batch-norm statistics of its own activations: a few
    fp32 train-mode forwards on random inputs with a cumulative average (``momentum=None``).
    With the initial statistics (mean 0, variance 1) activations grow layer by layer and
    overflow fp16 (measurements: docs/decisions.md, "Benchmarked models in processes of their
    own")."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    for _ in range(steps):
        model(torch.randn(shape, device="cuda"))
    model.eval()


def own_process(name: str, args: argparse.Namespace) -> dict:
    """Benchmark model ``name`` in a new Python process (see module doc) and return its result."""
    with tempfile.TemporaryDirectory(prefix="fc-bench-") as tmp:
        path = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--models", name, "--result-json", str(path),
                   "--reps", str(args.reps)]
        for flag, value in (("--iters", args.iters), ("--autotune", args.autotune),
                            ("--variants", args.variants)):
            if value is not None:
                command += [flag, str(value)]
        command += ["--profile"] * args.profile + ["--channels-last"] * args.channels_last
        command += ["--no-compile-times"] * args.no_compile_times
        subprocess.run(command, check=True, cwd=ROOT)
        return json.loads(path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="seresnet9-rgb,seresnet9-depth,resnet50,"
                                              "seresnet9-rgb-train",
                        help="comma-separated (default: %(default)s): zoo (= "
                             + ", ".join(ZOO) + "), timm (= " + ", ".join(TIMM)
                             + "), spellings (= " + ", ".join(SPELLINGS)
                             + "), amp (= " + ", ".join(AMP) + "), " + ", ".join(MODELS))
    parser.add_argument("--variants", default=None, help="comma-separated (default: all)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--autotune", type=int, default=None,
                        help="cuDNN plans timed per region (default: compile()'s)")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--no-compile-times", action="store_true",
                        help="skip the cold and warm compile times in new processes")
    parser.add_argument("--result-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(1, "benchmark.py needs a CUDA GPU (fusion-compiler bench runs on the CPU)\n")
    if args.result_json:  # a child process: one model
        args.result_json.write_text(json.dumps(run_one(args.models, args)))
        return 0
    groups = {"zoo": ZOO, "timm": TIMM, "spellings": SPELLINGS, "amp": AMP}
    names = [n for part in args.models.split(",") for n in groups.get(part, [part])]
    results = [own_process(name, args) for name in names]
    print(format_results(results))
    for r in results:
        for key in ("tuning", "gradients"):
            if key in r:
                print(f"{r['label']}:\n{r[key]}")
        for variant, table in r.get("profiles", {}).items():
            print(f"kernel profile, {r['label']}, {variant}, 20 calls:\n{table}")
    for path in write(results, args.out):
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
