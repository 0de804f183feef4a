"""The pass manager: runs ``GraphModule -> GraphModule`` passes in order, re-propagating tensor
metadata after each one and optionally handing every intermediate graph to a callback."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.fx as fx

from ..capture import propagate_shapes

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
    fake-tensor propagation, so each pass sees shapes, dtypes and strides of every node.
    ``on_stage(name, gm)`` is called with the captured graph (``"captured"``) and after each pass;
    with ``FUSION_COMPILER_LOG=debug`` every stage's code is also logged.
    """

    def __init__(self, passes: Sequence[Pass], example_inputs: Sequence[Any],
                 on_stage: Callable[[str, fx.GraphModule], None] | None = None):
        self.passes = list(passes)
        self.example_inputs = list(example_inputs)
        self.on_stage = on_stage

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
            propagate_shapes(gm, self.example_inputs)
        except Exception as exc:  # shape errors surface as many exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            shapes = ", ".join(str(tuple(a.shape)) for a in self.example_inputs if hasattr(a, "shape"))
            raise ValueError(f"inputs of shape {shapes} do not fit the model: {first}") from exc
        self._stage("captured", gm)
        for p in self.passes:
            gm = p.fn(gm)
            gm.graph.lint()
            gm.recompile()
            propagate_shapes(gm, self.example_inputs)
            self._stage(p.name, gm)
        return gm
