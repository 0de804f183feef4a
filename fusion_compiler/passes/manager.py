"""The pass manager: runs ``GraphModule -> GraphModule`` passes in order, re-propagating tensor
metadata after each one and optionally handing every intermediate graph to a callback."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.fx as fx

from ..capture import apply_meta, encode_meta, propagate_shapes

__all__ = ["Pass", "PassManager"]

log = logging.getLogger("fusion_compiler")


@dataclass(frozen=True)
class Pass:
    """A named graph transformation ``fn(gm) -> gm`` (it may rewrite ``gm`` in place)."""

    name: str
    fn: Callable[[fx.GraphModule], fx.GraphModule]


class PassManager:
    """Run ``passes`` in order on a graph specialized to ``example_inputs``.

    After every pass the graph is linted, recompiled and its ``node.meta["val"]`` refreshed by
    shape propagation (:func:`~fusion_compiler.capture.propagate_shapes`), so each pass sees
    shapes, dtypes and strides of every node. ``known_shapes`` (stage name -> table of
    :func:`~fusion_compiler.capture.encode_meta`) holds what an earlier compile of the same model
    for the same inputs recorded: a stage found there is not propagated again (no meta kernel runs,
    which on a first use imports sympy and ``torch._dynamo``: seconds); ``recorded`` holds the
    tables of the stages propagated now.
    ``on_stage(name, gm)`` is called with the captured graph (``"captured"``) and after each pass;
    with ``FUSION_COMPILER_LOG=debug`` every stage's code is also logged.
    """

    def __init__(self, passes: Sequence[Pass], example_inputs: Sequence[Any],
                 on_stage: Callable[[str, fx.GraphModule], None] | None = None,
                 known_shapes: dict[str, dict] | None = None):
        self.passes = list(passes)
        self.example_inputs = list(example_inputs)
        self.on_stage = on_stage
        self.known_shapes = known_shapes or {}
        self.recorded: dict[str, dict] = {}

    def _propagate(self, stage: str, gm: fx.GraphModule) -> None:
        known = self.known_shapes.get(stage)
        if known is not None and apply_meta(gm, known):
            return
        propagate_shapes(gm, self.example_inputs)
        table = encode_meta(gm)
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
            ValueError: the example inputs do not fit the captured model (wrong rank, channel
                count, ...); the message carries PyTorch's own error.
        """
        try:
            self._propagate("captured", gm)
        except Exception as exc:  # shape errors surface as many exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            shapes = ", ".join(str(tuple(a.shape)) for a in self.example_inputs if hasattr(a, "shape"))
            raise ValueError(f"inputs of shape {shapes} do not fit the model: {first}") from exc
        self._stage("captured", gm)
        for p in self.passes:
            gm = p.fn(gm)
            gm.graph.lint()
            gm.recompile()
            self._propagate(p.name, gm)
            self._stage(p.name, gm)
        return gm
