"""The Triton kernel of :mod:`fusion_compiler.kernels.conv` (imported only when Triton does: this
module imports it at the top, as Triton resolves the helpers a kernel calls among its module's
globals).

Implicit GEMM (the convolution as a matrix product whose A operand is gathered from the image on
the fly instead of materialized: Chetlur et al., "cuDNN: Efficient Primitives for Deep Learning",
2014, section 3; the CUTLASS documentation, "Implicit GEMM Convolution"): ``M = N * HO * WO`` output pixels by ``K`` output
channels, reduced over ``R * S * C`` (filter taps times input channels). One program computes a
``[BM, BN]`` tile of the output, looping over the taps and ``BK``-channel chunks of the input in
one flattened loop (which Triton's pipeliner overlaps with ``num_stages``), accumulating
``tl.dot`` in fp32. Then it applies up to six epilogue ops (codes of ``epilogue.py``) to the
fp32 tile and stores the requested stages as channels_last rows (``[M, K]``, row ``m`` the
pixel). Loads are masked: padding, ragged channel counts and tile overhangs read zeros. Where the
output has too few tiles to fill the GPU, split-K divides each tile's reduction among ``SPLIT``
programs that add fp32 partial sums into a workspace, and a second kernel runs the epilogue.
"""

import triton
import triton.language as tl


