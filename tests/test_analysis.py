import pytest
import torch
from torch import nn

from hybridpar.core.analysis import analyze, trace
from hybridpar.core.errors import ConfigError
from hybridpar.core.layers import Norm, cost_layers
from hybridpar.core.models import MODELS, build_model, input_shape


def meta(name, **kw):
    with torch.device("meta"):
        return build_model(name, **kw)


def test_alexnet_has_caffe_shapes():
    specs = analyze(meta("alexnet"), (3, 227, 227))
    w = [s for s in specs if s.kind in ("conv", "linear")]
    assert [s.out_shape for s in w] == [
        (96, 55, 55),
        (256, 27, 27),
        (384, 13, 13),
        (384, 13, 13),
        (256, 13, 13),
        (4096,),
        (4096,),
        (1000,),
    ]
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
def test_every_zoo_model_analyses(name):
    specs = analyze(meta(name), input_shape(name))
    assert specs and all(s.d_out > 0 for s in specs)
    layers = cost_layers(specs)
    assert layers[0].entry == "" and not layers[0].input_grad  # nothing flows back into the input


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


class Block(nn.Module):
    """A residual block whose input is also read after its first layer."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.conv1(x))  # the same ReLU module is called twice
        out = self.conv2(out)
        out += x  # in place
        return self.relu(out)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.block = Block()
        self.head = nn.Sequential(nn.Dropout(), nn.Linear(4 * 8 * 8, 6), nn.ReLU(inplace=True))
        self.fc = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x = self.block(self.stem(x))
        x = torch.flatten(x, 1)
        return self.fc(self.head(x)) * self.scale


def test_segments_follow_the_dataflow():
    """A layout can change only where one activation is alive: at the residual block's entry (not
    at its first conv, whose input the shortcut still reads), at the FC head's first Linear (after
    torch.flatten and dropout), at the last Linear."""
    t = trace(Net(), (1, 8, 8))
    layers = cost_layers(t.specs)
    assert [(x.name, x.segment, x.entry) for x in layers] == [
        ("stem", 0, ""),
        ("block.conv1", 1, "block"),
        ("block.conv2", 1, None),
        ("head.1", 2, "head.1"),
        ("fc", 3, "fc"),
    ]
    assert layers[1].entry_elements == 4 * 8 * 8 and layers[3].entry_elements == 256
    assert t.calls["block.relu"] == 2
    # a parameter used outside any leaf (in forward) is in the segment where it is used
    assert t.param_segments["scale"] == {3} and t.param_segments["block.conv2.weight"] == {1}
    assert [x.input_grad for x in layers] == [False, True, True, True, True]


class TwoOutputs(nn.Module):
    """The first layer's output is returned too: it stays alive to the end, so no later point
    can change the layout and all layers share one segment."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h)), h


def test_a_value_alive_to_the_end_joins_everything_after_it():
    t = trace(TwoOutputs(), (4,))
    assert {s.segment for s in t.specs} == {0}


def test_batch_norm_rides_with_the_layer_of_its_segment():
    layers = cost_layers(analyze(meta("resnet20", input_size=8), (3, 8, 8)))
    stem, first = layers[0], layers[1]
    assert stem.members == ("conv1", "bn1", "relu") and stem.norms == (Norm(16, True),)
    assert first.name == "layer1.0.conv1" and first.entry == "layer1.0"
    assert {x.segment for x in layers if x.name.startswith("layer2.1.")} == {first.segment + 4}


@pytest.mark.parametrize("name", ["digits-cnn", "resnet20", "digits-wide"])
def test_a_small_model_traced_on_the_cpu_gives_what_meta_tensors_give(name, monkeypatch):
    """Small models are traced on zeros on the CPU (analysis.SMALL_STATE), large ones on meta
    tensors: the layers, segments and parameter uses are the same either way."""
    import hybridpar.core.analysis as an

    with torch.device("meta"):
        model = build_model(name)
    shape = input_shape(name)
    assert an._trace_device(torch.float32, shape, 10**5) == "cpu"
    assert an._trace_device(torch.float16, shape, 10**5) == "meta"
    assert an._trace_device(torch.float32, (3, 224, 224), 10**5) == "meta"
    assert an._trace_device(torch.float32, shape, 10**8) == "meta"
    on_cpu = trace(model, shape)
    monkeypatch.setattr(an, "SMALL_STATE", 0)
    on_meta = trace(model, shape)
    assert on_cpu.specs == on_meta.specs and on_cpu.specs
    assert on_cpu.calls == on_meta.calls and on_cpu.param_segments == on_meta.param_segments


def test_planning_a_small_model_does_not_import_torch_dynamo():
    """What the CPU trace saves: torch imports torch._dynamo on the first meta kernel written in
    Python (1.5-2 s on a 2-core machine), in every command that plans."""
    from procs import python_prints

    code = (
        "import sys, torch\n"
        "from hybridpar.core.analysis import trace\n"
        "from hybridpar.core.models import build_model, input_shape\n"
        "with torch.device('meta'):\n"
        "    m = build_model('resnet20')\n"
        "trace(m, input_shape('resnet20'))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert python_prints(code) == ["False"]
