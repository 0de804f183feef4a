"""A graphed training step split at DistributedDataParallel's bucket boundaries
(``fusion_compiler.runtime.ddp_stages``, ``runners.staged``): where the stages start, that the
split graph computes what the whole one does, and where the caps come from. The CUDA graphs of the
stages need a GPU (``test_gpu_ddp_overlap.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import fusion_compiler as fc
from fusion_compiler.config import CompileOptions
from fusion_compiler.dynamo import fusion_compiler_backend
from fusion_compiler.runners import staged
from fusion_compiler.runtime.cuda_graph_training import Stage
from fusion_compiler.runtime.ddp_stages import ddp_bucket_caps, stage_boundaries

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def lowered() -> tuple[torch.nn.Module, fx.GraphModule]:
    """SE-ResNet9's lowered training graph as a GPU gets it (CPU kernels)."""
    model = randomize_(se_resnet9_fixup(3), seed=0).train()
    fast = fc.compile(model, cuda_pipeline=True, cuda_graph=False, glue_backend=None,
                      cache_dir=False)
    fast(torch.randn(2, 3, 64, 64)).sum().backward()
    return model, fast.last.graph_module


def _first_uses(gm: fx.GraphModule) -> dict[int, int]:
    """Node index of each parameter's first use (``get_attr`` or a module call)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    first: dict[int, int] = {}
    for i, n in enumerate(nodes):
        params = ([gm.get_parameter(n.target)] if n.op == "get_attr" and n.target in dict(
            gm.named_parameters()) else list(gm.get_submodule(n.target).parameters())
            if n.op == "call_module" else [])
        for p in params:
            first.setdefault(id(p), i)
    return first


def test_stages_start_where_the_gradients_reach_each_bucket_cap(lowered):
    model, gm = lowered
    size = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    first = _first_uses(gm)
    assert set(first) == set(size)
    assert stage_boundaries(gm, (10**12, 10**12)) == []  # one bucket: one stage
    for caps in ((1 * MiB, 25 * MiB), (1 * MiB, 1 * MiB), (4 * MiB, 4 * MiB)):
        starts = stage_boundaries(gm, caps)
        assert starts == sorted(set(starts)) and starts
        ends = [*starts[1:], len(gm.graph.nodes)]
        for k, (start, end) in enumerate(zip(starts, ends)):
            gathered = sum(size[p] for p, i in first.items() if start <= i < end)
            # each stage after the first holds a bucket's worth (the last one the first cap)
            assert gathered >= (caps[0] if k == len(starts) - 1 else caps[1])
        assert sum(size[p] for p, i in first.items() if i < starts[0]) > 0
    fine = stage_boundaries(gm, (1 * MiB, 1 * MiB))
    assert len(fine) > len(stage_boundaries(gm, (1 * MiB, 25 * MiB)))


def test_the_split_graph_computes_the_same_outputs_and_gradients(lowered):
    model, gm = lowered
    starts = stage_boundaries(gm, (1 * MiB, 1 * MiB))
    parent = staged(gm, starts, None)
    stages = [m for m in parent.modules() if isinstance(m, Stage)]
    assert len(stages) == len(starts) + 1
    assert [n for n, _ in parent.named_children() if n.startswith("submod_")] == [
        f"submod_{k}" for k in range(len(stages))]
    seen = []  # only tensors cross a boundary (a tuple keeps its getitems on its side)
    for stage in stages:
        stage.register_forward_pre_hook(lambda m, args: seen.extend(map(type, args)))
    x = torch.randn(2, 3, 64, 64)
    got, want = [], []
    for fn, sink in ((parent, got), (gm, want)):
        model.zero_grad(set_to_none=True)
        out = fn(x)
        out.square().sum().backward()
        sink.append(out.detach())
        sink.extend(p.grad.clone() for p in model.parameters())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert seen and set(seen) <= {torch.Tensor, torch.nn.Parameter}


class _Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.caps = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.caps = ddp_bucket_caps()
        return self.linear(x)


class _Staging(torch.nn.Module):
    """Asks, inside DDP's forward, where a graphed training step of ``gm`` would be split."""

    def __init__(self, model: torch.nn.Module, gm: fx.GraphModule):
        super().__init__()
        self.model, self.gm, self.starts = model, gm, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fusion_compiler.config import Target
        from fusion_compiler.runners import Runners

        runners = Runners(self.model, CompileOptions(ddp_overlap=True), lambda notes, why: None)
        self.starts = runners.ddp_stages(self.gm, Target(cuda=True, training=True))
        return self.model(x)


def test_bucket_caps_are_read_from_the_ddp_module_whose_forward_runs(tmp_path, lowered):
    assert ddp_bucket_caps() is None
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tmp_path / 'store'}")
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
        for kwargs, want in (({}, (dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MiB)),
                             ({"bucket_cap_mb": 4}, (4 * MiB, 4 * MiB))):
            probe = _Probe()
            DDP(probe, **kwargs)(torch.randn(2, 4))
            assert probe.caps == want
        model, gm = lowered
        staging = _Staging(model, gm)
        DDP(staging, bucket_cap_mb=1)(torch.randn(2, 3, 64, 64))
        assert staging.starts == stage_boundaries(gm, (1 * MiB, 1 * MiB)) != []
    finally:
        dist.destroy_process_group()
    assert ddp_bucket_caps() is None


def test_the_option_is_off_by_default_and_reaches_both_doors():
    """Off until it is measured faster (docs/decisions.md); ``compile(..., ddp_overlap=True)``
    and ``torch.compile(..., options={"ddp_overlap": True})`` turn it on."""
    gm = fx.symbolic_trace(torch.nn.ReLU())
    example = [torch.randn(2)]
    assert CompileOptions().ddp_overlap is False
    assert fusion_compiler_backend(gm, example).options.ddp_overlap is False
    assert fusion_compiler_backend(gm, example, {"ddp_overlap": True}).options.ddp_overlap
    assert fc.compile(torch.nn.ReLU(), ddp_overlap=True).options.ddp_overlap
    with pytest.raises(TypeError, match="ddp_overlap"):
        CompileOptions(ddp_overlap=1)


def test_no_stages_outside_a_ddp_forward_or_without_the_option(lowered):
    from fusion_compiler.config import Target
    from fusion_compiler.runners import Runners

    model, gm = lowered
    on = Runners(model, CompileOptions(ddp_overlap=True), lambda notes, why: None)
    off = Runners(model, CompileOptions(), lambda notes, why: None)
    training = Target(cuda=True, training=True)
    assert on.ddp_stages(gm, training) == []  # no DDP forward running
    assert off.ddp_stages(gm, training) == []
    assert on.ddp_stages(gm, Target(cuda=True)) == []  # inference
