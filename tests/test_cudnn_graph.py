"""cuDNN graph JSON built without a GPU, and the plan cache's handling of bad entries."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from conftest import specialize

from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.backends.cudnn.graph import graph_json, nhwc_strides, region_recipe
from fusion_compiler.runtime.plan_cache import PlanCache, StaleEntry, default_cache_dir

pytest.importorskip("cudnn", reason="the cuDNN frontend (nvidia-cudnn-frontend) is not installed")


@pytest.fixture(scope="module")
def fp16_regions():
    model = randomize_(se_resnet9_fixup(3)).half().eval()
    return specialize(model, torch.randn(128, 3, 64, 64, dtype=torch.float16),
                      horizontal_fusion=False).regions


def test_a_channel_view_image_is_declared_with_the_wider_tensors_strides():
    """With horizontal fusion, layer1's second convolution reads 128 of the merged
    convolution's 256 output channels in place."""
    model = randomize_(se_resnet9_fixup(3)).half().eval()
    regions = specialize(model, torch.randn(128, 3, 64, 64, dtype=torch.float16),
                         fuse_prologue=False, fuse_reduction=False).regions
    merged, reader = regions[3], regions[4]
    assert merged.conv.meta["val"].shape[1] == 256
    image = region_recipe(reader)["inputs"][0]
    assert image["dim"] == [128, 128, 8, 8] and image["stride"] == nhwc_strides((128, 256, 8, 8))


def _types(graph: dict) -> list[str]:
    return [n["type"] for n in graph["nodes"]]


def test_every_region_has_one_conv_and_nhwc_io(fp16_regions):
    for region in fp16_regions:
        graph = graph_json(region)
        assert _types(graph).count("CONV_FPROP") == 1
        for name, t in graph["tensors"].items():
            if t["is_virtual"] or len(t["dim"]) != 4 or t["dim"][1] == 1:
                continue
            assert t["stride"] == nhwc_strides(tuple(t["dim"])), (region.region_id, name)


def test_prologue_is_stored_in_the_io_type(fp16_regions):
    graph = graph_json(fp16_regions[1])  # [add] conv3x3 > add > relu
    first = graph["nodes"][0]
    assert first["type"] == "POINTWISE" and first["params"]["mode"] == "add"
    assert graph["tensors"][first["outputs"]["OUT_0"]]["dtype"] == "data_type.HALF"
    assert graph["context"]["compute_data_type"] == "data_type.FLOAT"


def test_squeeze_is_an_exit_reduction_with_its_own_output(fp16_regions):
    region = fp16_regions[2]  # [add] conv3x3 > mul > add + sum_hw
    graph = graph_json(region)
    assert _types(graph)[-1] == "REDUCTION"
    outputs = [t for t in graph["tensors"].values() if not t["is_virtual"] and t["uid"] and
               t["dim"] in ([128, 64, 1, 1], [128, 64, 16, 16])]
    squeeze = next(t for t in outputs if t["dim"] == [128, 64, 1, 1])
    assert squeeze["dtype"] == "data_type.FLOAT"  # cuDNN declines a HALF reduction output


def _conv_dims(region) -> tuple[list[int], list[int], dict]:
    """The cuDNN graph's convolution: image dims, weight dims, parameters."""
    graph = graph_json(region)
    conv = next(n for n in graph["nodes"] if n["type"] == "CONV_FPROP")
    return (graph["tensors"][conv["inputs"]["image"]]["dim"],
            graph["tensors"][conv["inputs"]["weight"]]["dim"], conv["params"])


@pytest.mark.parametrize("channels, padded", [(3, 4), (1, 4), (5, 8)])
def test_few_input_channels_are_padded_to_four_more_to_eight(channels, padded):
    """fp16 images of 1-3 channels are zero-padded to 4 (the engines take it; a stem ran faster
    than on 8), others to the next multiple of 8. A 3x3 stride-2 stem is not rewritten as
    space-to-depth (more multiply-adds than ``STEM_FLOP_RATIO`` allows)."""
    model = nn.Sequential(nn.Conv2d(channels, 32, 3, stride=2, padding=1, bias=False),
                          nn.ReLU()).half().eval()
    region = specialize(model, torch.randn(8, channels, 32, 32, dtype=torch.float16)).regions[0]
    image, weight, params = _conv_dims(region)
    assert image == [8, padded, 32, 32] and weight == [32, padded, 3, 3]
    assert params["stride"] == [2, 2]


