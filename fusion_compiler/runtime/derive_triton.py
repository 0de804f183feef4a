"""The Triton kernels of :mod:`fusion_compiler.runtime.derive` (imported only where Triton does).

``fingerprint_kernel``: one program per chunk of one source's memory, read as integer words of 4,
2 or 1 bytes (the row says which). Each word and its position give two 32-bit terms (a multiply
by an odd constant after an xor with the position, as in multiplicative hashing, Knuth TAOCP vol.
3 section 6.4; and an xorshift, Marsaglia 2003, then a multiply); the program adds its chunk's two
sums, one in each half of a 64-bit word, into the source's slot with one atomic add. Addition
commutes, so the sums do not depend on the order in which programs run; a change of one word
always changes the slot's sum (the first term is a bijection of the word for a given position).

``derive_kernel``: one program per chunk of one derived tensor: the chunk is rewritten only when
the sum of a source it reads differs from the one stored at the previous run (with ``ALWAYS``, at
every run: a program without fingerprint, for small tensors). Element ``j`` is
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
    # two sums' terms of a word w at position pos (uint32): x is a bijection of w for a given
    # pos (xor, then a multiply by an odd constant), y a nonlinear one (an xorshift of w, then a
    # multiply), so a change of one word always changes x's sum and changes cancel in both sums
    # only by chance
    x = (w ^ (pos * 0x1E3779B1)) * 0x05EBCA6B
    y = ((w ^ (w >> 15)) + pos) * 0x2C1B3C6D
    return x, y


@triton.jit
def fingerprint_kernel(table, sums, rows, BLOCK: tl.constexpr):
    # table: int64 [rows, 5]: address, words in the chunk (at most BLOCK), slot, index of the
    # chunk's first word in its source, bytes per word (4, 2 or 1). Program p takes rows p,
    # p + programs, ... (launched with one program per row, the most in flight)
    for r in tl.range(tl.program_id(0), rows, tl.num_programs(0)):
        row = table + r * 5
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
def derive_kernel(table, index, scales, sums, stored, counter, rows, slots,
                  BLOCK: tl.constexpr, SLOTS: tl.constexpr, ALWAYS: tl.constexpr):
    # table: int64 [rows, COLUMNS]: 0 destination address (of the chunk's first element),
    # 1 elements, 2 destination dtype code (0 fp16, 1 bf16, 2 fp32), 3 position of the chunk's
    # first element in its tensor, 4 offset of per-element scales in `scales` (-1: one scale),
    # 5 that scale's fp32 bits, 6-12 factor a, 13-19 factor b (see _factor). Program p takes
    # rows p, p + programs, ... (as fingerprint_kernel)
    for r in tl.range(tl.program_id(0), rows, tl.num_programs(0)):
        row = table + r * 20
        if ALWAYS:  # a program without fingerprint: every chunk, at every run
            changed = 1
        else:
            changed = _changed(sums, stored, tl.load(row + 6)) + _changed(sums, stored,
                                                                           tl.load(row + 13))
        if changed > 0:
            _derive_row(row, index, scales, BLOCK)
    if not ALWAYS:
        _store_sums(sums, stored, counter, tl.num_programs(0), slots, SLOTS)


@triton.jit
def _derive_row(row, index, scales, BLOCK: tl.constexpr):
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
            tl.store(dst.to(tl.pointer_type(tl.bfloat16)) + j, v.to(tl.bfloat16), mask=inside)
        else:
            tl.store(dst.to(tl.pointer_type(tl.float32)) + j, v, mask=inside)


@triton.jit
def _store_sums(sums, stored, counter, programs, slots, SLOTS: tl.constexpr):
    done = tl.atomic_add(counter, 1)
    if done == programs - 1:  # every other program has read the sums: store them for next time
        for start in tl.range(0, slots, SLOTS):
            k = start + tl.arange(0, SLOTS)
            inside = k < slots
            tl.store(stored + k, tl.load(sums + k, mask=inside, other=0), mask=inside)
            tl.store(sums + k, tl.zeros([SLOTS], dtype=tl.int64), mask=inside)
        tl.store(counter, 0)
