"""Derived tensors (a weight re-laid out, concatenated, zero-padded, packed, scaled, cast)
recomputed on the GPU when, and only when, the tensors they are made from change: the content
test that keeps what a compiled graph derives from parameters in step with them.

A derived tensor is described by an :class:`Expr`: per element, ``scale * a[ia] * b[ib]`` with
``a`` and ``b`` elements of source tensors (each factor optional) and ``scale`` a constant (0: a
zero). Rearrangements (views, permutes, ``contiguous``, ``cat``, ``pad``, ``expand``, slicing,
packing into a zeroed tensor) act on these index arrays exactly as on a tensor, so a function made
of them is described by running it on index arrays (:meth:`Expr.rearranged`). A
:class:`Program` holds the sources (slots) and derived tensors of a compiled graph and
:meth:`Program.run` launches two Triton kernels (:mod:`.derive_triton`) on the current stream,
capturable in a CUDA graph: a fingerprint of every source's memory (hashed word by word, summed
per source) and the derivation of every chunk of a derived tensor whose sources' sums differ from
the previous run's, compared on the GPU: no host synchronization.

Why contents and not ``Tensor._version``: the version counter misses writes that change a
parameter's memory without an in-place op on that tensor: through ``p.data`` (a tensor with a
counter of its own), a ``fused=True`` optimizer step, batch norm's running statistics in training
mode, a collective filling a buffer, a CUDA graph replayed by the user (docs/decisions.md,
"Derived weights: a content fingerprint, not version counters"). Reading the sources is the one
test none of these passes unseen. The sources must stay where they are while the program is used:
its owner checks that the module's tensors are the same objects at the same addresses before each
call (:class:`fusion_compiler.runtime.state.StateGuard`).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .triton_import import triton_import_error

__all__ = ["Expr", "Program", "NotDerivable", "derive_reason", "evaluator", "evaluate"]

_WORDS = 2048  # words per fingerprint program (one load each: many programs in flight)
_CHUNK = 8192  # elements per row of a fingerprinted derivation (most rows just check their sums)
_ALWAYS_CHUNK = 1024  # elements per row of a derivation without fingerprint (one step each)
_BLOCK = 1024  # elements per step of a derivation program
_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


class NotDerivable(Exception):
    """A value the gather algebra of :class:`Expr` cannot describe (the caller computes it with
    PyTorch ops instead)."""


@functools.cache
def _kernels() -> Any:
    if triton_import_error():  # (Triton imported under its lock first)
        return None
    try:
        from . import derive_triton  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - ImportError, or a broken Triton install
        return None
    return derive_triton


def derive_reason(device: torch.device) -> str:
    """Why :meth:`Program.run` cannot run its kernels on ``device`` (``""``: it can); it then
    recomputes every derived tensor with PyTorch ops at each run."""
    if device.type != "cuda":
        return f"the tensors are on {device.type}, not CUDA"
    if _kernels() is None:
        return "Triton does not import"
    return ""


@dataclass
class Expr:
    """A derived value, elementwise: ``scale * Π factors``; each factor an element of a source,
    given per element by ``slots`` (the source's slot plus one; 0: no factor) and ``index`` (its
    offset in the source's storage, in elements). Every array has the value's shape; ``scale``
    is float64, 0 where the value is a zero. CPU tensors."""

    scale: torch.Tensor
    factors: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @classmethod
    def source(cls, slot: int, t: torch.Tensor) -> "Expr":
        """The elements of ``t`` (in the storage of slot ``slot``) as they are."""
        span = t.storage_offset() + 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride()))
        index = torch.arange(span, dtype=torch.int64).as_strided(
            tuple(t.shape), t.stride(), t.storage_offset())
        return cls(torch.ones(tuple(t.shape), dtype=torch.float64),
                   ((torch.full(tuple(t.shape), slot + 1, dtype=torch.int64), index),))

    @classmethod
    def constant(cls, value: float, shape: Sequence[int] = ()) -> "Expr":
        return cls(torch.full(tuple(shape), float(value), dtype=torch.float64), ())

    @property
    def shape(self) -> torch.Size:
        return self.scale.shape

    def arrays(self) -> list[torch.Tensor]:
        return [self.scale, *(a for f in self.factors for a in f)]

    @staticmethod
    def _from(arrays: Sequence[torch.Tensor], count: int) -> "Expr":
        it = iter(arrays[1:])
        return Expr(arrays[0], tuple((next(it), next(it)) for _ in range(count)))

    def _padded(self, count: int) -> "Expr":
        """The same value with ``count`` factors (extra ones empty)."""
        missing = count - len(self.factors)
        empty = torch.zeros(self.shape, dtype=torch.int64)
        return Expr(self.scale, self.factors + ((empty, empty),) * missing)

    @staticmethod
    def rearranged(fn: Callable[..., Any], *exprs: "Expr | list[Expr]") -> Any:
        """``fn`` (a rearrangement: it moves, copies or zero-fills elements, no arithmetic)
        applied to the value(s): ``fn`` runs on each array of the arguments in turn (lists of
        :class:`Expr` for functions such as ``torch.cat``); returns an :class:`Expr`, or a
        tuple of them where ``fn`` returns a sequence."""
        flat = [e for x in exprs for e in (x if isinstance(x, (list, tuple)) else [x])]
        count = max((len(e.factors) for e in flat), default=0)
        padded_args = [[e._padded(count) for e in x] if isinstance(x, (list, tuple))
                       else x._padded(count) for x in exprs]
        per_array = []
        for k in range(1 + 2 * count):
            args = [[e.arrays()[k] for e in x] if isinstance(x, list) else x.arrays()[k]
                    for x in padded_args]
            per_array.append(fn(*args))
        if isinstance(per_array[0], (list, tuple)):
            return tuple(Expr._from([out[i] for out in per_array], count)
                         for i in range(len(per_array[0])))
        return Expr._from(per_array, count)

    def scaled(self, c: float) -> "Expr":
        return Expr(self.scale * float(c), self.factors)

    def times(self, other: "Expr") -> "Expr":
        """The product, broadcast as PyTorch broadcasts.

        Raises:
            NotDerivable: the product has more than two factors."""
        # torch.broadcast_shapes would import sympy (a second of a warm start): meta tensors
        shape = torch.broadcast_tensors(torch.empty(self.shape, device="meta"),
                                        torch.empty(other.shape, device="meta"))[0].shape
        a, b = (Expr.rearranged(lambda t: t.expand(shape), e) for e in (self, other))
        factors = tuple(f for f in a.factors + b.factors if bool((f[0] != 0).any()))
        if len(factors) > 2:
            raise NotDerivable("a product of more than two tensors")
        return Expr(a.scale * b.scale, factors)


def _words(t: torch.Tensor) -> tuple[int, int]:
    """(bytes per word, words) in which the fingerprint reads the storage span of ``t``."""
    nbytes = t.untyped_storage().nbytes()
    address = t.untyped_storage().data_ptr()
    word = next(w for w in (4, 2, 1) if address % (16 if w == 4 else w) == 0 and nbytes % w == 0)
    return word, nbytes // word


def _affine(index: torch.Tensor) -> tuple[int, int, int] | None:
    """``(div, mod, base)`` when ``index[p] == base + (p // div) % mod`` for every ``p``."""
    base = int(index.min())
    rest = index - base
    div = int(torch.nonzero(rest != rest[0]).flatten()[:1].sum()) or index.numel()
    mod = int(rest.max()) + 1
    p = torch.arange(index.numel(), dtype=torch.int64)
    if rest[0] != 0 or not torch.equal(rest, (p // div) % mod):
        return None
    return div, mod, base


class Program:
    """The derived tensors of one compiled graph and the sources they are made from.

    Args:
        sources: the source tensors (one slot each: a slot is the whole storage of its tensor);
            fp16, bf16 or fp32, on one CUDA device (a CPU program runs :meth:`run` with
            PyTorch ops).
        derived: ``(tensor, expr)`` pairs: a dense tensor (no gaps or overlaps, any dimension
            order) of fp16, bf16 or fp32 that :meth:`run` rewrites, and its :class:`Expr` over
            the sources' slots.
        conditional: fingerprint the sources and rewrite only what changed; ``False``: rewrite
            everything at every run, one kernel and no fingerprint (cheaper for small tensors).

    Attributes:
        reason: why the kernels do not run (``""``: they do); :meth:`run` then recomputes every
            derived tensor with PyTorch ops.
        bytes_read: bytes the fingerprint reads per run.

    Raises:
        NotDerivable: a source or a derived tensor of a dtype or layout the kernels do not take.
    """

    def __init__(self, sources: Sequence[torch.Tensor],
                 derived: Sequence[tuple[torch.Tensor, Expr]], conditional: bool = True):
        self.sources = list(sources)
        self.derived = list(derived)
        self.conditional = conditional
        for t in self.sources:
            if t.dtype not in _CODES:
                raise NotDerivable(f"a source of dtype {t.dtype}")
        for d, expr in self.derived:
            self.check(d, expr)
        device = self.derived[0][0].device if self.derived else torch.device("cpu")
        self.reason = derive_reason(device) if self.derived else ""
        self.bytes_read = 0
        if self.derived and not self.reason:
            self._build(device)
        elif self.derived:
            self._torch = [(dst, evaluator(expr, self.sources)) for dst, expr in self.derived]

    @staticmethod
    def check(target: torch.Tensor, expr: Expr) -> None:
        """Raises:
            NotDerivable: the kernels cannot write ``target`` (its dtype, a layout with gaps, or
                a shape other than ``expr``'s)."""
        if target.dtype not in _CODES:
            raise NotDerivable(f"a derived tensor of dtype {target.dtype}")
        if tuple(target.shape) != tuple(expr.shape) or not _dense(target):
            raise NotDerivable("a derived tensor with gaps in memory or of another shape")

    # ------------------------------------------------------------------ tables
    def _build(self, device: torch.device) -> None:
        rows = []
        for slot, t in enumerate(self.sources if self.conditional else ()):
            word, words = _words(t)
            self.bytes_read += word * words
            address = t.untyped_storage().data_ptr()
            rows += [(address, min(_WORDS, words - first), slot, first, word)
                     for first in range(0, words, _WORDS)]
        self._fingerprint = torch.tensor(rows or [(0, 0, 0, 0, 4)], dtype=torch.int64,
                                         device=device)
        table, index, scales = [], _Concatenated(torch.int32), _Concatenated(torch.float32)
        for dst, expr in self.derived:
            table += self._rows(dst, expr, index, scales)
        self._table = torch.tensor(table, dtype=torch.int64, device=device)
        self._index, self._scales = index.tensor(device), scales.tensor(device)
        slots = max(len(self.sources), 1)
        self._sums = torch.zeros(slots, dtype=torch.int64, device=device)
        # no sum of real contents is stored yet: the first run derives everything
        self._stored = torch.full((slots,), 0x5A5A5A5A5A5A5A5, dtype=torch.int64, device=device)
        self._counter = torch.zeros(1, dtype=torch.int32, device=device)
        with torch.no_grad():  # the chunks without a source (zeros) are written once; the
            for dst, expr in self.derived:  # others at the first run (no sum is stored yet)
                present = torch.zeros(expr.shape, dtype=torch.bool)
                for factor_slots, _ in expr.factors:
                    present |= factor_slots != 0
                dst.copy_(torch.where(present, 0.0, expr.scale).to(dst.dtype))
        self._slots_block = max(16, 1 << (min(slots, 1024) - 1).bit_length())

    def _rows(self, dst: torch.Tensor, expr: Expr, index: "_Concatenated",
              scales: "_Concatenated") -> list[tuple[int, ...]]:
        """The derivation table's rows for ``dst``: one per chunk of ``_CHUNK`` elements (in
        ``dst``'s memory order) within a run of the same slots; index and scale tables are
        appended to ``index`` and ``scales``."""
        arrays = [torch.empty_strided(tuple(dst.shape), dst.stride(), dtype=a.dtype).copy_(a)
                  .as_strided((dst.numel(),), (1,)) for a in expr._padded(2).arrays()]
        scale, factors = arrays[0], [(arrays[1], arrays[2]), (arrays[3], arrays[4])]
        patterns = [_affine(idx) if bool((slots == slots[0]).all()) and slots[0] != 0 else None
                    for slots, idx in factors]
        key = factors[0][0] * (len(self.sources) + 1) + factors[1][0]
        cuts = [0, *(torch.nonzero(key[1:] != key[:-1]).flatten() + 1).tolist(), dst.numel()]
        rows = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            step = _CHUNK if self.conditional else _ALWAYS_CHUNK
            for first in range(lo, hi, step):
                last = min(hi, first + step)
                part = scale[first:last]
                if bool((part == part[0]).all()):
                    scale_at, value = -1, float(part[0])
                else:
                    scale_at, value = scales.append(part.to(torch.float32)), 0.0
                fields: list[int] = []
                for (slots, idx), pattern in zip(factors, patterns):
                    slot = int(slots[first]) - 1
                    if slot < 0:
                        fields += [-1, 0, 0, -1, 1, 1, 0]
                        continue
                    src = self.sources[slot]
                    head = [slot, src.untyped_storage().data_ptr(), _CODES[src.dtype]]
                    if pattern is not None:
                        fields += [*head, -1, *pattern]
                        continue
                    chunk = torch.where(part == 0, -1, idx[first:last])
                    if int(chunk.max()) >= 2 ** 31:
                        raise NotDerivable("a source of more than 2**31 elements")
                    fields += [*head, index.append(chunk.to(torch.int32)), 1, 1, 0]
                bits = struct.unpack("<i", struct.pack("<f", value))[0]
                rows.append((dst.data_ptr() + first * dst.element_size(), last - first,
                             _CODES[dst.dtype], first, scale_at, bits, *fields))
        return rows

    # ------------------------------------------------------------------ running
    def run(self, always: bool = False) -> None:
        """Rewrite the derived tensors whose sources changed since the last run (at the first
        run, all of them), on the current stream, without a host synchronization, one program
        per chunk; with :attr:`reason` set, recompute all of them with PyTorch ops. ``always``:
        rewrite every chunk, with no fingerprint and without reading or writing the program's
        sums and counter (for a graph replayed beside this program's other launches)."""
        if not self.derived:
            return
        if self.reason:
            with torch.no_grad():
                for dst, value in self._torch:
                    dst.copy_(value().to(dst.dtype))
            return
        kernels = _kernels()
        checked = self.conditional and not always
        if checked:
            rows = self._fingerprint.shape[0]
            kernels.fingerprint_kernel[(rows,)](self._fingerprint, self._sums, rows, BLOCK=_WORDS)
        rows = self._table.shape[0]
        kernels.derive_kernel[(rows,)](
            self._table, self._index, self._scales, self._sums, self._stored, self._counter,
            rows, self._sums.numel(), BLOCK=_BLOCK, SLOTS=self._slots_block,
            ALWAYS=not checked)


class _Concatenated:
    """1-d tensors appended one after another (a table of the derive kernel), each at an offset
    known when it is appended."""

    def __init__(self, dtype: torch.dtype):
        self.parts: list[torch.Tensor] = []
        self.size, self.dtype = 0, dtype

    def append(self, t: torch.Tensor) -> int:
        """Append ``t``; returns its offset in elements."""
        at = self.size
        self.parts.append(t)
        self.size += t.numel()
        return at

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The parts as one tensor on ``device`` (one zero when there are none)."""
        if not self.parts:
            return torch.zeros(1, dtype=self.dtype, device=device)
        return torch.cat(self.parts).to(device)


def _dense(t: torch.Tensor) -> bool:
    """``t`` covers exactly ``numel`` elements of memory in some dimension order."""
    dims = sorted((s, d) for d, s in zip(t.shape, t.stride()) if d > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def evaluator(expr: Expr, sources: Sequence[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A function computing ``expr``'s value with PyTorch ops (fp32, on the sources' device), its
    index arrays moved to the device once: only device work at each call (capturable in a CUDA
    graph). What the kernels compute, for a run without them."""
    device = sources[0].device if sources else torch.device("cpu")
    scale = expr.scale.to(device, torch.float32)
    zero = (expr.scale == 0).to(device)
    factors = []
    for slots, index in expr.factors:
        present = slots != 0
        if bool(present.any()):
            factors.append([(slot - 1, (slots == slot).to(device),
                             torch.where(slots == slot, index, 0).to(device))
                            for slot in torch.unique(slots[present]).tolist()])

    def run() -> torch.Tensor:
        value = scale
        for picks in factors:
            gathered = torch.ones(expr.shape, dtype=torch.float32, device=device)
            for slot, where, index in picks:
                src = sources[slot]
                flat = torch.as_strided(src, (src.untyped_storage().nbytes() // src.element_size(),),
                                        (1,), 0)
                gathered = torch.where(where, flat.float()[index], gathered)
            value = value * gathered
        return torch.where(zero, torch.zeros((), device=device), value)
    return run


def evaluate(expr: Expr, sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """``expr``'s value computed with PyTorch ops (:func:`evaluator`), for tests and set-up."""
    return evaluator(expr, sources)()
