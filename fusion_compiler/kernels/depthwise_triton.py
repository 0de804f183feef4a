"""The Triton kernel of :mod:`fusion_compiler.kernels.depthwise` (imported only when Triton does;
the epilogue helpers are :mod:`.conv_triton`'s, imported into this module's globals, where
Triton resolves the functions a kernel calls).

A depthwise convolution reads each input channel for one output channel only: ``R * S``
multiply-adds per output element, no reduction across channels, so it is bound by memory, not by
arithmetic, and needs no tensor cores. One program computes a ``[BM, BC]`` tile of the
channels_last output (``BM`` output pixels by ``BC`` channels): for each filter tap it loads the
``[BM, BC]`` input pixels the tap reads (channels contiguous in memory: whole rows of 2 * ``BC``
bytes; neighbouring taps read the same lines again from L1/L2) and ``BC`` weights, and
accumulates in fp32. Then the region's epilogue runs on the fp32 tile (:func:`epilogue`) and the
requested stages are stored. Loads are masked: padding and tile overhangs read zeros. Offsets
are 32-bit where every one fits (``WIDE`` false), and the loads need no channel mask where the
channel tile divides the channel count (``EVEN_C``).
"""

import triton
import triton.language as tl

from .conv_triton import epilogue


@triton.jit
def depthwise_nhwc_kernel(
        x, w, y0, y1, p0, p1, p2, p3, p4, p5, M, C, H, W, HO, WO,
        sx_n, sx_c, sx_h, sx_w, sw_k, sw_r, sw_s,
        R: tl.constexpr, S: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
        PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        BM: tl.constexpr, BC: tl.constexpr, EVEN_C: tl.constexpr, WIDE: tl.constexpr,
        OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
        OP4: tl.constexpr, OP5: tl.constexpr,
        KIND0: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, KIND3: tl.constexpr,
        KIND4: tl.constexpr, KIND5: tl.constexpr,
        OUT0: tl.constexpr, OUT1: tl.constexpr):
    # x [N, C, H, W] with strides sx_*, w [C, 1, R, S] with strides sw_*; y0/y1 [N, C, HO, WO]
    # channels_last; grid cdiv(M, BM) * cdiv(C, BC) programs, the channel tiles of one row of
    # pixels next to each other (they read the same input lines). EVEN_C: BC divides C (the
    # loads need no channel mask); WIDE: an offset may not fit 32 bits (64-bit arithmetic)
    pid = tl.program_id(0)
    tiles_c = tl.cdiv(C, BC)
    pid_m = pid // tiles_c
    pid_c = pid % tiles_c
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_m = offs_m < M
    mask_c = offs_c < C
    if WIDE:
        offs_m = offs_m.to(tl.int64)
    n = offs_m // (HO * WO)
    pixel = offs_m % (HO * WO)
    oh = pixel // WO
    ow = pixel % WO
    base = n * sx_n
    channels = offs_c * sx_c
    acc = tl.zeros((BM, BC), dtype=tl.float32)
    for r in tl.static_range(R):
        ih = oh * SH - PH + r * DH
        row = mask_m & (ih >= 0) & (ih < H)
        for s in tl.static_range(S):
            iw = ow * SW - PW + s * DW
            inside = row & (iw >= 0) & (iw < W)
            pixels = base + ih * sx_h + iw * sx_w
            if EVEN_C:
                a = tl.load(x + (pixels[:, None] + channels[None, :]), mask=inside[:, None],
                            other=0.0)
                b = tl.load(w + offs_c * sw_k + r * sw_r + s * sw_s)
            else:
                a = tl.load(x + (pixels[:, None] + channels[None, :]),
                            mask=inside[:, None] & mask_c[None, :], other=0.0)
                b = tl.load(w + offs_c * sw_k + r * sw_r + s * sw_s, mask=mask_c, other=0.0)
            acc += a.to(tl.float32) * b.to(tl.float32)[None, :]
    offs_o = offs_m[:, None] * C + offs_c[None, :]  # channels_last output
    mask = mask_m[:, None] & mask_c[None, :]
    epilogue(acc, y0, y1, p0, p1, p2, p3, p4, p5, offs_c, offs_o, mask_c, mask,
             OP0, OP1, OP2, OP3, OP4, OP5, KIND0, KIND1, KIND2, KIND3, KIND4, KIND5,
             OUT0, OUT1)
