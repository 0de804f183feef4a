"""The ``triton_conv`` backend: a region whose convolution and epilogue
:func:`fusion_compiler.kernels.conv.conv_program` takes runs as this package's implicit-GEMM
convolution kernel in Triton (:class:`~fusion_compiler.kernels.conv.ConvKernel`). cuDNN takes such
regions too, so where both are asked lowering times both kernels on the region's shapes and keeps
the faster (:func:`fusion_compiler.lowering.lower`). Not among the default backends (cuDNN was
faster on every region measured); ``backends=("triton_conv", ...)`` asks it. A stem region
(SpaceToDepth prologue) is the ``triton_stem`` backend's (:mod:`.triton_stem`).

In training the kernel runs the forward of a region from
:func:`~fusion_compiler.autograd.backward.training_region`: it writes the values the backward
reads as extra outputs (at most :data:`~fusion_compiler.kernels.conv.MAX_OUTPUTS` in all), as a
cuDNN plan does. The backward is the one the cuDNN backend gives the region
(:func:`~fusion_compiler.backends.cudnn.backward.register_cudnn_backward`: dgrad and wgrad as
cuDNN graphs or PyTorch's ops, whichever was faster), so the choice between the two forwards,
timed on the forward alone, leaves the backward as it is. Off CUDA (tests) the backward's
convolution gradients are PyTorch's.

The convolution kernel's tile configuration is autotuned per region shape: each of
:func:`~fusion_compiler.kernels.conv.candidate_configs` is launched once on sample inputs (a
failure to compile or run drops the candidate) and the rest are timed in CUDA graphs
(:func:`.timing.paired_time_ms`); the winner is stored as a record in the plan cache, keyed by
the region's shapes, epilogue, GPU and Triton version, so a process that finds it times nothing
for it. ``autotune <= 1`` takes :func:`~fusion_compiler.kernels.conv.default_config` untimed. No
candidate surviving is a decline (the region stays on cuDNN or PyTorch ops, the record saying
why), never a crash.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from ..autograd.backward import RegionBackward, TorchConvGradients
from ..config import CompileOptions
from ..ir.errors import UnsupportedError, condense
from ..ir.ops import node_device
from ..ir.region import BackwardPlan, Region
from ..kernels.conv import (ConvKernel, ConvProgram, TileConfig, candidate_configs, conv_program,
                            default_config)
from ..kernels.conv import triton_reason as _conv_triton_reason
from ..runtime.plan_cache import PlanCache, default_cache_dir
from ..runtime.region_op import register_backward
from .base import Backend, Lowered, Support
from .timing import paired_time_ms, sample_inputs

__all__ = ["TritonConvBackend"]

_RECORD = "triton_conv"  # the plan-cache record holding a region shape's tile configuration
_FORMAT = 1


class TritonConvBackend(Backend):
    """The convolution kernel (module docstring). Stem regions are declined without a reason.
    Subclasses run another kernel family through the same tuning and plan cache
    (:mod:`.triton_depthwise`, :mod:`.hopper_conv`): they set :attr:`name`, :attr:`record`,
    :attr:`kernel_class`, :attr:`timing_name`, :attr:`trains` and :attr:`explains` and override
    :meth:`program`, :meth:`kernel_reason`, :meth:`configs`, :meth:`describe` and :meth:`label`.

    Args:
        autotune: ``<= 1``: the default configuration, nothing timed.
        cache: where tile configurations are recorded (the plan cache).
        cache_dir: the ``cache_dir`` option, for the cuDNN backend that builds training
            regions' gradient plans.
    """

    name = "triton_conv"
    record = _RECORD
    kernel_class = ConvKernel
    timing_name = "triton"  # candidates' names in the region table's timings
    trains = True
    """Whether training regions are lowered (a family without a training path sets ``False``:
    it declines them, and they keep cuDNN and its backward)."""
    explains = True
    """Whether a region the kernel cannot run is declined with a reason (``False``: without;
    for a family most regions are not of, whose reasons are cuDNN's to give)."""

    def __init__(self, autotune: int = 8, cache: PlanCache | None = None, cache_dir=None):
        self.autotune, self.cache_dir = autotune, cache_dir
        self.cache = cache if cache is not None else PlanCache(None)

    @classmethod
    def for_options(cls, options: CompileOptions) -> "TritonConvBackend":
        return cls(autotune=options.autotune,
                   cache=PlanCache(default_cache_dir(options.cache_dir)),
                   cache_dir=options.cache_dir)

    def supports(self, region: Region) -> Support:
        if region.space_to_depth:
            return Support(False)  # the triton_stem backend's kind
        reason = self.kernel_reason()
        if not reason:
            program = self.program(region)
            reason = program if isinstance(program, str) else ""
        if not self.explains:
            return Support(not reason)
        return Support(not reason, f"{self.describe()}: {reason}" if reason else "")

    # ------------------------------------------------------------------ the kernel family
    def program(self, region: Region) -> ConvProgram | str:
        """The kernel's arguments for ``region``, or why it cannot run it."""
        return conv_program(region, node_device(region.conv))

    def kernel_reason(self) -> str:
        """Why the kernel cannot run here (``""``: it can)."""
        return _conv_triton_reason()

    def configs(self, m: int, k: int, c: int, taps: int, timed: bool) -> list[TileConfig]:
        """Launch configurations for ``m`` output pixels, ``k`` output and ``c`` input
        channels, ``taps`` filter taps: the candidates to time (``timed``), else one."""
        return candidate_configs(m, k, c, taps) if timed else [default_config(m, k, c)]

    def describe(self, config: TileConfig | None = None, ops: int = 0) -> str:
        """The kernel's name in reasons (no ``config``) and in the region table's plan."""
        if config is None:
            return "Triton convolution"
        return (f"implicit-GEMM convolution + {ops} epilogue ops, Triton "
                f"({self.label(config)})")

    def label(self, config: TileConfig) -> str:
        """A configuration as the region table and the plan cache's timings show it."""
        return _label(config)

    def plan_work(self, region: Region) -> str:
        """``"tune"`` for a convolution region whose tile configuration is not in the plan cache
        (autotuning times candidates), else ``""`` (a stem region, or a recorded configuration;
        whether the choice against cuDNN is stored, lowering asks itself)."""
        if region.space_to_depth:
            return ""
        program = self.program(region)
        if isinstance(program, str) or node_device(region.conv).type != "cuda":
            return ""
        header = self._header(region, program)
        return "" if _cached_config(self.cache, header, self.record) else "tune"

    def lower(self, region: Region, training: bool = False,
              backward: BackwardPlan | None = None) -> Lowered:
        """The region's :class:`ConvKernel`; in training (``region`` from
        :func:`~fusion_compiler.autograd.backward.training_region`) the kernel runs through
        ``run_region`` with the backward of :func:`_register_backward`, planned by ``backward``.

        Raises:
            UnsupportedError: the region is not one the kernel takes (in training also: its
                forward would write more values than the kernel has outputs, or the family does
                not train, :attr:`trains`), or no configuration of the kernel ran on sample
                inputs of the region's shapes.
            TimingDeferred: configurations must be timed on a thread where timing is deferred.
        """
        if training and not self.trains:
            raise UnsupportedError(f"the {self.describe()} runs inference only", region.region_id)
        if region.space_to_depth:
            raise UnsupportedError("a SpaceToDepth stem region (the triton_stem backend's)",
                                   region.region_id)
        program = self.program(region)
        if isinstance(program, str):
            raise UnsupportedError(f"{self.describe()}: {program}", region.region_id)
        kernel, timing, cached = self._tuned(region, program, direct=not training)
        gradients = self._register_backward(region, kernel, backward) if training else ()
        return Lowered(kernel.call, plan=self.describe(kernel.config, len(program.ops)),
                       plan_from_cache=cached,
                       workspace_bytes=0, timing=timing, gradients=gradients,
                       nhwc_inputs=frozenset({program.image_at, *(
                           at for at, kind in zip(program.operands, program.kinds)
                           if kind == 2)}))

    def _register_backward(self, region: Region, kernel: ConvKernel,
                           backward: BackwardPlan | None) -> tuple:
        """Register the training region's backward for ``kernel`` (module docstring); how its
        pieces run (the cuDNN backend's report of them; empty off CUDA)."""
        if node_device(region.conv).type != "cuda":
            register_backward(kernel.key, RegionBackward(region, TorchConvGradients(region.conv)))
            return ()
        from .cudnn.backend import CudnnBackend  # noqa: PLC0415  (imports cuDNN's frontend lazily)
        from .cudnn.backward import register_cudnn_backward  # noqa: PLC0415

        return register_cudnn_backward(CudnnBackend.shared(self.cache_dir, self.autotune), region,
                                       kernel.key, backward, kernel.weight_cache)

    def _tuned(self, region: Region, program: ConvProgram, direct: bool = True
               ) -> tuple[ConvKernel, dict[str, float], bool | None]:
        """The region's kernel with its best configuration, each timed configuration's ms
        (empty when nothing was timed) and whether the configuration came from the plan cache
        (``None`` off CUDA, where nothing is cached). ``direct``: see :class:`ConvKernel`."""
        conv = region.conv
        n, k, ho, wo = conv.meta["val"].shape
        _, c, r, s = conv.args[1].meta["val"].shape
        outputs = [(tuple(o.meta["val"].shape), o.meta["val"].dtype) for o in region.output_nodes]
        cuda = node_device(conv).type == "cuda"  # off CUDA (tests) the kernel runs torch ops
        header = self._header(region, program) if cuda else None
        record = _cached_config(self.cache, header, self.record)
        configs = [record] if record else self.configs(n * ho * wo, k, c, r * s,
                                                        timed=self.autotune > 1 and cuda)
        inputs = sample_inputs(region)
        ran: list[ConvKernel] = []
        failures = []
        for config in configs:  # the first launch compiles: a failure drops the candidate
            kernel = self.kernel_class(program, outputs, config,
                                       name=f"region {region.region_id}", direct=direct)
            try:
                kernel(*inputs)
            except Exception as exc:  # Triton's compile errors have no common base class
                failures.append(f"{self.label(config)}: {condense(exc)}")
                continue
            ran.append(kernel)
        if not ran:
            raise UnsupportedError(f"the {self.describe()} failed on the region's shapes: "
                                   + "; ".join(failures[:2]), region.region_id)
        if record or len(ran) == 1:
            return ran[0], {}, (record is not None) if cuda else None
        times = paired_time_ms([lambda kern=kern: kern(*inputs) for kern in ran])
        best = min(range(len(ran)), key=times.__getitem__)
        self.cache.store_record(header, self.record, {
            "config": dataclasses.asdict(ran[best].config),
            "ms": {self.label(kern.config): ms for kern, ms in zip(ran, times)}})
        return (ran[best], {f"{self.timing_name} {self.label(kern.config)}": ms
                            for kern, ms in zip(ran, times)}, False)

    def _header(self, region: Region, program: ConvProgram) -> dict:
        """The plan-cache header of a region's tile configuration: what the kernel computes
        (shapes, dtype, geometry, epilogue), the GPU and the Triton version."""
        import triton  # noqa: PLC0415  (imports: triton_kernel() returned a kernel)

        device = node_device(region.conv)
        placeholders = region.graph_module.graph.find_nodes(op="placeholder")
        header = {"format": _FORMAT, "kind": self.record,
                  "inputs": [[list(p.meta["val"].shape), str(p.meta["val"].dtype)]
                             for p in placeholders],
                  "geometry": [program.stride, program.padding, program.dilation],
                  "epilogue": [program.ops, program.kinds, program.outputs],
                  "gpu": torch.cuda.get_device_name(device),
                  "sm": list(torch.cuda.get_device_capability(device)),
                  "triton": triton.__version__}
        return json.loads(json.dumps(header))  # tuples as lists: as a stored record reads back


def _cached_config(cache: PlanCache, header: dict | None, kind: str = _RECORD
                   ) -> TileConfig | None:
    """The tile configuration recorded for ``header`` (a record of ``kind``); ``None`` when
    absent or unreadable."""
    record = cache.load_record(header, kind) if header is not None else None
    try:
        return TileConfig(**record["config"]) if record else None
    except (TypeError, KeyError):  # written by another version of this record
        return None


def _label(config: TileConfig) -> str:
    split = f"/split{config.split}" if config.split > 1 else ""
    return f"{config.bm}x{config.bn}x{config.bk}/{config.warps}w{config.stages}s{split}"
