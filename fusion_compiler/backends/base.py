"""The backend protocol: a backend says whether it takes a region and lowers it to a kernel.

A backend is a class with a ``name``, :meth:`Backend.supports` and :meth:`Backend.lower`; the
other methods have defaults here. It joins the compiler through one registration
(:func:`fusion_compiler.backends.registry.register_backend`); lowering then asks it wherever a
compile's ``backends`` option names it, names no backend itself, and writes one
:class:`~fusion_compiler.ir.region.Lowering` record per region from what :meth:`Backend.lower`
returns (:class:`Lowered`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..ir.region import BackwardPlan, Region

__all__ = ["Support", "Backend", "Kernel", "Lowered", "PLAN_WORK", "REUSE_BATCH_RATIO"]

Kernel = Callable[..., Any]
"""A lowered region: called with the region inputs, returns the tuple of region outputs."""

PLAN_WORK = ("", "build", "tune")
"""What lowering a region involves beyond loading cached plans, in increasing order of cost:
nothing, a build (CPU work, which may run beside GPU work), a build and a timing on the GPU."""

REUSE_BATCH_RATIO = 2.0
"""A choice timed at batch size N (a cuDNN plan's engine, the backend lowering chose for a region)
is followed untimed for batch sizes N/2 to 2N; outside, it is timed afresh (what wins at one size
may lose at a very different one)."""


@dataclass(frozen=True)
class Support:
    """Answer of :meth:`Backend.supports`: ``ok``, and when not ok, the backend's ``reason``.

    ``ok`` false with an empty ``reason`` means the region is not of the kind the backend is for
    (a backend for one pattern, such as the SpaceToDepth stem): such a decline is not reported.
    """

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Lowered:
    """What :meth:`Backend.lower` returns: the kernel and what the backend reports about it
    (the fields of :class:`~fusion_compiler.ir.region.Lowering` a backend knows)."""

    kernel: Kernel
    plan: str = ""
    plan_from_cache: bool | None = None
    workspace_bytes: int | None = None
    tuning: tuple = ()
    timing: Mapping[str, float] = field(default_factory=dict)
    gradients: tuple = ()
    nhwc_inputs: frozenset[int] = frozenset()
    padded_images: Mapping[int, int] = field(default_factory=dict)


class Backend:
    """What every backend implements (``supports``, ``lower``) and may override.

    ``supports`` must be cheap and must not raise; ``lower`` may raise
    :class:`~fusion_compiler.ir.errors.UnsupportedError` with the backend's reason when a region
    it claimed to support is rejected while building (lowering then falls back). With
    ``training`` the kernel must be differentiable (PyTorch autograd sees through it, or it runs
    the ``run_region`` op with a registered backward).
    """

    name: str = ""

    def supports(self, region: Region) -> Support:
        raise NotImplementedError

    def lower(self, region: Region, training: bool = False,
              backward: BackwardPlan | None = None) -> Lowered:
        """The region's kernel. ``backward``: in training, the region's backward plan."""
        raise NotImplementedError

    def prefetch(self, regions: Sequence[Region]) -> None:
        """Start preparing ``regions`` (which this backend will be asked to lower) in the
        background, e.g. building plans in worker processes. Default: nothing."""

    def wait_for_prefetched(self, timeout: float | None = None) -> bool:
        """Block until what :meth:`prefetch` started has ended (at most ``timeout`` s); whether
        it has. Default: ``True``."""
        return True

    def plan_work(self, region: Region) -> str:
        """What :meth:`lower` of ``region`` (inference) has to do beyond loading a cached plan:
        one of :data:`PLAN_WORK`. Default: ``""``."""
        return ""

    def graph_json(self, region: Region) -> dict | None:
        """The backend's description of the graph it would build for ``region`` (for dumps; also
        without a GPU), or ``None``. Default: ``None``."""
        return None
