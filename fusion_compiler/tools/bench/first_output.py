"""Seconds to the first output of a compiled model in a new process (run by path, not imported).

``fusion-compiler bench`` runs this file as a script, once per cold or warm measurement::

    python first_output.py MODEL_REF VARIANT DTYPE DEVICE CHANNELS_LAST SHAPE [SHAPE ...]

(``VARIANT`` is ``torch.compile reduce-overhead``, ``torch.compile backend=fusion_compiler`` or a
JSON object of :func:`fusion_compiler.compile` options; ``SHAPE`` like ``128x3x64x64``). It
builds the model and its inputs first, then starts the clock: for fusion_compiler (either door)
before ``import fusion_compiler`` (run as a script, the package is not imported yet, so its
import is part of the cost), for reduce-overhead before the ``torch.compile`` call; the clock
stops when the first output is on the host's side of a device synchronization. Prints the
seconds on the last line, and after them, when a background glue compile was still running
(``compile(tiered=True)``), the seconds until it was done and the compiled glue switched in.
Before that line, when Dynamo's counters were loaded, one line ``caches {...}``: the lookups of
Inductor's FX graph cache and AOTAutograd's cache by outcome (``{"fxgraph": {"hit": 1}, ...}``).
The plan cache and the Inductor cache are wherever the environment points them
(``FUSION_COMPILER_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

import torch


def main(argv: list[str]) -> list[float]:
    ref, variant, dtype, device, channels_last, *shapes = argv
    sys.path.insert(0, os.getcwd())
    module_name, _, attr = ref.partition(":")
    torch.manual_seed(0)
    model = getattr(importlib.import_module(module_name), attr)()
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    if channels_last == "1":
        model = model.to(memory_format=torch.channels_last)
    inputs = [torch.randn([int(d) for d in s.split("x")], device=device,
                          dtype=getattr(torch, dtype)) for s in shapes]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    wait = None
    if variant == "torch.compile reduce-overhead":
        compiled = torch.compile(model, mode="reduce-overhead")
    elif variant == "torch.compile backend=fusion_compiler":
        import fusion_compiler.dynamo  # noqa: PLC0415  (timed: part of the first output's cost)

        compiled = torch.compile(model, backend="fusion_compiler")
        wait = fusion_compiler.dynamo.wait_for_background_compiles
    else:
        import fusion_compiler  # noqa: PLC0415  (timed: part of the first output's cost)

        compiled = fusion_compiler.compile(model, **json.loads(variant))
        wait = compiled.wait_for_background_compiles
    with torch.inference_mode():
        compiled(*inputs)
    sync()
    first = time.perf_counter() - start
    if wait is None or wait(0):
        return [first]
    wait()
    return [first, time.perf_counter() - start]


def cache_lookups() -> dict[str, dict[str, int]]:
    """Inductor's FX graph cache and AOTAutograd's cache lookups so far in this process, by
    outcome (``hit``, ``miss``, ``bypass``), from Dynamo's counters; empty when nothing loaded
    them (no ``torch.compile`` or Inductor ran)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    found = {}
    for cache, group, prefix in (("fxgraph", "inductor", "fxgraph_cache_"),
                                 ("aot_autograd", "aot_autograd", "autograd_cache_")):
        counts = {outcome: utils.counters[group][prefix + outcome]
                  for outcome in ("hit", "miss", "bypass")}
        if any(counts.values()):
            found[cache] = {k: v for k, v in counts.items() if v}
    return found


if __name__ == "__main__":
    seconds = main(sys.argv[1:])
    if lookups := cache_lookups():
        print("caches", json.dumps(lookups))
    print(*seconds)
