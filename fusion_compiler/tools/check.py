"""``fusion_compiler.check``: the compiled model's numerics against an fp64 reference, per region.

What is compared (each error is ``max |a - r| / max |r|`` against the fp64 value ``r``):

* the model's outputs: the compiled module as the user calls it (its defaults: CUDA graph, glue
  backend) against the model run in fp64, each run with the random number generators seeded
  alike (dropout in training mode draws the same mask); an output that is not floating point
  (indices, masks) by the fraction of its elements unequal to fp64's;
* per region, its forward outputs: the lowered kernel on the inputs it received in the compiled
  graph, against the region's own ops (``region.graph_module``) on the same inputs in fp64. Errors
  do not accumulate from one region to the next, so a broken region is named, not its successors;
* with ``train=True`` also every gradient: each parameter's (upstream gradient of every output
  drawn from U(0.5, 1.5), never zero) and, per region, the gradient of each region input that
  needs one, from the region's backward (upstream U(0.5, 1.5) on the outputs the graph reads)
  against fp64 autograd of the region's ops. Where the compiled backward fuses a ReLU backward
  across regions (``region.dgrad_drelu``, ``region.masked_outputs``) the reference applies the
  same mask, so each region is checked for the function its backward computes. A parameter
  whose gradient is ``None`` in one and not in the other fails.

A value passes when its error is within the tolerance of its dtype (:func:`tolerance`) or within
``EAGER_FACTOR`` times the error of PyTorch's own ops in that dtype on the same inputs (the
``eager`` column: some values are ill-conditioned in any low precision), the latter only where
eager gives the same values when run again on the same inputs: otherwise the forward is not one
function of its inputs (it changes or reads state between calls), eager vouches for nothing,
and the value must be within the tolerance (a compiled value 75% off passed beside eager's 44%).
"""

from __future__ import annotations

import copy
import io
import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ..compiler import CompiledModule
from ..ir.region import Region

__all__ = ["check", "CheckReport", "Comparison", "tolerance", "relative_error", "floating_outputs",
           "TOLERANCES", "EAGER_FACTOR"]

# Largest error (max |a - r| / max |r| against fp64) accepted per dtype: about 20 unit roundoffs
# of the dtype (fp16 u = 2^-11 = 4.9e-4, bf16 u = 2^-8 = 3.9e-3); fp32 1e-4 leaves room for
# reduction order over 12+ layers. fp32 convolutions on CUDA may run as TF32 (fp16's 10-bit
# mantissa: PyTorch's and this package's default, torch.backends.cudnn.allow_tf32) and then get
# fp16's tolerance.
TOLERANCES = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4,
              torch.float64: 1e-10}
EAGER_FACTOR = 2.0