@triton.jit
def operand(p, KIND: tl.constexpr, offs_k, offs_o, mask_k, mask):
    # the second operand of a binary epilogue op as fp32: KIND 0 one element, 1 one per output
    # channel, 2 a full channels_last [M, K] tensor
    if KIND == 0:
        v = tl.load(p).to(tl.float32)
    elif KIND == 1:
        v = tl.load(p + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
    else:
        v = tl.load(p + offs_o, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def step(acc, OP: tl.constexpr, KIND: tl.constexpr, p, offs_k, offs_o, mask_k, mask):
    # one epilogue op on the fp32 tile; OP 0 does nothing
    if OP == 1:
        acc = acc + operand(p, KIND, offs_k, offs_o, mask_k, mask)
    elif OP == 2:
        acc = acc - operand(p, KIND, offs_k, offs_o, mask_k, mask)
    elif OP == 3:
        acc = acc * operand(p, KIND, offs_k, offs_o, mask_k, mask)
    elif OP == 4:
        acc = acc / operand(p, KIND, offs_k, offs_o, mask_k, mask)
    elif OP == 5:
        acc = tl.maximum(acc, 0.0)
    elif OP == 6:
        acc = tl.sigmoid(acc)
    elif OP == 7:
        acc = 2.0 * tl.sigmoid(2.0 * acc) - 1.0
    elif OP == 8:
        acc = acc * tl.sigmoid(acc)
    elif OP == 9:  # clamp(acc, 0, bound), the bound a one-element operand
        acc = tl.minimum(tl.maximum(acc, 0.0), operand(p, KIND, offs_k, offs_o, mask_k, mask))
    return acc


@triton.jit
def store(acc, STAGE: tl.constexpr, OUT0: tl.constexpr, OUT1: tl.constexpr, y0, y1, offs_o,
          mask):
    # store the tile to the output(s) that asked for stage STAGE (0: the convolution's value)
    if OUT0 == STAGE:
        tl.store(y0 + offs_o, acc.to(y0.dtype.element_ty), mask=mask)
    if OUT1 == STAGE:
        tl.store(y1 + offs_o, acc.to(y1.dtype.element_ty), mask=mask)


@triton.jit
def epilogue(acc, y0, y1, p0, p1, p2, p3, p4, p5, offs_k, offs_o, mask_k, mask,
             OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
             OP4: tl.constexpr, OP5: tl.constexpr,
             KIND0: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr,
             KIND3: tl.constexpr, KIND4: tl.constexpr, KIND5: tl.constexpr,
             OUT0: tl.constexpr, OUT1: tl.constexpr):
    # the chain on the fp32 tile, storing each requested stage
    store(acc, 0, OUT0, OUT1, y0, y1, offs_o, mask)
    acc = step(acc, OP0, KIND0, p0, offs_k, offs_o, mask_k, mask)
    store(acc, 1, OUT0, OUT1, y0, y1, offs_o, mask)
    acc = step(acc, OP1, KIND1, p1, offs_k, offs_o, mask_k, mask)
    store(acc, 2, OUT0, OUT1, y0, y1, offs_o, mask)
    acc = step(acc, OP2, KIND2, p2, offs_k, offs_o, mask_k, mask)
    store(acc, 3, OUT0, OUT1, y0, y1, offs_o, mask)
    acc = step(acc, OP3, KIND3, p3, offs_k, offs_o, mask_k, mask)
    store(acc, 4, OUT0, OUT1, y0, y1, offs_o, mask)
    acc = step(acc, OP4, KIND4, p4, offs_k, offs_o, mask_k, mask)
    store(acc, 5, OUT0, OUT1, y0, y1, offs_o, mask)
    acc = step(acc, OP5, KIND5, p5, offs_k, offs_o, mask_k, mask)
    store(acc, 6, OUT0, OUT1, y0, y1, offs_o, mask)


@triton.jit
def conv_nhwc_kernel(
        x, w, y0, y1, p0, p1, p2, p3, p4, p5, ws, M,
        sx_n, sx_c, sx_h, sx_w, sw_k, sw_c, sw_r, sw_s,
        C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, K: tl.constexpr,
        HO: tl.constexpr, WO: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        DH: tl.constexpr, DW: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
        SPLIT: tl.constexpr,
        OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
        OP4: tl.constexpr, OP5: tl.constexpr,
        KIND0: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, KIND3: tl.constexpr,
        KIND4: tl.constexpr, KIND5: tl.constexpr,
        OUT0: tl.constexpr, OUT1: tl.constexpr):
    # x [N, C, H, W] with strides sx_*, w [K, C, R, S] with strides sw_*; y0/y1 [N, K, HO, WO]
    # channels_last; grid cdiv(M, BM) * cdiv(K, BN) * SPLIT programs, GROUP row tiles sharing
    # their column tiles in a row (the weights of a column tile stay in L2 across the group).
    # SPLIT > 1 (split-K): each of SPLIT programs per tile reduces a share of the taps and
    # channels and adds its fp32 partial sums into ws [M, K] (zeroed by the caller);
    # conv_epilogue_kernel then runs the epilogue
    pid = tl.program_id(0)
    part = pid % SPLIT
    pid = pid // SPLIT
    tiles_m = tl.cdiv(M, BM)
    tiles_n: tl.constexpr = (K + BN - 1) // BN
    in_group = GROUP * tiles_n
    first_m = (pid // in_group) * GROUP
    rows = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % in_group) % rows
    pid_n = (pid % in_group) // rows

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_k = offs_k < K
    n = (offs_m // (HO * WO)).to(tl.int64)
    pixel = offs_m % (HO * WO)
    oh = pixel // WO
    ow = pixel % WO
    cs = tl.arange(0, BK)
    w_rows = w + offs_k.to(tl.int64) * sw_k
    CHUNKS: tl.constexpr = (C + BK - 1) // BK
    STEPS: tl.constexpr = R * S * CHUNKS
    SHARE: tl.constexpr = (STEPS + SPLIT - 1) // SPLIT
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for t in range(part * SHARE, tl.minimum(part * SHARE + SHARE, STEPS)):
        r = t // (S * CHUNKS)
        s = (t // CHUNKS) % S
        c = (t % CHUNKS) * BK + cs
        mask_c = c < C
        ih = oh * SH - PH + r * DH
        iw = ow * SW - PW + s * DW
        inside = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        pixels = x + n * sx_n + ih.to(tl.int64) * sx_h + iw.to(tl.int64) * sx_w
        a = tl.load(pixels[:, None] + c[None, :] * sx_c,
                    mask=inside[:, None] & mask_c[None, :], other=0.0)
        b = tl.load(w_rows[None, :] + c[:, None] * sw_c + r * sw_r + s * sw_s,
                    mask=mask_c[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(a, b, acc)

    offs_o = offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]  # channels_last output
    mask = mask_m[:, None] & mask_k[None, :]
    if SPLIT == 1:
        epilogue(acc, y0, y1, p0, p1, p2, p3, p4, p5, offs_k, offs_o, mask_k, mask,
                 OP0, OP1, OP2, OP3, OP4, OP5, KIND0, KIND1, KIND2, KIND3, KIND4, KIND5,
                 OUT0, OUT1)
    else:
        tl.atomic_add(ws + offs_o, acc, mask=mask)


@triton.jit
def conv_epilogue_kernel(
        ws, y0, y1, p0, p1, p2, p3, p4, p5, M,
        K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        OP0: tl.constexpr, OP1: tl.constexpr, OP2: tl.constexpr, OP3: tl.constexpr,
        OP4: tl.constexpr, OP5: tl.constexpr,
        KIND0: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, KIND3: tl.constexpr,
        KIND4: tl.constexpr, KIND5: tl.constexpr,
        OUT0: tl.constexpr, OUT1: tl.constexpr):
    # the epilogue of a split-K convolution: ws [M, K] fp32 sums -> y0/y1; grid
    # cdiv(M, BM) * cdiv(K, BN) programs
    tiles_n: tl.constexpr = (K + BN - 1) // BN
    pid = tl.program_id(0)
    offs_m = (pid // tiles_n) * BM + tl.arange(0, BM)
    offs_k = (pid % tiles_n) * BN + tl.arange(0, BN)
    mask_k = offs_k < K
    mask = (offs_m < M)[:, None] & mask_k[None, :]
    offs_o = offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.load(ws + offs_o, mask=mask, other=0.0)
    epilogue(acc, y0, y1, p0, p1, p2, p3, p4, p5, offs_k, offs_o, mask_k, mask,
             OP0, OP1, OP2, OP3, OP4, OP5, KIND0, KIND1, KIND2, KIND3, KIND4, KIND5,
             OUT0, OUT1)
