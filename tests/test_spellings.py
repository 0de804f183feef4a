"""The spellings suite: SE-ResNet9-Fixup written the ways people write it
(examples/seresnet9_spellings.py)
compiles to the regions and the kernels between them of the example's spelling, and computes what
each spelling computes. On the CPU the regions run as PyTorch ops; the passes are the ones a CUDA
input gets (``cuda_pipeline``), so what is compared is what a GPU would run."""

from __future__ import annotations

import pytest
import torch

from conftest import CUDA_PIPELINE
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.tables import glue_kernels, pytorch_nodes
from examples.seresnet9_spellings import SPELLINGS


def _compiled(name: str):
    model = SPELLINGS[name](base_planes=32)
    compiled = CompiledModule(model, CUDA_PIPELINE, backends=())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, want = compiled(x), model(x)
    spec = compiled.last
    kernels = ([r.pattern for r in spec.regions], glue_kernels(spec.graph_module),
               [(p["op"], p["reason"]) for p in pytorch_nodes(spec.graph_module)])
    return kernels, out, want


@pytest.mark.parametrize("name", [n for n in SPELLINGS if n != "example"])
def test_a_spelling_gets_the_example_s_regions_and_kernels(name):
    (regions, glue, left), out, want = _compiled(name)
    (best_regions, best_glue, best_left), best_out, _ = _compiled("example")
    assert (regions, glue, left) == (best_regions, best_glue, best_left)
    assert len(regions) == 9 and glue == {"se_scale": 4} and not left  # the example's kernels
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, best_out, rtol=1e-5, atol=1e-5)  # the same network


def test_the_benchmark_and_the_cli_reach_every_spelling():
    from examples.benchmark import MODELS, SPELLINGS as BENCHED
    from fusion_compiler.tools.cli import load_model

    assert sorted(m.removeprefix("spelling-") for m in BENCHED) == sorted(SPELLINGS)
    ref, shape, train = MODELS["spelling-authors"]
    assert shape == (128, 3, 64, 64) and not train
    model = load_model(ref)
    assert sum(p.numel() for p in model.parameters()) == 4_938_256  # the full-size network
