import pytest
import torch
from torch import nn

from hybridpar.analysis import analyze
from hybridpar.cost.layers import cost_layers
from hybridpar.errors import ConfigError
from hybridpar.models import MODELS, build_model, fc_tail_start, input_shape


def meta(name, **kw):
    with torch.device("meta"):
        return build_model(name, **kw)


def test_alexnet_has_caffe_shapes():
    specs = analyze(meta("alexnet"), (3, 227, 227))
    w = [s for s in specs if s.kind in ("conv", "linear")]
    assert [s.out_shape for s in w] == [
        (96, 55, 55), (256, 27, 27), (384, 13, 13), (384, 13, 13), (256, 13, 13), (4096,), (4096,), (1000,),
    ]  # fmt: skip
    pools = [s for s in specs if s.kind == "pool"]
    assert [s.out_shape for s in pools] == [(96, 27, 27), (256, 13, 13), (256, 6, 6)]
    fc6 = w[5]
    assert (fc6.d_in, fc6.d_out, fc6.weights, fc6.biases) == (9216, 4096, 9216 * 4096, 4096)
    conv1 = w[0]
    assert conv1.kernel == (11, 11) and conv1.stride == (4, 4) and conv1.weights == 96 * 3 * 121
    assert conv1.flops == 2 * 96 * 55 * 55 * 3 * 121
    assert {s.kind for s in specs} == {"conv", "linear", "pool", "norm", "activation", "other"}


def test_cost_layers_use_output_before_pooling_and_actual_input():
    layers = cost_layers(analyze(meta("alexnet"), (3, 227, 227)))
    assert len(layers) == 8
    conv2 = layers[1]
    assert conv2.d_in == 96 * 27 * 27  # after pool1
    assert conv2.d_out == 256 * 27 * 27  # before pool2
    assert layers[5].d_in == 9216


def test_alexnet_owt_small_input_keeps_4096_head():
    specs = analyze(meta("alexnet-owt", input_size=64), (3, 64, 64))
    lin = [s for s in specs if s.kind == "linear"]
    assert [s.out_shape[0] for s in lin] == [4096, 4096, 1000]
    assert [s.out_shape[0] for s in specs if s.kind == "conv"] == [64, 192, 384, 384, 256]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_zoo_model_is_sequential_and_analyses(name):
    m = meta(name)
    assert isinstance(m, nn.Sequential)
    specs = analyze(m, input_shape(name))
    assert specs and all(s.d_out > 0 for s in specs)
    if name != "resnet20":
        assert fc_tail_start(m) < len(m)


def test_real_module_is_not_touched():
    m = build_model("digits-cnn")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    specs = analyze(m, (1, 8, 8))
    assert specs[-1].out_shape == (10,)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.device.type == "cpu" for p in m.parameters())


def test_mlp_and_digits_shapes():
    assert (
        sum(s.params for s in analyze(meta("mlp"), (1, 28, 28)))
        == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    )
    assert analyze(meta("resnet20"), (3, 32, 32))[-1].out_shape == (10,)


def test_bad_input_shape_is_one_line_error():
    with pytest.raises(ConfigError, match="cannot run"):
        analyze(meta("alexnet"), (3, 10, 10))
    with pytest.raises(ConfigError):
        analyze(meta("mlp"), (0,))


def test_no_fc_tail():
    with pytest.raises(ConfigError, match="no sequential fully-connected tail"):
        fc_tail_start(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()))
