"""A glue rewrite: this package's kernels called through their ``torch.library`` ops."""

from __future__ import annotations

import torch.fx as fx

__all__ = ["kernels_as_library_ops"]


def kernels_as_library_ops(gm: fx.GraphModule) -> int:
    """Make each call of one of this package's glue kernels
    (:func:`~fusion_compiler.kernels.se_gate.se_gate`,
    :func:`~fusion_compiler.kernels.se_gate.se_scale`: plain functions, so that eager graphs call
    the kernels directly) a call of its ``torch.library`` op, in place; returns how many. A trace
    records the op either way, but AOTAutograd's cache takes a graph only when every
    ``call_function`` is an op or function it knows, and bypassed the glue graph otherwise."""
    from ...kernels.se_gate import LIBRARY_OPS  # noqa: PLC0415

    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in LIBRARY_OPS:
            node.target = LIBRARY_OPS[node.target]
            changed += 1
    if changed:
        gm.recompile()
    return changed
