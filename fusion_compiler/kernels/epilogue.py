"""A region's epilogue as the Triton kernels of this package take it: the chain of ops after the
convolution, each applied to the previous value (the chain value), read off the region's graph.

The kernels (:mod:`.space_to_depth`, :mod:`.conv`) run the chain on their fp32 accumulator and
store the values the region returns; they share the op codes (:data:`CODES`, the constexpr
arguments of their Triton kernels) and differ in which ops and operands they take, which they pass
to :func:`epilogue_chain` and :func:`binary_operand`. :func:`reference_outputs` is the chain as
torch ops, for their references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.ops import COMMUTATIVE
from ..ir.region import Region, operand_kind

__all__ = ["CODES", "BINARY", "ADD", "SUB", "MUL", "DIV", "RELU", "SIGMOID", "TANH", "SILU",
           "CLAMP", "WITH_CLAMP", "WITH_OPERAND", "Step", "epilogue_chain", "binary_operand",
           "reference_outputs"]

ADD, SUB, MUL, DIV, RELU, SIGMOID, TANH, SILU, CLAMP = range(1, 10)
CODES = {torch.add: ADD, torch.sub: SUB, torch.mul: MUL, torch.div: DIV, torch.relu: RELU,
         torch.sigmoid: SIGMOID, torch.tanh: TANH, F.silu: SILU}
"""Epilogue op codes, as the kernels' constexpr arguments take them (0: no op)."""
WITH_CLAMP = {**CODES, torch.clamp: CLAMP}
""":data:`CODES` and the clipped ReLU ``clamp(x, 0, c)`` (ReLU6: MobileNet), for the kernels that
run it (:mod:`.conv`, :mod:`.depthwise`): its bound ``c`` is passed as a one-element operand."""
BINARY = frozenset({ADD, SUB, MUL, DIV})
"""The codes whose op takes a second operand (the chain value is the first)."""
WITH_OPERAND = BINARY | {CLAMP}
"""The codes whose kernel step reads an operand (a binary op's, or the clamp's bound)."""
_FUNCTIONS = {code: fn for fn, code in CODES.items()}
_FUNCTIONS[CLAMP] = lambda y, bound: torch.clamp(y, torch.zeros_like(bound), bound)


@dataclass(frozen=True)
class Step:
    """One op of the chain: its node, the kernel's code for it and, for a binary op, its other
    operand (a graph node or a number); ``None`` for an activation."""

    node: fx.Node
    code: int
    other: Any = None


def epilogue_chain(region: Region, codes: Mapping[Any, int], binary: Collection[int],
                   max_steps: int, max_outputs: int, prologue: bool
                   ) -> tuple[list[Step], list[int]] | str:
    """The ops after ``region``'s convolution as :class:`Step` s, and per region output the
    stage it returns (0: the convolution's value, ``i``: the value after step ``i``); or why a
    kernel with op ``codes`` (``binary``: the codes taking a second operand), at most
    ``max_steps`` ops and ``max_outputs`` outputs cannot run it (a text). ``prologue``: ops
    before the convolution are the kernel's own business (else they are a reason)."""
    conv = region.conv
    stage = {conv: 0}
    chain, steps, after = conv, [], False
    for node in region.graph_module.graph.nodes:
        if node is conv or node.op in ("placeholder", "output"):
            after = after or node is conv
            continue
        if not after:
            if prologue:
                continue
            return "the region has ops before its convolution (a prologue)"
        code = codes.get(node.target) if node.op == "call_function" else None
        if code is None:
            return f"epilogue op {node.format_node()} is not one the kernel runs"
        if code == CLAMP:  # clamp(chain, 0, c) (the fusion pass's form): c is the operand
            if node.kwargs or len(node.args) != 3 or node.args[0] is not chain \
                    or node.args[1] != 0 or not isinstance(node.args[2], (int, float)):
                return f"{node.name} is not clamp(x, 0, c) of the chain value"
            steps.append(Step(node, code, node.args[2]))
            chain = node
            stage[node] = len(steps)
            continue
        if node.kwargs or not node.args or (node.args[0] is not chain and not (
                code in binary and node.target in COMMUTATIVE and node.args[1] is chain)):
            return f"{node.name} does not take the chain value as its operand"
        if code not in binary and len(node.args) != 1:
            return f"{node.name} has arguments besides the chain value"
        other = (node.args[1] if node.args[0] is chain else node.args[0]) if code in binary \
            else None
        steps.append(Step(node, code, other))
        chain = node
        stage[node] = len(steps)
    outputs = [stage.get(n, -1) for n in region.output_nodes]
    if len(steps) > max_steps or -1 in outputs or len(outputs) > max_outputs:
        return (f"{len(steps)} epilogue ops and {len(region.output_nodes)} outputs; the kernel "
                f"takes {max_steps} and {max_outputs}, all values of the chain")
    if any(n.meta["val"].dtype != conv.meta["val"].dtype for n in region.output_nodes):
        return "an output of another dtype than the convolution's"
    return steps, outputs


def binary_operand(step: Step, region: Region, kinds: Collection[str], device: torch.device
                   ) -> tuple[int | torch.Tensor, str] | None:
    """A binary step's other operand as a kernel takes it, with its kind (:func:`operand_kind`
    against the convolution's output, one of ``kinds``): a number becomes a one-element fp32
    tensor on ``device`` (kind ``"scalar"``), a region input its position among the region's
    placeholders; ``None`` when it is neither or of another kind."""
    other = step.other
    if isinstance(other, (int, float)):
        return torch.tensor([float(other)], device=device), "scalar"
    if not isinstance(other, fx.Node) or other.op != "placeholder":
        return None
    kind = operand_kind(tuple(other.meta["val"].shape), tuple(region.conv.meta["val"].shape))
    if kind not in kinds:
        return None
    names = [n.name for n in region.graph_module.graph.find_nodes(op="placeholder")]
    return names.index(other.name), kind


def reference_outputs(y: torch.Tensor, codes: Sequence[int], operands: Sequence[torch.Tensor],
                      outputs: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """The chain ``codes`` applied to ``y`` (the convolution's value, in the precision to
    compute in) as torch ops, ``operands`` the binary ops' second operands and the clamps'
    bounds in order (one element, ``[K]``/``[1, K, 1, 1]`` or full); the values of stages
    ``outputs`` (0: ``y``) rounded to ``dtype`` once each, channels_last."""
    stages, it = [y], iter(operands)
    for code in codes:
        if code in WITH_OPERAND:
            other = next(it).to(y.dtype)
            y = _FUNCTIONS[code](y, other.reshape(1, -1, 1, 1) if other.dim() < 4 else other)
        else:
            y = _FUNCTIONS[code](y)
        stages.append(y)
    return [stages[i].to(dtype).contiguous(memory_format=torch.channels_last) for i in outputs]