@pytest.mark.parametrize("kernel, stride, padding, image_dims, weight_dims, conv_stride", [
    (4, 4, 0, [128, 48, 16, 16], [64, 48, 1, 1], 1),  # patchify (ConvNeXt's): 1x1 on 48 channels
    (7, 2, 3, [128, 4, 64, 64], [64, 4, 7, 7], 2),  # the ResNet stem: kept, on 4 channels
])
def test_three_channel_stems_on_cudnn(kernel, stride, padding, image_dims, weight_dims,
                                      conv_stride):
    model = nn.Sequential(nn.Conv2d(3, 64, kernel, stride, padding, bias=False),
                          nn.ReLU()).half().eval()
    region = specialize(model, torch.randn(128, 3, 64, 64, dtype=torch.float16)).regions[0]
    image, weight, params = _conv_dims(region)
    assert image == image_dims and weight == weight_dims
    assert params["stride"] == [conv_stride] * 2


def test_reference_stem_reads_an_unpadded_channels_last_image(fp16_regions):
    graph = graph_json(fp16_regions[0])  # SpaceToDepth copy to channels_last, conv1x1 48 -> 64
    conv = next(n for n in graph["nodes"] if n["type"] == "CONV_FPROP")
    assert graph["tensors"][conv["inputs"]["image"]]["dim"] == [128, 48, 16, 16]
    assert graph["tensors"][conv["inputs"]["weight"]]["dim"] == [64, 48, 1, 1]


def test_plan_cache_round_trip_and_bad_entries(tmp_path):
    cache = PlanCache(tmp_path)
    header = PlanCache.header(json.dumps({"nodes": []}), {"gpu": "H100", "sm": "90",
                                                          "cudnn": 91900, "frontend": "1.32.0"})
    assert cache.load(header) is None
    cache.store(header, b"\x00plan-bytes")
    assert cache.load(header) == b"\x00plan-bytes"
    cache.path(header).write_bytes(b"not json\n")
    with pytest.raises(StaleEntry, match="unreadable"):
        cache.load(header)
    foreign = dict(header, gpu="A100")
    cache.path(header).write_bytes(json.dumps(foreign).encode() + b"\nplan")
    with pytest.raises(StaleEntry, match="other versions/devices"):
        cache.load(header)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert default_cache_dir(tmp_path / "x") == tmp_path / "x"
    assert default_cache_dir(False) is None
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", "off")
    assert default_cache_dir() is None


@pytest.mark.parametrize("kind", ["dgrad", "wgrad"])
def test_conv_gradient_graphs_are_nhwc_with_io_typed_output(fp16_regions, kind):
    from fusion_compiler.backends.cudnn.backward import conv_grad_graph

    region = fp16_regions[3]  # conv3x3/s2, 64 -> 128 channels
    spec = conv_grad_graph(kind, region.conv)
    graph = json.loads(str(spec.graph))
    assert _types(graph) == ["CONV_DGRAD" if kind == "dgrad" else "CONV_WGRAD"]
    node = graph["nodes"][0]
    assert node["params"]["stride"] == [2, 2] and node["params"]["padding"] == [1, 1]
    out = spec.outputs[0]
    want = [128, 64, 3, 3] if kind == "wgrad" else [128, 64, 16, 16]
    assert list(out.get_dim()) == want
    assert list(out.get_stride()) == nhwc_strides(tuple(want))
    assert str(out.get_data_type()).endswith("HALF")  # an fp32 wgrad output is 25x slower


