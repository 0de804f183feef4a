"""The glue pipeline: rewrites of the ops between regions, made on the copy of a lowered graph
that Inductor compiles (never on the graph that runs eagerly)."""

from .linears import MAX_MACS, MAX_WEIGHT, small_linears_as_reductions
from .se_gate import FUSED_SQUEEZE, se_gates

__all__ = ["se_gates", "small_linears_as_reductions", "FUSED_SQUEEZE", "MAX_WEIGHT", "MAX_MACS"]
