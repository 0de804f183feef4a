"""The glue pipeline: rewrites of the ops between regions made on the copy of a lowered graph
that Inductor compiles (never on the graph that runs eagerly), and what Inductor would compile
there (:func:`inductor_work`), and whether Inductor compiles it at all (:mod:`.choice`)."""

from .choice import auto_glue_backend, glue_compiled_expected, inductor_reason
from .library_ops import kernels_as_library_ops
from .linears import MAX_MACS, MAX_WEIGHT, small_linears_as_reductions
from .work import inductor_work

__all__ = ["small_linears_as_reductions", "kernels_as_library_ops", "inductor_work", "MAX_WEIGHT",
           "MAX_MACS", "auto_glue_backend", "glue_compiled_expected", "inductor_reason"]
