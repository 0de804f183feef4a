"""The Triton kernels of :mod:`fusion_compiler.runtime.derive` (imported only where Triton does).

``fingerprint_kernel``: one program per chunk of one source's memory, read as integer words of 4,
2 or 1 bytes (the row says which). Each word is mixed with its position by two different bijective
32-bit finalizers (MurmurHash3's ``fmix32`` and one in the style of xxHash's avalanche, Appleby
2011, Collet 2012); the program adds its chunk's two sums, one in each half of a 64-bit word, into
the source's slot with one atomic add. Addition commutes, so the sums do not depend on the order
in which programs run; a change of one word always changes the slot's sum (each finalizer is a
bijection for a given position).

``derive_kernel``: one program per chunk of one derived tensor: the chunk is rewritten only when
the sum of a source it reads differs from the one stored at the previous run. Element ``j`` is
``scale * a[ia] * b[ib]`` (a factor whose slot is -1 is left out), computed in fp32 and stored in
the derived tensor's dtype; a scale of 0 is a zero whatever the factors hold. A factor's index is
read from ``index`` or, where the row has no table for it, is ``base + ((first + j) // div) %
mod`` (a scalar or one value per channel). The last program to finish stores the new sums and
zeroes the slots for the next run (counted with an atomic add on ``counter``).
"""

import triton
import triton.language as tl

COLUMNS = 20
"""int64 fields of a row of ``derive_kernel``'s table (see :func:`derive_kernel`)."""


@triton.jit
def _mix(w, pos):
    x = w ^ (pos * 0x1E3779B1)
    x = x * 0x05EBCA6B
    x = x ^ (x >> 13)
    x = x * 0x42B2AE35
    x = x ^ (x >> 16)
    y = (w + pos * 0x27D4EB2F) * 0x165667B1
    y = y ^ (y >> 15)
    y = y * 0x2C1B3C6D
    y = y ^ (y >> 12)
    return x, y


@triton.jit
def fingerprint_kernel(table, sums, BLOCK: tl.constexpr):
    # table: int64 [programs, 5]: address, words in the chunk (at most BLOCK), slot, index of the
    # chunk's first word in its source, bytes per word (4, 2 or 1). One chunk per program, read
    # at once: many programs in flight, each one load deep (the reads are the kernel's cost)
    row = table + tl.program_id(0) * 5
    address = tl.load(row)
    count = tl.load(row + 1)
    slot = tl.load(row + 2)
    first = tl.load(row + 3)
    word = tl.load(row + 4)
    idx = tl.arange(0, BLOCK)
    inside = idx < count
    if word == 4:
        base = tl.multiple_of(address.to(tl.pointer_type(tl.int32)) + first, 16)
        w = tl.load(base + idx, mask=inside, other=0).to(tl.uint32, bitcast=True)
    elif word == 2:
        w = tl.load(address.to(tl.pointer_type(tl.int16)) + first + idx, mask=inside,
                    other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        w = tl.load(address.to(tl.pointer_type(tl.int8)) + first + idx, mask=inside,
                    other=0).to(tl.uint8, bitcast=True).to(tl.uint32)
    x, y = _mix(w, (first + idx).to(tl.uint32))
    sx = tl.sum(tl.where(inside, x, 0), axis=0).to(tl.uint64)
    sy = tl.sum(tl.where(inside, y, 0), axis=0).to(tl.uint64)
    tl.atomic_add(sums + slot, (sx | (sy << 32)).to(tl.int64, bitcast=True))


@triton.jit
def _changed(sums, stored, slot):
    changed = tl.zeros([], dtype=tl.int32)
    if slot >= 0:
        changed = (tl.load(sums + slot) != tl.load(stored + slot)).to(tl.int32)
    return changed


@triton.jit
def _factor(v, row, index, first, j, inside):
    # v times the factor whose 7 fields start at row: slot, address, dtype code, offset of its
    # indices in `index` (-1: base + ((first + j) // div) % mod), div, mod, base
    slot = tl.load(row)
    if slot >= 0:
        address = tl.load(row + 1)
        code = tl.load(row + 2)
        table = tl.load(row + 3)
        if table >= 0:
            at = tl.load(index + table + j, mask=inside, other=-1).to(tl.int64)
        else:
            at = tl.load(row + 6) + ((first + j) // tl.load(row + 4)) % tl.load(row + 5)
        ok = inside & (at >= 0)
        if code == 0:
            x = tl.load(address.to(tl.pointer_type(tl.float16)) + at, mask=ok,
                        other=0.0).to(tl.float32)
        elif code == 1:
            x = tl.load(address.to(tl.pointer_type(tl.bfloat16)) + at, mask=ok,
                        other=0.0).to(tl.float32)
        else:
            x = tl.load(address.to(tl.pointer_type(tl.float32)) + at, mask=ok, other=0.0)
        v = v * x
    return v


@triton.jit
def derive_kernel(table, index, scales, sums, stored, counter, programs, slots,
                  BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    # table: int64 [programs, COLUMNS]: 0 destination address (of the chunk's first element),
    # 1 elements, 2 destination dtype code (0 fp16, 1 bf16, 2 fp32), 3 position of the chunk's
    # first element in its tensor, 4 offset of per-element scales in `scales` (-1: one scale),
    # 5 that scale's fp32 bits, 6-12 factor a, 13-19 factor b (see _factor)
    row = table + tl.program_id(0) * 20
    changed = _changed(sums, stored, tl.load(row + 6)) + _changed(sums, stored,
                                                                   tl.load(row + 13))
    if changed > 0:
        dst = tl.load(row)
        count = tl.load(row + 1)
        dst_code = tl.load(row + 2)
        first = tl.load(row + 3)
        scale_at = tl.load(row + 4)
        scale = tl.load(row + 5).to(tl.int32).to(tl.float32, bitcast=True)
        offs = tl.arange(0, BLOCK)
        for start in tl.range(0, count, BLOCK):
            j = start + offs
            inside = j < count
            if scale_at >= 0:
                s = tl.load(scales + scale_at + j, mask=inside, other=0.0)
            else:
                s = tl.zeros([BLOCK], dtype=tl.float32) + scale
            v = _factor(s, row + 6, index, first, j, inside)
            v = _factor(v, row + 13, index, first, j, inside)
            v = tl.where(s == 0.0, 0.0, v)
            if dst_code == 0:
                tl.store(dst.to(tl.pointer_type(tl.float16)) + j, v.to(tl.float16), mask=inside)
            elif dst_code == 1:
                tl.store(dst.to(tl.pointer_type(tl.bfloat16)) + j, v.to(tl.bfloat16),
                         mask=inside)
            else:
                tl.store(dst.to(tl.pointer_type(tl.float32)) + j, v, mask=inside)
    done = tl.atomic_add(counter, 1)
    if done == programs - 1:  # every other program has read the sums: store them for next time
        for start in tl.range(0, slots, SLOTS):
            k = start + tl.arange(0, SLOTS)
            inside = k < slots
            tl.store(stored + k, tl.load(sums + k, mask=inside, other=0), mask=inside)
            tl.store(sums + k, tl.zeros([SLOTS], dtype=tl.int64), mask=inside)
        tl.store(counter, 0)
