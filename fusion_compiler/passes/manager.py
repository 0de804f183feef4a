"""The pass manager: runs a pipeline of ``GraphModule -> GraphModule`` passes in order, logging
each, re-propagating tensor metadata after each one (pre-fusion and fusion pipelines) and handing
every intermediate graph to a callback (the stages ``fusion-compiler dump --stage`` shows)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ..shapes import apply_meta, encode_meta, propagate_shapes
from ..ir.errors import InputShapeError, condense

__all__ = ["Pass", "PassManager", "REAL_PROPAGATION_BUDGET_S", "CAPTURED_OUTPUT_DTYPES"]

log = logging.getLogger("fusion_compiler")
CAPTURED_OUTPUT_DTYPES = "captured_output_dtypes"
"""Key of ``gm.meta``: the dtype of each output of the captured graph (flattened; ``None`` for
what is not a tensor), as the model returns them: what a pass that changes dtypes (``autocast``)
restores at the outputs."""
REAL_PROPAGATION_BUDGET_S = 0.2
"""Shapes are propagated by running the graph on (copies of) the example inputs while one such
run takes at most this long (seconds, host time; the first run 5x as long); after a slower run the
later stages use meta tensors, so a large input costs at most about one extra forward. A run on
small inputs is far cheaper than meta propagation's first use, which imports ``torch._dynamo`` and
sympy (measurements: docs/decisions.md, "Shape propagation on real inputs under a 0.2 s budget")."""


@dataclass(frozen=True)
class Pass:
    """A named graph transformation ``fn(gm) -> gm`` (it may rewrite ``gm`` in place); ``name``
    is its stage name."""

    name: str
    fn: Callable[[fx.GraphModule], fx.GraphModule]


class PassManager:
    """Run ``passes`` in order on a graph specialized to ``example_inputs``.

    Each pass is logged (DEBUG: its name and host time; with ``FUSION_COMPILER_LOG=debug`` the
    graph after it too). With ``propagate`` (the pre-fusion and fusion pipelines), after every pass
    the graph is linted, recompiled and its ``node.meta["val"]`` refreshed by
    shape propagation (:func:`~fusion_compiler.shapes.propagate_shapes`; skipped when the pass
    changed no graph: the same generated code of the graph and of every graph module in it, and
    every node still has its value), so each pass sees shapes, dtypes and strides of every node:
    by running the graph on copies of the example inputs
    (no side effects, see ``shapes._real_propagation``) while a run stays within
    :data:`REAL_PROPAGATION_BUDGET_S` and succeeds, else on meta tensors. ``known_shapes`` (stage
    name -> table of :func:`~fusion_compiler.shapes.encode_meta`) holds what an earlier compile
    of the same model for the same inputs recorded: a stage found there is not propagated again;
    ``recorded`` holds the tables of the stages propagated now.
    ``on_stage(name, gm)`` is called with the captured graph (``"captured"``, with ``propagate``)
    and after each pass. Without ``propagate`` (post-lowering and glue passes, which keep the
    metadata of what they change themselves) the graph is only linted and recompiled.
    """

    def __init__(self, passes: Sequence[Pass], example_inputs: Sequence[Any] = (),
                 on_stage: Callable[[str, fx.GraphModule], None] | None = None,
                 known_shapes: dict[str, dict] | None = None, propagate: bool = True):
        self.passes = list(passes)
        self.propagate = propagate
        self.example_inputs = list(example_inputs)
        self.on_stage = on_stage
        self.known_shapes = known_shapes or {}
        self.recorded: dict[str, dict] = {}
        self.real = True  # propagate by running on the inputs while that stays cheap
        self._last: dict | None = None  # the table of the latest stage

    def _propagate(self, stage: str, gm: fx.GraphModule, unchanged: bool = False) -> None:
        known = self.known_shapes.get(stage)
        if known is not None and apply_meta(gm, known):
            self._last = known
            return
        if unchanged:  # the pass left every graph as it was: the metadata still holds
            if self._last is not None:
                self.recorded[stage] = self._last
            return
        if self.real:
            start = time.perf_counter()
            try:
                propagate_shapes(gm, self.example_inputs, real=True)
            except Exception as exc:  # an op that cannot run here: meta functions still can
                # the graph ran before this pass and not after it: most likely the pass's bug
                level = logging.DEBUG if stage == "captured" else logging.WARNING
                log.log(level, "the graph after pass %s does not run on the example inputs "
                        "(%s: %s); shapes come from meta tensors from here on", stage,
                        type(exc).__name__, condense(str(exc), limit=200))
                self.real = False
                propagate_shapes(gm, self.example_inputs)
            # the first run also pays lazy initialization (cuDNN and cuBLAS handles, CPU
            # thread pools): it gets 5x the budget
            budget = REAL_PROPAGATION_BUDGET_S * (5 if stage == "captured" else 1)
            if time.perf_counter() - start > budget:
                self.real = False
        else:
            propagate_shapes(gm, self.example_inputs)
        table = self._last = encode_meta(gm)
        if table is not None:
            self.recorded[stage] = table

    def _stage(self, name: str, gm: fx.GraphModule) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("graph after %s:\n%s", name, gm.code)
        if self.on_stage is not None:
            self.on_stage(name, gm)

    def run(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Run every pass on ``gm``.

        Raises:
            InputShapeError: (with ``propagate``) the example inputs do not fit the captured model
                (wrong rank, channel count, ...); the message carries PyTorch's own error.
        """
        if self.propagate:
            try:
                self._propagate("captured", gm)
            except Exception as exc:  # shape errors surface as many exception types
                first = str(exc).strip().splitlines()[0] if str(exc).strip() \
                    else type(exc).__name__
                shapes = ", ".join(str(tuple(a.shape)) for a in self.example_inputs
                                   if hasattr(a, "shape"))
                raise InputShapeError(f"inputs of shape {shapes} do not fit the model: "
                                      f"{first}") from exc
            outputs = tree_flatten(gm.graph.find_nodes(op="output")[0].args[0])[0]
            vals = [n.meta.get("val") if isinstance(n, fx.Node) else n for n in outputs]
            gm.meta[CAPTURED_OUTPUT_DTYPES] = [v.dtype if isinstance(v, torch.Tensor) else None
                                               for v in vals]
            self._stage("captured", gm)
        for p in self.passes:
            start = time.perf_counter()
            before = _codes(gm) if self.propagate else None
            gm = p.fn(gm)
            gm.graph.lint()
            gm.recompile()
            if self.propagate:
                unchanged = _codes(gm) == before and all(
                    "val" in n.meta for n in gm.graph.nodes if n.op != "output")
                self._propagate(p.name, gm, unchanged=unchanged)
            log.debug("pass %s: %.1f ms", p.name, 1e3 * (time.perf_counter() - start))
            self._stage(p.name, gm)
        return gm


def _codes(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The generated code of ``gm`` and of every graph module inside it (regions): equal before
    and after a pass when the pass changed no graph."""
    return [(name, m.code) for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)]
