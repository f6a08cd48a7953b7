"""SqueezeNet 1.0 and 1.1 end to end: the rewrite fuses all 8 Fire modules and every other
Conv + Relu, the fused model passes the checker and `fusion.verify`, and fusion.Session matches
onnxruntime within 1e-4 of the output's magnitude. A 64x64 input keeps it fast; the published
FLOP counts are checked at 224x224 from the graph's shapes."""

import numpy as np
import onnx
import pytest
from helpers import assert_close, fused_ops, run_ort

import fusion
from fusion.models import fire_modules, squeezenet, squeezenet_flops
from fusion.runtime import Session
from fusion.verify import verify

CATALOG = fusion.default_catalog()
VERSIONS = ["1.0", "1.1"]


@pytest.fixture(scope="module", params=VERSIONS)
def models(request):
    model = squeezenet(request.param, size=64)
    return request.param, model, fusion.rewrite(model, CATALOG)


def test_builder_writes_what_the_exporter_writes():
    model = squeezenet("1.1", size=224)
    onnx.checker.check_model(model, full_check=True)
    names = [n.name for n in model.graph.node]
    assert names[:4] == [
        "/features/features.0/Conv",
        "/features/features.1/Relu",
        "/features/features.2/MaxPool",
        "/features/features.3/squeeze/Conv",
    ]
    assert "/features/features.12/expand3x3_activation/Relu" in names
    tail = ["classifier/classifier.1/Conv", "classifier/classifier.2/Relu"]
    tail += ["classifier/classifier.3/GlobalAveragePool", "Flatten"]
    assert names[-4:] == ["/" + name for name in tail]
    pools = [n for n in model.graph.node if n.op_type == "MaxPool"]
    assert len(pools) == 3 and all(
        a.i == 1 for p in pools for a in p.attribute if a.name == "ceil_mode"
    )
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch_size" and [d.dim_value for d in dims[1:]] == [3, 224, 224]
    assert [m[1:] for m in fire_modules("1.0")][-1] == (512, 64, 256, 256)


@pytest.mark.parametrize("version, gmacs", [("1.0", 0.82), ("1.1", 0.35)])
def test_flops_match_the_published_architecture(version, gmacs):
    flops = squeezenet_flops(version, size=224)
    assert abs(flops["total"] / 2e9 - gmacs) < 0.01
    assert len(flops) == 1 + 1 + 8  # total, features.0 and the eight Fire modules


def test_rewrite_fuses_every_fire_module_and_conv_relu(models):
    _, model, result = models
    kinds = {"FireModule": 8, "ConvBiasRelu": 2, "MaxPool2D": 3, "GlobalAvgPoolFlatten": 1}
    assert result.counts() == kinds, result.explain()
    assert fused_ops(result.model).count("FireModule") == 8
    left = [n.op_type for n in result.model.graph.node if n.domain != "fusion"]
    assert left == []  # no island: the whole model runs in fused kernels
    onnx.checker.check_model(result.model, full_check=True)


def test_session_matches_onnxruntime(models):
    _, model, result = models
    x = np.random.default_rng(3).standard_normal((2, 3, 64, 64)).astype(np.float32)
    (want,) = run_ort(model, {"input": x})
    (got,) = Session(result.model, threads=2, fuse=False, catalog=CATALOG).run(None, {"input": x})
    assert got.shape == want.shape == (2, 1000)
    assert_close(got, want, rtol=0.0, atol=1e-4 * float(np.abs(want).max()))  # logits' scale


def test_verify_passes(models):
    _, model, result = models
    report = verify(model, result.model, catalog=CATALOG, per_node=True)
    assert report.ok, str(report)
    offered = Session(result.model, fuse=False, catalog=CATALOG, tactics="kernel").offered
    assert len(offered) == 14  # every fused node, each with every tactic its kernel offers
    assert len(report.nodes) == sum(map(len, offered.values()))