def test_dgrad_drelu_graph_masks_with_the_conv_input(fp16_regions):
    from fusion_compiler.backends.cudnn.backward import conv_grad_graph

    region = fp16_regions[2]  # conv2 of layer0: 3x3, stride 1, 64 -> 64 at 16x16
    spec = conv_grad_graph("dgrad_drelu", region.conv)
    graph = json.loads(str(spec.graph))
    assert _types(graph) == ["CONV_DGRAD", "POINTWISE"]
    drelu = graph["nodes"][1]
    assert drelu["params"]["mode"] == "relu_backward"
    assert drelu["inputs"] == {"IN_0": "dgrad::DX", "IN_1": "x"}  # the dgrad stays virtual
    assert [t.get_name() for t in spec.inputs] == ["dy", "w", "x"]
    out = spec.outputs[0]
    assert list(out.get_dim()) == [128, 64, 16, 16]
    assert list(out.get_stride()) == nhwc_strides((128, 64, 16, 16))


def test_plan_records_round_trip_and_never_raise(tmp_path):
    cache = PlanCache(tmp_path)
    header = PlanCache.header('{"nodes": []}', {"gpu": "H100", "sm": "90"})
    assert cache.load_record(header, "pytorch_timing") is None
    cache.store_record(header, "pytorch_timing", {"cudnn_ms": 0.01, "pytorch_ms": 0.02})
    assert cache.load_record(header, "pytorch_timing") == {"cudnn_ms": 0.01, "pytorch_ms": 0.02}
    other = PlanCache.header('{"nodes": []}', {"gpu": "A100", "sm": "80"})
    assert cache.load_record(other, "pytorch_timing") is None  # another GPU's record
    next(tmp_path.glob("*.json")).write_text("{not json")
    assert cache.load_record(header, "pytorch_timing") is None  # corrupt: ignored, re-measured
    PlanCache(None).store_record(header, "pytorch_timing", {})  # caching off: a no-op


