"""The Triton kernel of :mod:`fusion_compiler.kernels.space_to_depth` (imported only when Triton
does: this module imports it at the top, as Triton resolves the helpers a kernel calls among its
module's globals).

One program computes ``HB`` output rows of one sample. For each group of ``CG`` image channels
(all of them in one step for the images this is for, so that every load of the program is in
flight at once) it loads the ``HB * B`` image rows of each channel contiguously, rearranges them
in registers into ``[HB * W/B, CG*B*B]`` (pixel, (channel, tap)) and accumulates ``tl.dot`` with
the matching ``[CG*B*B, K]`` rows of the weight (packed in that order beforehand:
``space_to_depth.packed_weight``; its loads are issued before the image's), in fp32; the steps
are unrolled (``tl.static_range``). Then the program applies up to four epilogue ops (codes of
``space_to_depth.py``) and stores the requested stages as channels_last rows. Measurements:
docs/decisions.md, "The SpaceToDepth stem as one Triton kernel".
"""

import triton
import triton.language as tl


@triton.jit
def step(acc, OP: tl.constexpr, p, s, k):
    # one epilogue op on the fp32 [pixels, K] tile: a binary op with the operand at p (s: 1 per
    # channel, 0 one element), or an activation; OP 0 does nothing
    if OP == 1:
        acc = acc + tl.load(p + k * s).to(tl.float32)[None, :]
    elif OP == 2:
        acc = acc - tl.load(p + k * s).to(tl.float32)[None, :]
    elif OP == 3:
        acc = acc * tl.load(p + k * s).to(tl.float32)[None, :]
    elif OP == 4:
        acc = acc / tl.load(p + k * s).to(tl.float32)[None, :]
    elif OP == 5:
        acc = tl.maximum(acc, 0.0)
    elif OP == 6:
        acc = tl.sigmoid(acc)
    elif OP == 7:
        acc = 2.0 * tl.sigmoid(2.0 * acc) - 1.0
    return acc


@triton.jit
def store(acc, STAGE: tl.constexpr, OUT0: tl.constexpr, OUT1: tl.constexpr, y0, y1, offs):
    # store the tile to the output(s) that asked for stage STAGE (0: the convolution's value)
    if OUT0 == STAGE:
        tl.store(y0 + offs, acc.to(y0.dtype.element_ty))
    if OUT1 == STAGE:
        tl.store(y1 + offs, acc.to(y1.dtype.element_ty))


@triton.jit
def space_to_depth_conv_kernel(
        x, w, y0, y1, p0, p1, p2, p3, s0, s1, s2, s3,
        C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
        B: tl.constexpr, HB: tl.constexpr, CG: tl.constexpr,
        OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
        OUT0: tl.constexpr, OUT1: tl.constexpr):
    # x [N, C, H, W] contiguous; w [CP*B*B, K] contiguous, row (c*B + dh)*B + dw (CP: C rounded
    # up to a multiple of CG, zero rows past C); y0/y1 [N, K, H/B, W/B] channels_last; grid
    # N * (H/B) / HB programs; CG image channels per step (a power of two; those past C masked)
    HO: tl.constexpr = H // B
    WO: tl.constexpr = W // B
    pid = tl.program_id(0)
    n = (pid // (HO // HB)).to(tl.int64)
    hb0 = (pid % (HO // HB)) * HB
    group = tl.arange(0, CG)
    rows = tl.arange(0, HB * B)
    cols = tl.arange(0, W)
    j = tl.arange(0, CG * B * B)  # (channel of the group, dh, dw), channel-major
    k = tl.arange(0, K)
    acc = tl.zeros((HB * WO, K), dtype=tl.float32)
    for c0 in tl.static_range(0, C, CG):  # unrolled: one step for up to CG image channels
        c = c0 + group
        # the weight rows first, so that their loads (from L2) are in flight beside the image's
        wc = tl.load(w + (c0 * B * B + j)[:, None] * K + k[None, :])  # [(c, dh, dw), K]
        # image rows b*hb0 .. b*(hb0+HB)-1 of CG channels, each channel's rows contiguous
        tile = tl.load(x + ((n * C + c[:, None, None]) * H + hb0 * B + rows[None, :, None]) * W
                       + cols[None, None, :], mask=(c < C)[:, None, None],
                       other=0.0).to(w.dtype.element_ty)  # an fp32 image: rounded (autocast)
        tile = tl.permute(tl.reshape(tile, (CG, HB, B, WO, B)), (1, 3, 0, 2, 4))  # hb, wb, c, dh, dw
        a = tl.reshape(tile, (HB * WO, CG * B * B))
        acc = tl.dot(a, wc, acc)
    pix = tl.arange(0, HB * WO)
    offs = ((n * HO + hb0) * WO + pix[:, None]) * K + k[None, :]  # channels_last output
    store(acc, 0, OUT0, OUT1, y0, y1, offs)
    acc = step(acc, OP0, p0, s0, k)
    store(acc, 1, OUT0, OUT1, y0, y1, offs)
    acc = step(acc, OP1, p1, s1, k)
    store(acc, 2, OUT0, OUT1, y0, y1, offs)
    acc = step(acc, OP2, p2, s2, k)
    store(acc, 3, OUT0, OUT1, y0, y1, offs)
    acc = step(acc, OP3, p3, s3, k)
    store(acc, 4, OUT0, OUT1, y0, y1, offs)
