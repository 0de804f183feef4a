"""``fusion-compiler bench``: a model timed in eager PyTorch, ``torch.compile`` and fusion_compiler,
side by side in one process.

Inference times one forward; training (``train=True``) one forward, loss (mean of squares of every
output, in fp32) and backward, the gradients set to ``None`` first and no optimizer step (so the
figures are the model's, not an optimizer's). Variants:

==================================  ================================================================
``eager``                           the model itself
``eager+cudagraph``                 the same call captured in one CUDA graph and replayed
                                    (``torch.cuda.CUDAGraph``, static inputs)
``torch.compile``                   ``torch.compile(model)`` (Inductor, default mode)
``torch.compile reduce-overhead``   ``torch.compile(model, mode="reduce-overhead")`` (CUDA graph
                                    trees; training steps marked with
                                    ``torch.compiler.cudagraph_mark_step_begin``)
``fusion_compiler``                 ``fusion_compiler.compile(model)`` with its defaults, and any
                                    other ``fusion_variants`` (label -> ``compile`` options)
``fusion_compiler+cudagraph``       training only: the step of the first ``fusion_variants`` entry,
                                    compiled with ``cuda_graph=False``, captured in one CUDA graph
                                    by hand (docs/training.md, "Capturing a whole step
                                    yourself")
==================================  ================================================================

Timing (the method of docs/benchmarks.md, "Method"): after 3 warm-up calls, ``reps`` repetitions of
``iters`` back-to-back calls, each repetition timed with CUDA events (``time.perf_counter`` on the
CPU); ms per call is the median over repetitions, the spread their quartiles. ``iters`` defaults to
what fills 20 ms. "compile s" is the variant's build plus first call in this process; "cold" and
"warm" compile times are seconds to the first output in new processes
(:mod:`fusion_compiler.tools.bench.first_output`) with empty cache directories and with the ones the
cold run filled. For inference each variant's output is also compared with an fp32 copy of the model
(TF32 off), beside eager's error.
"""

from .compile_times import BenchRecipe, new_process_compile_seconds
from .formatting import add_arguments, format_results, format_time_split, plot, write
from .profiling import (KERNEL_CATEGORIES, gpu_ops_per_call, kernel_categories, kernel_category,
                        kernel_profile)
from .timing import device_name, time_ms
from .variants import ALTERNATING, INFERENCE_VARIANTS, TRAIN_VARIANTS, bench

__all__ = ["bench", "BenchRecipe", "INFERENCE_VARIANTS", "TRAIN_VARIANTS", "ALTERNATING",
           "KERNEL_CATEGORIES", "kernel_categories", "kernel_category", "kernel_profile", "time_ms",
           "format_results", "format_time_split", "plot", "device_name", "add_arguments", "write",
           "gpu_ops_per_call", "new_process_compile_seconds"]