class _SqueezeConv(nn.Module):
    """An SE-style 1x1 conv with 12 output channels (not a multiple of 8), a per-channel bias, a
    residual read after the conv, a ReLU and (optionally) the H, W sum of the result."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 12, 1, bias=False)
        self.bias = nn.Parameter(torch.rand(1, 12, 1, 1))

    def forward(self, x, residual):
        y = torch.relu(self.conv(x) + self.bias + residual)
        return y, y.sum((2, 3), keepdim=True)


def test_output_channels_are_padded_to_eight():
    from fusion_compiler.backends.cudnn.graph import output_padding, region_recipe

    model = _SqueezeConv().half().eval()
    x, residual = (torch.randn(4, c, 5, 5, dtype=torch.float16) for c in (16, 12))
    region = specialize(model, x, residual).regions[0]
    pad = output_padding(region)
    assert pad is not None and pad[0] == 16
    recipe = region_recipe(region)
    dims = {t["name"]: t["dim"] for t in recipe["inputs"]}
    roles = {o.role: o.name for o in region.operands()}
    assert dims[roles["weight"]] == [16, 16, 1, 1]  # K padded, C unchanged
    assert dims[roles["channel"]] == [1, 16, 1, 1] and dims[roles["full"]] == [4, 16, 5, 5]
    assert dims[roles["image"]] == [4, 16, 5, 5]
    assert [o["dim"][1] for o in recipe["outputs"]] == [16] * len(recipe["outputs"])
    graph = graph_json(region)  # the frontend takes the padded graph
    assert _types(graph).count("CONV_FPROP") == 1


def test_grouped_convolution_output_channels_are_not_padded():
    from fusion_compiler.backends.cudnn.graph import output_padding

    model = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False)).half().eval()
    region = specialize(model, torch.randn(2, 6, 8, 8, dtype=torch.float16)).regions[0]
    assert output_padding(region) is None


def test_padders_zero_the_new_channels_and_keep_the_rest():
    from fusion_compiler.backends.cudnn.kernel import _operand_padder, _weight_padder

    w = torch.randn(12, 3, 3, 3)
    padded = _weight_padder(8, 16)(w)
    assert padded.shape == (16, 8, 3, 3) and padded.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(padded[:12, :3], w) and not padded[12:].any() and not padded[:, 3:].any()
    bias = torch.randn(12, 1, 1)
    b = _operand_padder(16, "channel")(bias)
    assert b.shape == (1, 16, 1, 1) and torch.equal(b[0, :12], bias) and not b[0, 12:].any()
    full = torch.randn(2, 12, 4, 4)
    f = _operand_padder(16, "full")(full)
    assert f.shape == (2, 16, 4, 4) and torch.equal(f[:, :12], full) and not f[:, 12:].any()
    # an image the graph already padded (runtime.layout.channel_padded_images) is taken as it is
    assert f.is_contiguous(memory_format=torch.channels_last)
    assert _operand_padder(16, "full")(f) is f
    nchw16 = f.contiguous()
    again = _operand_padder(16, "full")(nchw16)  # 16 channels but NCHW: made channels_last
    assert again.is_contiguous(memory_format=torch.channels_last) and torch.equal(again, f)


def test_regions_known_slow_on_cudnn_stay_on_pytorch_without_timing():
    """With ``autotune=1`` nothing is timed, so region kinds measured slow on cuDNN's
    runtime-fusion engines (depthwise 7x7) stay on PyTorch with a reason; others do not."""
    from fusion_compiler.backends.cudnn.support import known_slow_on_cudnn

    def region(conv: nn.Module, channels: int):
        model = nn.Sequential(conv, nn.ReLU()).half().eval()
        return specialize(model, torch.randn(2, channels, 16, 16, dtype=torch.float16)).regions[0]

    depthwise = known_slow_on_cudnn(region(nn.Conv2d(64, 64, 7, padding=3, groups=64), 64))
    assert depthwise.startswith("a depthwise 7x7 convolution")
    assert known_slow_on_cudnn(region(nn.Conv2d(3, 64, 7, stride=2, padding=3), 3)) == ""
    assert known_slow_on_cudnn(region(nn.Conv2d(64, 64, 3, padding=1, groups=64), 64)) == ""
    assert known_slow_on_cudnn(region(nn.Conv2d(64, 64, 7, padding=3), 64)) == ""


def test_a_workspace_a_cuda_graph_used_is_kept_when_a_larger_one_replaces_it(monkeypatch):
    """A captured graph's kernels use the workspace's address at every replay: replaced by a
    larger one (a later compile's plan needs more), it must stay allocated; one no graph used
    is freed as before. On the CPU with the capture state stood in for."""
    import gc
    import weakref

    from fusion_compiler.backends.cudnn.backend import CudnnBackend

    backend = CudnnBackend(cache_dir=False)
    device = torch.device("cpu", 0)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    plain = weakref.ref(backend.workspace(device, 64))
    assert backend.workspace(device, 32) is plain()  # large enough: reused
    backend.workspace(device, 128)
    gc.collect()
    assert plain() is None  # no graph used it: freed

    capturing[0] = True
    captured = weakref.ref(backend.workspace(device, 128))
    capturing[0] = False
    larger = backend.workspace(device, 4096)
    gc.collect()
    assert captured() is not None and larger is not captured()
    assert larger.numel() == 4096 and backend.workspace(device, 1024) is larger
    backend.workspace(device, 8192)  # the replacement no graph used is freed again
    gc.collect()
    assert len(backend._workspaces.retired) == 1


@pytest.mark.parametrize("channels", [1, 2, 3, 6])
def test_a_residual_image_is_padded_as_the_output_is(channels):
    """``relu(conv(x) + x)`` in fp16 with C = K < 8: ``x`` is the convolution's image and the
    epilogue's residual; both uses get the output's padded channel count (the image rule alone,
    4 channels below 4, added a 4-channel x to an 8-channel output; found by a review, session
    42)."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(channels, channels, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x) + x)

    spec = specialize(Residual().half(), torch.randn(2, channels, 8, 8).half())
    (region,) = spec.regions
    recipe = region_recipe(region)
    dims = {t["name"]: t["dim"] for t in recipe["inputs"]}
    image = region.conv.args[0].name
    assert dims[image][1] == recipe["outputs"][0]["dim"][1] == 8