def tolerance(dtype: torch.dtype, device: torch.device | str) -> float:
    """The accepted error for values of ``dtype`` computed on ``device`` (see ``TOLERANCES``).

    Raises:
        ValueError: ``dtype`` is not a floating dtype of ``TOLERANCES``.
    """
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for {dtype}; floating dtypes: {list(TOLERANCES)}")
    if dtype == torch.float32 and torch.device(device).type == "cuda" \
            and torch.backends.cudnn.allow_tf32:
        return TOLERANCES[torch.float16]
    return TOLERANCES[dtype]


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |a - r| / max |r|`` in fp64 (``0.0`` when both are all zeros, ``inf`` when only the
    reference is)."""
    reference = reference.detach().double()
    diff = (actual.detach().double() - reference).abs().max().item()
    scale = reference.abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


@dataclass
class Comparison:
    """One value compared with its fp64 reference.

    ``name`` says which (``"output 0"``, ``"grad layer1.conv1.weight"``, ``"forward out 0"``,
    ``"grad of weight"``), ``region`` is the region id or ``None`` for the whole model, ``error``
    and ``eager_error`` are ``max |a - r| / max |r|`` of the compiled value and of PyTorch's ops
    in the same dtype, ``tolerance`` that of the dtype.
    """

    name: str
    region: str | None
    error: float
    eager_error: float | None
    tolerance: float
    eager_unsound: bool = False
    """Eager gave other values when run again on the same inputs: it vouches for nothing."""

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance or (
            not self.eager_unsound and self.eager_error is not None
            and self.error <= EAGER_FACTOR * self.eager_error)


@dataclass
class CheckReport:
    """What :func:`check` found: ``comparisons`` in order (model outputs, model gradients, then
    per region), the dtype and device, and whether gradients were checked (``train``)."""

    dtype: str
    device: str
    train: bool
    inputs: list[str]
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def mismatched_regions(self) -> list[str]:
        """Ids of the regions with a value outside its tolerance, in graph order."""
        return list(dict.fromkeys(c.region for c in self.comparisons
                                  if not c.ok and c.region is not None))

    def __str__(self) -> str:
        """The table of :meth:`format` (``print(check(model, x))`` prints it)."""
        return self.format()

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "mismatched_regions": self.mismatched_regions,
                "comparisons": [{**asdict(c), "ok": c.ok} for c in self.comparisons]}

    def format(self, title: str = "") -> str:
        """A table of every comparison (mismatches marked) and a verdict line."""
        from rich.console import Console  # noqa: PLC0415
        from rich.table import Table  # noqa: PLC0415
        from rich.text import Text  # noqa: PLC0415

        header = (f"{title + ': ' if title else ''}numerics against fp64 ({self.dtype} on "
                  f"{self.device}, {'forward and gradients' if self.train else 'forward'}; "
                  f"inputs {', '.join(self.inputs)})\n")
        table = Table()
        for col in ("region", "value", "error", "eager error", "tolerance", ""):
            table.add_column(col, justify="right" if "error" in col or col == "tolerance"
                             else "left")
        for c in self.comparisons:
            eager = "" if c.eager_error is None else f"{c.eager_error:.2e}"
            table.add_row(*(Text(x) for x in (c.region or "model", c.name, f"{c.error:.2e}", eager,
                                              f"{c.tolerance:.0e}", "ok" if c.ok else "MISMATCH")))
        buf = io.StringIO()
        Console(file=buf, width=100, force_terminal=False, color_system=None).print(table)
        bad = self.mismatched_regions
        model_bad = [c.name for c in self.comparisons if not c.ok and c.region is None]
        unsound = [c.name for c in self.comparisons if c.eager_unsound]
        if unsound:
            buf.write(f"eager gave other values for {', '.join(unsound[:3])} when run again on "
                      "the same inputs: the forward is not one function of its inputs (it "
                      "changes or reads state between calls?), so eager vouches for none\n")
        if self.ok:
            verdict = f"check passed: {len(self.comparisons)} values within tolerance"
        else:
            verdict = ("check FAILED: " + "; ".join(
                part for part in (f"regions {', '.join(bad)}" if bad else "",
                                  f"model {', '.join(model_bad)}" if model_bad else "") if part))
        return header + buf.getvalue() + verdict + "\n"


class _RegionRecorder(fx.Interpreter):
    """Runs a lowered graph and keeps, per region call, its inputs and outputs (detached)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.calls: list[tuple[fx.Node, Region, tuple, tuple]] = []

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_module" and isinstance(region := self.fetch_attr(n.target), Region):
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a
                         for a in self.fetch_args_kwargs_from_env(n)[0])
            self.calls.append((n, region, args, tuple(o.detach() for o in out)))
        return out


