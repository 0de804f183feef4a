"""Layout edits between regions (:mod:`fusion_compiler.runtime.layout`), checked on the CPU."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fusion_compiler.passes.post_lowering.layout import nchw_padded_avg_pools
from conftest import relowered


class Pools(nn.Module):
    def forward(self, x):
        return (F.avg_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 2, 2, 0),
                F.avg_pool2d(x, kernel_size=3, stride=2, padding=(0, 1)))


def test_only_padded_avg_pools_get_an_nchw_input():
    gm = fx.symbolic_trace(Pools())
    x = torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    want = gm(x)
    assert nchw_padded_avg_pools(gm) == 2
    pools = [n for n in gm.graph.nodes if n.target is F.avg_pool2d]
    fed = [n.args[0].target == "contiguous" if n.args else False for n in pools]
    assert fed == [True, False, True]
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
    assert nchw_padded_avg_pools(fx.symbolic_trace(nn.Conv2d(4, 4, 3))) == 0


class Stem(nn.Module):
    """A stem whose PyTorch-op output (the max pool) is read by two regions, and a region fed by
    the graph input: resnet's shape."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 1)
        self.b = nn.Conv2d(8, 16, 1)

    def forward(self, x):
        p = F.max_pool2d(torch.relu(self.stem(x)), 2)
        return torch.relu(self.a(p)).sum() + self.b(p).sum()


def test_region_activations_are_made_channels_last_once_where_they_are_made():
    import fusion_compiler as fc
    from fusion_compiler.ir.region import Region
    from fusion_compiler.passes.post_lowering.layout import channels_last_activations

    torch.manual_seed(0)
    spec = fc.compile(Stem().eval(), glue_backend=None).specialize(torch.randn(2, 3, 8, 8))
    gm = spec.graph_module
    regions = {n.name: gm.get_submodule(n.target) for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Region)}
    assert len(regions) == 3
    x = torch.randn(2, 3, 8, 8)
    want = gm(x)
    assert channels_last_activations(gm) == 0  # on the CPU no region asks for channels_last
    for region in regions.values():  # as the cuDNN kernels mark them: the image is input 0
        relowered(region, backend="cudnn", nhwc_inputs=frozenset({0}))
    assert channels_last_activations(gm) == 2  # the graph input and the max pool's output
    converts = [n for n in gm.graph.nodes if n.target == "contiguous"]
    assert [n.args[0].op for n in converts] == ["placeholder", "call_function"]
    assert all(n.kwargs["memory_format"] == torch.channels_last for n in converts)
    assert len(converts[1].users) == 2  # one conversion for both regions reading the pool
    # the stem region's output comes from cuDNN (already channels_last): not converted
    torch.testing.assert_close(gm(x), want)


def test_four_channel_images_pad_a_pytorch_regions_image_and_weight_with_a_zero_channel():
    """A region left to PyTorch whose convolution reads a 3-channel bf16 image gets a zero fourth
    channel in image and weight, added before its call: the same values, and gradients still
    reach the 3-channel weight and image. fp32 stays as it is. (On CUDA only in ``compile``; the
    edit itself is device-agnostic.)"""
    import copy

    import fusion_compiler as fc
    from fusion_compiler.passes.post_lowering.layout import four_channel_images

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3), nn.ReLU()).to(torch.bfloat16)
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16, requires_grad=True)
    gm = fc.compile(model, glue_backend=None).specialize(x).graph_module
    assert four_channel_images(gm) == 1
    pads = [n for n in gm.graph.nodes if n.target is F.pad]
    assert [n.args[0].op for n in pads] == ["placeholder", "get_attr"]
    region = next(m for m in gm.modules() if type(m).__name__ == "Region")
    assert [tuple(ph.meta["val"].shape) for ph in region.graph_module.graph.nodes
            if ph.op == "placeholder"][:2] == [(2, 4, 32, 32), (8, 4, 7, 7)]
    got = gm(x)
    ref = copy.deepcopy(model).double()(x.detach().double())
    assert (got.double() - ref).abs().max() / ref.abs().max() < 2e-2
    grads = torch.autograd.grad(got.float().square().sum(), [x, model[0].weight])
    assert grads[0].shape == x.shape and grads[1].shape == (8, 3, 7, 7)
    assert all(g.abs().sum() > 0 for g in grads)
    fp32 = fc.compile(nn.Conv2d(3, 8, 3)).specialize(torch.randn(1, 3, 8, 8)).graph_module
    assert four_channel_images(fp32) == 0


def test_an_image_a_cudnn_region_pads_is_padded_once_in_the_graph():
    """Two regions that zero-pad the same 3-channel image to 8 channels (as cuDNN kernels mark
    it in ``Region.padded_images``) read one channels_last 8-channel tensor the graph makes."""
    import fusion_compiler as fc
    from fusion_compiler.ir.region import Region
    from fusion_compiler.passes.post_lowering.layout import channel_padded_images

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3), nn.Conv2d(3, 8, 1)

        def forward(self, x):
            return self.a(x).sum() + self.b(x).sum()

    gm = fc.compile(Two().eval(), glue_backend=None).specialize(torch.randn(2, 3, 8, 8)).graph_module
    calls = [n for n in gm.graph.nodes if n.op == "call_module"
             and isinstance(gm.get_submodule(n.target), Region)]
    assert len(calls) == 2 and channel_padded_images(gm) == 0
    for call in calls:
        relowered(gm.get_submodule(call.target), padded_images={0: 8})
    # a region left to PyTorch (e.g. declined by timing after its kernel was built) is not
    # edited: its ops take the image with its own 3 channels
    assert channel_padded_images(gm) == 0
    for call in calls:
        relowered(gm.get_submodule(call.target), backend="cudnn")
    assert channel_padded_images(gm) == 1
    gm.graph.lint()  # the pad's three ops in order, before the regions that read them
    padded = calls[0].args[0]
    assert calls[1].args[0] is padded
    wide = padded.args[0]
    assert (padded.target, wide.target, wide.args[0].target) == ("permute", F.pad, "permute")
    assert wide.args[1] == (0, 5) and wide.args[0].args[0].op == "placeholder"
    val = padded.meta["val"]
    assert val.shape == (2, 8, 8, 8) and val.is_contiguous(memory_format=torch.channels_last)
    assert channel_padded_images(gm) == 0  # already padded: the regions read 8 channels


def test_four_channel_images_leave_an_image_the_region_also_reads_elsewhere():
    """A 3-channel image that the region also adds after its 1x1 convolution (a residual) keeps
    its 3 channels: a zero channel would change the add's shape."""
    import fusion_compiler as fc
    from fusion_compiler.passes.post_lowering.layout import four_channel_images

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return torch.relu(self.conv(x) + x)

    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    gm = fc.compile(Residual().to(torch.bfloat16), glue_backend=None).specialize(x).graph_module
    assert four_channel_images(gm) == 0
