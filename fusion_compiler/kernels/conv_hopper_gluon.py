"""The Gluon kernel of :mod:`fusion_compiler.kernels.conv_hopper` (imported only where Triton's
Gluon dialect does: this module imports it at the top, as Gluon resolves the helpers a kernel
calls among its module's globals).

Implicit GEMM on Hopper (sm_90a): ``M`` output pixels by ``K`` output channels, reduced over the
``R * S`` filter taps times ``C`` input channels. One program computes a tile of
``BN_IMG x BH x BW`` output pixels (``BLOCK_M``, a box of images, rows and columns) by
``BLOCK_N`` output channels. Each reduction step loads, by TMA (the Tensor Memory Accelerator's
bulk copies, NVIDIA Hopper tuning guide, "Tensor Memory Accelerator"), the input box shifted by
one filter tap with ``BLOCK_K`` channels (a 4-d tiled load of the NHWC image; its zero fill
outside the image is the convolution's padding) and the matching ``[BLOCK_N, BLOCK_K]`` block of
the ``[K, R*S*C]`` weight, into a ring of ``STAGES`` shared-memory buffers; ``warpgroup_mma``
(wgmma) multiplies them from shared memory into an fp32 accumulator, one MMA in flight while
the next loads arrive. Triton 3.6 has no TMA im2col mode, hence one tiled load per tap. The
epilogue is :mod:`.conv_triton`'s (a Triton-language function, which a Gluon kernel may call),
run on the fp32 tile in a blocked layout; it stores the requested stages as channels_last rows.
Stride 1, or 2 through a view of the image whose parities are dimensions of their own (so a tap's
rows and columns are again a tiled box); dilation 1.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .conv_triton import epilogue


@gluon.constexpr_function
def mma_warps(block_m, num_warps):
    # warps along M first (a warpgroup's wgmma covers 64 rows), the rest along N
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return warps


@gluon.constexpr_function
def mma_instr_n(block_m, block_n, num_warps):
    # the widest wgmma N (a multiple of 8, at most 256) that divides the warps' share of BLOCK_N
    m_reps = (block_m + 15) // 16
    n_reps = (num_warps + m_reps - 1) // m_reps
    widest = max(block_n // n_reps, 8)
    n = 256
    while n > widest or block_n % n != 0:
        n -= 8
    return n


@gluon.jit
def issue_load(x_desc, w_desc, a_bufs, b_bufs, bars, j, n0, h0, w0, k0, C,
               CB: gl.constexpr, S: gl.constexpr, PH: gl.constexpr, PW: gl.constexpr,
               STRIDE: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    # reduction step j: filter tap j // CB, channel block j % CB, into ring slot j % STAGES
    slot = j % STAGES
    tap = j // CB
    cb = j - tap * CB
    r = tap // S
    s = tap - r * S
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    if STRIDE == 1:
        tma.async_copy_global_to_shared(x_desc, [n0, h0 + r - PH, w0 + s - PW, cb * BLOCK_K],
                                        bar, a_bufs.index(slot))
    else:  # the [N, H/2, 2, W/2, 2C] view: input row 2*oh + r - PH = 2*(oh + ah) + bh
        ah = (r + PH) // 2 - PH
        aw = (s + PW) // 2 - PW
        bh = r - PH - 2 * ah
        bw = s - PW - 2 * aw
        tma.async_copy_global_to_shared(x_desc, [n0, h0 + ah, bh, w0 + aw,
                                                 bw * C + cb * BLOCK_K], bar, a_bufs.index(slot))
    tma.async_copy_global_to_shared(w_desc, [k0, tap * C + cb * BLOCK_K], bar, b_bufs.index(slot))


@gluon.jit
def conv_wgmma_kernel(x_desc, w_desc, y0, y1, p0, p1, p2, p3, p4, p5, N, HO, WO, C, K,
                      R: gl.constexpr, S: gl.constexpr, PH: gl.constexpr, PW: gl.constexpr,
                      STRIDE: gl.constexpr, CB: gl.constexpr, STAGES: gl.constexpr,
                      EPI_N: gl.constexpr,
                      OP0: gl.constexpr, OP1: gl.constexpr, OP2: gl.constexpr,
                      OP3: gl.constexpr, OP4: gl.constexpr, OP5: gl.constexpr,
                      KIND0: gl.constexpr, KIND1: gl.constexpr, KIND2: gl.constexpr,
                      KIND3: gl.constexpr, KIND4: gl.constexpr, KIND5: gl.constexpr,
                      OUT0: gl.constexpr, OUT1: gl.constexpr, num_warps: gl.constexpr):
    # x_desc: the NHWC image [N, H, W, C], block [BN_IMG, BH, BW, BLOCK_K] (STRIDE 1), or its
    # [N, H/2, 2, W/2, 2*C] view, block [BN_IMG, BH, 1, BW, BLOCK_K] (STRIDE 2: the row and
    # column parities a tap reads fixed per load); w_desc: the weight [K, R*S*C] (KRSC rows),
    # block [BLOCK_N, BLOCK_K]; y0/y1 [N, HO, WO, K] (channels_last); grid
    # (cdiv(N, BN_IMG) * cdiv(HO, BH) * cdiv(WO, BW), cdiv(K, BLOCK_N)); C = CB * BLOCK_K
    BN_IMG: gl.constexpr = x_desc.block_type.shape[0]
    BH: gl.constexpr = x_desc.block_type.shape[1]
    BW: gl.constexpr = x_desc.block_type.shape[STRIDE + 1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[STRIDE + 2]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = BN_IMG * BH * BW
    STEPS: gl.constexpr = R * S * CB

    tiles_w = gl.cdiv(WO, BW)
    tiles_h = gl.cdiv(HO, BH)
    pid_m = gl.program_id(0)
    n0 = pid_m // (tiles_w * tiles_h) * BN_IMG
    h0 = (pid_m // tiles_w) % tiles_h * BH
    w0 = pid_m % tiles_w * BW
    k0 = gl.program_id(1) * BLOCK_N

    if STRIDE == 1:
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BN_IMG, BH, BW, BLOCK_K],
                                           x_desc.layout)
    else:
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BN_IMG, BH, 1, BW, BLOCK_K],
                                           x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=mma_warps(BLOCK_M, num_warps),
        instr_shape=[16, mma_instr_n(BLOCK_M, BLOCK_N, num_warps), 16])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)

    for j in gl.static_range(STAGES - 1):
        if j < STEPS:  # fewer steps than stages: no load past the last
            issue_load(x_desc, w_desc, a_bufs, b_bufs, bars, j, n0, h0, w0, k0, C, CB, S, PH,
                       PW, STRIDE, BLOCK_K, STAGES)
    for i in range(STEPS):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        a = a_bufs.index(slot).reshape([BLOCK_M, BLOCK_K])
        b = b_bufs.index(slot).permute((1, 0))
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # one MMA in flight: the slot of step i - 1, which the next load reuses, is free
        acc, a, b = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
        if i + STAGES - 1 < STEPS:
            issue_load(x_desc, w_desc, a_bufs, b_bufs, bars, i + STAGES - 1, n0, h0, w0, k0, C,
                       CB, S, PH, PW, STRIDE, BLOCK_K, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # the epilogue in a blocked layout: 8 channels (16 bytes of fp16) per thread, rows of EPI_N
    # threads along the channels
    epi: gl.constexpr = gl.BlockedLayout([1, 8], [32 // EPI_N, EPI_N], [num_warps, 1], [1, 0])
    acc = gl.convert_layout(acc, epi)
    i = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, epi))
    offs_k = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, epi))
    img = n0 + i // (BH * BW)
    hh = h0 + (i // BW) % BH
    ww = w0 + i % BW
    valid = (img < N) & (hh < HO) & (ww < WO)
    row = (img.to(gl.int64) * HO + hh) * WO + ww
    mask_k = offs_k < K
    offs_o = gl.expand_dims(row * K, 1) + gl.expand_dims(offs_k, 0)
    mask = gl.expand_dims(valid, 1) & gl.expand_dims(mask_k, 0)
    epilogue(acc, y0, y1, p0, p1, p2, p3, p4, p5, offs_k, offs_o, mask_k, mask,
             OP0, OP1, OP2, OP3, OP4, OP5, KIND0, KIND1, KIND2, KIND3, KIND4, KIND5, OUT0, OUT1)