def floating_outputs(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output (any nesting of tuples, lists, dicts)."""
    return [t for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _other_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output that are not floating point (indices, masks, counts)."""
    return [t for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and not t.is_floating_point()]


def _differing(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """The fraction of elements of ``actual`` unequal to ``reference`` (1 for another shape)."""
    if actual.shape != reference.shape:
        return 1.0
    return (actual.cpu() != reference.cpu()).double().mean().item() if actual.numel() else 0.0


def _seeded(module: Any, args: Sequence[Any], seed: int) -> Any:
    """``module(*args)`` with the random number generators (CPU and CUDA) seeded with ``seed``
    and given back their state after."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())
                               if torch.cuda.is_initialized() else []):
        torch.manual_seed(seed)
        return module(*args)


def _double(a: Any, grad: bool = False) -> Any:
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return a.detach().double().requires_grad_(grad)
    return a


def _upstream(outputs: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Upstream gradients for ``outputs``: U(0.5, 1.5) in each output's dtype and layout (drawn
    in fp32, then rounded)."""
    gen = torch.Generator(device=outputs[0].device if outputs else "cpu").manual_seed(seed)
    return [torch.empty_like(o, dtype=torch.float32).uniform_(0.5, 1.5, generator=gen)
            .to(o.dtype) for o in outputs]


def _weighted_sum(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((o.double() * g.double()).sum() for o, g in zip(outputs, grads))


def check(model: torch.nn.Module, *inputs: Any, train: bool | None = None,
          seed: int = 0, **options: Any) -> CheckReport:
    """Compile ``model`` (or take an already compiled :class:`CompiledModule`), run it on
    ``inputs`` and compare with an fp64 copy of the model, whole and per region (module doc).

    Args:
        model: the model in its dtype and on its device (it is not changed: the compiled and the
            eager runs use copies), or a ``CompiledModule`` (checked as it is; its ``model`` is the
            reference).
        inputs: the example inputs (tensors in the model's dtype; at least one floating value
            in every output, never all zeros).
        train: also check gradients (default: ``model.training``).
        options: :func:`fusion_compiler.compile`'s, for a model not compiled yet.
        seed: of the upstream gradients.

    Returns:
        A :class:`CheckReport`; ``report.ok`` is the verdict, ``report.mismatched_regions`` names
        the regions outside tolerance.

    Raises:
        ValueError: the model has no floating parameter or input to take a dtype from; with
            ``train``, no floating output depends on something requiring grad.
        FusionError: the model cannot be compiled.
    """
    if isinstance(model, CompiledModule):
        compiled, base = model, model.model
    else:
        base = copy.deepcopy(model)
        compiled = CompiledModule(base, **options)
    train = base.training if train is None else train
    floats = [t for t in (*base.parameters(), *inputs)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise ValueError("check needs a floating parameter or input to know the dtype")
    dtype, device = floats[0].dtype, floats[0].device
    tol = tolerance(dtype, device)
    eager, reference = copy.deepcopy(base), copy.deepcopy(base).double()
    report = CheckReport(str(dtype).removeprefix("torch."), str(device), train,
                         ["x".join(map(str, t.shape)) for t in inputs
                          if isinstance(t, torch.Tensor)])

    with torch.set_grad_enabled(train):
        compiled.specialize(*inputs)  # lowered now: a first call might answer from tier 0
        # each run draws the same random numbers (dropout in training mode)
        got, want, ref = (_seeded(module, args, seed) for module, args in (
            (compiled, inputs), (eager, inputs), (reference, [_double(a) for a in inputs])))
        with torch.no_grad():  # the same inputs again: does eager repeat itself?
            again = floating_outputs(_seeded(eager, inputs, seed))
    outs, eager_outs, ref_outs = map(floating_outputs, (got, want, ref))
    for i, (o, e, r) in enumerate(zip(outs, eager_outs, ref_outs)):
        unsound = i >= len(again) or again[i].shape != e.shape or relative_error(
            again[i], e.detach()) > tol
        report.comparisons.append(Comparison(f"output {i}", None, relative_error(o, r),
                                             relative_error(e, r), tol, unsound))
    for i, (o, e, r) in enumerate(zip(*map(_other_outputs, (got, want, ref)))):
        report.comparisons.append(Comparison(f"output {i} ({str(o.dtype)[6:]})", None,
                                             _differing(o, r), _differing(e, r), 0.0))
    if train and not any(o.requires_grad for o in outs):
        raise ValueError("check with train=True (--train) needs a floating output that depends "
                         "on a parameter or input requiring grad")
    if train:
        grads = _upstream(outs, seed)
        for module, values in ((compiled, outs), (eager, eager_outs), (reference, ref_outs)):
            module.zero_grad(set_to_none=True)
            _weighted_sum(values, grads).backward()
        named = list(zip(base.named_parameters(), eager.parameters(), reference.parameters()))
        for (name, p), pe, pr in named:
            if p.grad is not None and pr.grad is not None:
                report.comparisons.append(Comparison(
                    f"grad {name}", None, relative_error(p.grad, pr.grad),
                    None if pe.grad is None else relative_error(pe.grad, pr.grad), tol))
            elif (p.grad is None) != (pr.grad is None):  # a gradient lost (or made up)
                report.comparisons.append(Comparison(
                    f"grad {name} ({'none' if p.grad is None else 'not none'} where fp64's "
                    f"is{'' if pr.grad is None else ' not'})", None, math.inf, None, tol))
    _check_regions(compiled, inputs, train, tol, seed, report)
    return report


def _check_regions(compiled: CompiledModule, inputs: Sequence[Any], train: bool, tol: float,
                   seed: int, report: CheckReport) -> None:
    """Append the per-region comparisons of ``compiled``'s last specialization to ``report``."""
    gm = compiled.last.graph_module
    recorder = _RegionRecorder(gm)
    with torch.set_grad_enabled(train):
        recorder.run(*inputs)
    for call, region, args, outs in recorder.calls:
        sub = region.graph_module
        args = _own_args(region, args)
        with torch.no_grad():
            ref = sub(*(_double(a) for a in args))
            eager = sub(*args)
        for i, (o, e, r) in enumerate(zip(outs, eager, ref)):
            report.comparisons.append(Comparison(f"forward {region.output_nodes[i].name}",
                                                 region.region_id, relative_error(o, r),
                                                 relative_error(e, r), tol))
        if train:
            derived = region.backend != "reference" or compiled.options.derived_backward
            _check_region_grads(call, region, args, outs, derived, tol, seed, report)


def _own_args(region: Region, args: tuple) -> tuple:
    """``args`` as the region's own ops take them: an image the graph zero-padded for its cuDNN
    kernel (``Region.padded_images``) narrowed back to the channels of the region's
    placeholder."""
    placeholders = list(region.graph_module.graph.find_nodes(op="placeholder"))
    args = args[:len(placeholders)]
    if not region.padded_images:
        return args
    return tuple(a[:, :placeholders[i].meta["val"].shape[1]] if i in region.padded_images else a
                 for i, a in enumerate(args))


def _check_region_grads(call: fx.Node, region: Region, args: tuple, outs: tuple, derived: bool,
                        tol: float, seed: int, report: CheckReport) -> None:
    """Gradients of one region's inputs: its backward against fp64 autograd of its ops."""
    placeholders = list(region.graph_module.graph.find_nodes(op="placeholder"))
    wanted = [i for i, (ph, a) in enumerate(zip(placeholders, args))
              if isinstance(a, torch.Tensor) and a.is_floating_point()
              and ph.name not in region.no_grad_inputs]
    read = sorted({u.args[1] for u in call.users if u.target is operator.getitem})
    if not wanted or not read:
        return
    upstream = _upstream([outs[i] for i in read], seed)
    if derived:  # a consumer's dgrad already applied this ReLU's backward (region.masked_outputs)
        upstream = [g * (outs[i] > 0) if region.output_nodes[i].name in region.masked_outputs
                    else g for g, i in zip(upstream, read)]
    conv_input = placeholders.index(region.conv.args[0]) \
        if derived and region.dgrad_drelu and region.conv.args[0] in placeholders else None

    def gradients(fn: Any, values: Sequence[Any], to: Any) -> list[torch.Tensor | None]:
        leaves = [to(a, i in wanted) for i, a in enumerate(values)]
        out = fn(*leaves)
        got = torch.autograd.grad([out[i] for i in read], [leaves[i] for i in wanted],
                                  [g.to(out[i].dtype) for g, i in zip(upstream, read)],
                                  allow_unused=True)
        got = list(got)
        if conv_input is not None and conv_input in wanted and fn is not region:
            k = wanted.index(conv_input)  # dgrad fused with the producer's ReLU backward
            if got[k] is not None:
                got[k] = got[k] * (values[conv_input] > 0)
        return got

    def same_dtype(a: Any, grad: bool) -> Any:
        return a.detach().clone().requires_grad_(grad) if isinstance(a, torch.Tensor) else a

    with torch.enable_grad():
        compiled = gradients(region, args, same_dtype)
        eager = gradients(region.graph_module, args, same_dtype)
        ref = gradients(region.graph_module, args, _double)
    roles = {o.name: o.role for o in region.operands()}
    for k, i in enumerate(wanted):
        if ref[k] is None or compiled[k] is None:
            continue
        name = placeholders[i].name
        report.comparisons.append(Comparison(
            f"grad of {name} ({roles.get(name, 'input')})", region.region_id,
            relative_error(compiled[k], ref[k]),
            None if eager[k] is None else relative_error(eager[k], ref[k]),
            tol))
