"""cuDNN graphs as plain data ("recipes"), and the ``cudnn.pygraph`` built from one.

A recipe says everything a cuDNN graph is: tensors with dims, strides and data types, operations
with their attributes, outputs. It is JSON-ready data (dicts, lists, strings, numbers), so it can
cross a process boundary and serve as a cache key. This module imports only the standard library
and, when a graph is built, the cuDNN frontend (``cudnn``): never torch. The plan-build worker
processes (:mod:`.workers`) build graphs from recipes without paying torch's import.

Format::

    {"io": "HALF",                                   # io_data_type (intermediate, compute: FLOAT)
     "inputs":  [{"name", "dim", "stride", "dtype"}, ...],
     "ops":     [{"op", "name", "args": {port: ref}, "attrs": {...}, "out": {...}}, ...],
     "outputs": [{"ref", "dim", "stride", "dtype"}, ...]}

A ``ref`` is the name of an input or of an op's output, or ``{"scalar": x}``: a pass-by-value fp32
``[1,1,1,1]`` constant. ``out`` optionally sets an op output's ``dtype``/``dim``/``stride``
(a prologue output in the I/O type, the reduction's ``[N,K,1,1]``). Ops and their ports:

====================  ======================  ==============================================
op                    ports                   attrs
====================  ======================  ==============================================
``conv_fprop``        image, weight           padding, stride, dilation
``conv_dgrad``        loss, filter            padding, stride, dilation
``conv_wgrad``        image, loss             padding, stride, dilation
``add`` ``sub``       a, b
``mul`` ``div``       a, b
``relu``              input                   lower_clip, upper_clip (optional)
``sigmoid`` ``tanh``  input
``swish``             input                   (beta 1: SiLU)
``relu_backward``     loss, input
``reduction_add``     input
====================  ======================  ==============================================

UIDs, fixed by position so that a plan serialized in one process executes in another: input ``i``
gets ``1 + i``, output ``j`` gets ``OUTPUT_UID + j``, the ``k``-th scalar constant
``CONSTANT_UID + k``. Every op output that is not a graph output stays virtual, and compute and
intermediate types are fp32 (cuDNN graph rules: docs/cudnn.md, "Graph API calls used").
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CudnnGraph", "build_pygraph", "canonical", "recipe_key", "any_batch_key", "OUTPUT_UID",
           "CONSTANT_UID", "nhwc_strides"]

OUTPUT_UID = 1000
CONSTANT_UID = 2000

_CONV = ("conv_fprop", "conv_dgrad", "conv_wgrad")
_PORTS = {"conv_fprop": ("image", "weight"), "conv_dgrad": ("loss", "filter"),
          "conv_wgrad": ("image", "loss"), "add": ("a", "b"), "sub": ("a", "b"),
          "mul": ("a", "b"), "div": ("a", "b"), "relu": ("input",), "sigmoid": ("input",),
          "tanh": ("input",), "swish": ("input",), "relu_backward": ("loss", "input"),
          "reduction_add": ("input",)}


def nhwc_strides(shape) -> list[int]:
    """Fully packed channels_last strides (elements) of a logical NCHW ``shape`` of rank 4."""
    n, c, h, w = shape
    return [c * h * w, 1, w * c, c]


@dataclass
class CudnnGraph:
    """A built (not yet planned) cuDNN graph.

    ``inputs[i]`` is the graph tensor of the recipe's i-th input, ``outputs[j]`` of its j-th output;
    ``constants`` are ``(graph tensor, value)`` of the pass-by-value scalars (fp32, ``[1,1,1,1]``,
    passed from host memory at execution).
    """

    graph: Any
    inputs: list[Any]
    outputs: list[Any]
    constants: list[tuple[Any, float]] = field(default_factory=list)


def build_pygraph(recipe: dict, handle: Any = None) -> CudnnGraph:
    """Build the ``cudnn.pygraph`` a recipe describes (see module docstring); UIDs assigned.

    No GPU is needed until ``validate()``. ``handle`` binds the graph to a cuDNN handle (for
    building and executing); ``None`` only describes it.

    Raises:
        ImportError: the cuDNN frontend is not installed.
        KeyError, ValueError: a malformed recipe (unknown op, port or data type).
    """
    import cudnn  # noqa: PLC0415  (the frontend, imported when a graph is built)

    dtype = cudnn.data_type
    fp32 = dtype.FLOAT
    kwargs = dict(io_data_type=getattr(dtype, recipe["io"]), intermediate_data_type=fp32,
                  compute_data_type=fp32)
    if handle is not None:
        kwargs["handle"] = handle
    g = cudnn.pygraph(**kwargs)
    values: dict[str, Any] = {}
    inputs, constants = [], []
    for i, t in enumerate(recipe["inputs"]):
        tensor = g.tensor(name=t["name"], dim=list(t["dim"]), stride=list(t["stride"]),
                          data_type=getattr(dtype, t["dtype"]))
        tensor.set_uid(1 + i)
        values[t["name"]] = tensor
        inputs.append(tensor)

    def ref(r: Any) -> Any:
        if isinstance(r, dict):
            c = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32,
                         is_pass_by_value=True)
            c.set_uid(CONSTANT_UID + len(constants))
            constants.append((c, float(r["scalar"])))
            return c
        return values[r]

    for op in recipe["ops"]:
        kind, name, attrs = op["op"], op["name"], op.get("attrs", {})
        args = {port: ref(op["args"][port]) for port in _PORTS[kind] if port in op["args"]}
        if kind in _CONV:
            out = getattr(g, kind)(**args, padding=list(attrs["padding"]),
                                   stride=list(attrs["stride"]), dilation=list(attrs["dilation"]),
                                   compute_data_type=fp32, name=name)
        elif kind in ("add", "sub", "mul", "div"):
            out = getattr(g, kind)(**args, compute_data_type=fp32, name=name)
        elif kind == "relu":
            out = g.relu(**args, name=name, **{k: float(v) for k, v in attrs.items()})
        elif kind == "swish":
            out = g.swish(**args, swish_beta=1.0, name=name)
        elif kind in ("sigmoid", "tanh", "relu_backward"):
            out = getattr(g, kind)(**args, name=name)
        elif kind == "reduction_add":
            out = g.reduction(**args, mode=cudnn.reduction_mode.ADD, compute_data_type=fp32,
                              name=name)
        else:
            raise ValueError(f"unknown recipe op {kind!r}")
        _shape_out(out, op.get("out", {}), dtype)
        values[name] = out
    outputs = []
    for j, o in enumerate(recipe["outputs"]):
        t = values[o["ref"]]
        t.set_output(True)
        _shape_out(t, o, dtype)
        t.set_uid(OUTPUT_UID + j)
        outputs.append(t)
    return CudnnGraph(g, inputs, outputs, constants)


def _shape_out(tensor: Any, spec: dict, dtype: Any) -> None:
    if "dtype" in spec:
        tensor.set_data_type(getattr(dtype, spec["dtype"]))
    if "dim" in spec:
        tensor.set_dim(list(spec["dim"]))
    if "stride" in spec:
        tensor.set_stride(list(spec["stride"]))


def canonical(recipe: dict) -> dict:
    """``recipe`` with every tensor and op renamed by position (``t0``, ``t1``, ...): two regions
    with the same ops on tensors of the same shapes get the same canonical recipe, hence one plan
    (one build, one autotune) and one cache entry."""
    names: dict[str, str] = {}
    out = copy.deepcopy(recipe)
    for item in (*out["inputs"], *out["ops"]):
        names[item["name"]] = item["name"] = f"t{len(names)}"
    for op in out["ops"]:
        op["args"] = {p: r if isinstance(r, dict) else names[r] for p, r in op["args"].items()}
    for o in out["outputs"]:
        o["ref"] = names[o["ref"]]
    return out


def recipe_key(recipe: dict) -> str:
    """A stable text of the canonical recipe: what a plan (and its cache entry) is keyed by."""
    return json.dumps(canonical(recipe), sort_keys=True, separators=(",", ":"))


def any_batch_key(recipe: dict) -> str:
    """:func:`recipe_key` with the batch dimension of every tensor marked ``"batched"`` replaced
    by ``"N"``: the same graph at any batch size. A plan choice (engine and knobs) made for one
    batch size is reused for another under this key."""
    out = canonical(recipe)
    for t in (*out["inputs"], *out["outputs"], *(op.get("out", {}) for op in out["ops"])):
        if t.get("batched") and "dim" in t:
            t["dim"] = ["N", *t["dim"][1:]]  # NHWC strides do not depend on N
    return json.dumps(out, sort_keys=True, separators=(",", ":"))
