"""ParallelPlan: styles, JSON round trip, pattern matching, and one-line errors for bad plans."""

import json

import pytest

from hybridpar.core.choices import Choices
from hybridpar.core.errors import ConfigError
from hybridpar.core.plan import (
    FORMAT,
    ParallelPlan,
    Prediction,
    Redistribution,
    Style,
    assign_styles,
)
from hybridpar.core.terms import Term


def test_styles_parse_and_print():
    assert Style.parse("batch", 4) == Style.batch(4) and Style.batch(4).label == "batch"
    # model(1xP) is batch: one style, one spelling, one kind
    assert Style.model(1, 4) == Style.batch(4) == Style.parse("model(1x4)", 4)
    assert Style.model(1, 4).kind == "batch" and Style.model(1, 4).label == "batch"
    assert Style.parse("model(2x2)", 4) == Style.model(2, 2)
    assert str(Style.parse(" domain(4x1) ", 4)) == "domain(4x1)"
    # tiles: H x W tiles of each image, C batch groups; another layout than 4 bands'
    tiles = Style.parse("domain(2x2x2)", 8)
    assert tiles == Style.domain(4, 2, 2) and (tiles.ph, tiles.pw) == (2, 2)
    assert tiles.label == "domain(2x2x2)" and tiles.layout != Style.domain(4, 2).layout
    assert Style.tiles(16, 1) == Style.domain(16, 1, 4) and Style.tiles(8, 1).ph == 4
    assert Style.tiles(7, 1) is None and Style.domain(4, 1, 1) == Style.domain(4, 1)
    for bad, needle in (
        ("model", "needs its grid"),
        ("model(3x2)", "P=4"),
        ("pipe(2x2)", "not one of"),
        ("batch(2x2)", "write batch"),
        ("model(2x2x1)", "only domain takes tiles"),
        ("domain(2x2x2)", "H x W x C = 4"),
    ):
        with pytest.raises(ConfigError, match=needle):
            Style.parse(bad, 4)


def _plan() -> ParallelPlan:
    return ParallelPlan(
        procs=4,
        batch=32,
        styles={"features.*": Style.batch(4), "classifier.1": Style.model(4, 1)},
        model="tv",
        input_shape=(1, 8, 8),
        scenario="per-layer",
        choices=Choices(codec="fp16", compress=("activations",), bn="global"),
        redistributions=[
            Redistribution("classifier.1", "classifier.1", Style.batch(4), Style.model(4, 1), 28)
        ],
        predicted=[Prediction("classifier.1", Term.ALLGATHER, 1000.0, 1e-3)],
        cluster="test",
        totals={"total_s": 0.5},
    )


def test_json_round_trip(tmp_path):
    p = _plan()
    again = ParallelPlan.load(p.save(tmp_path / "p.json"))
    assert again == p
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["format"] == FORMAT and d["styles"] == {
        "features.*": "batch",
        "classifier.1": "model(4x1)",
    }
    assert p.predicted_bytes() == {"allgather": 1000.0}
    assert "classifier.1  model(4x1)" in p.describe()


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"format": "other"}, "not a hybridpar plan"),
        ({"procs": 0}, "positive integer"),
        ({"styles": ["a"]}, "styles must map"),
        ({"styles": {"fc": "model(3x1)"}}, "P=4"),
        ({"codec": "int3"}, "codec must be one of"),
        ({"compress": ["weights"]}, "compress takes"),
        ({"bn": "sync"}, "bn must be one of"),
        ({"engine": "ddp"}, "batch parallelism only"),
        ({"colour": 1}, "unknown key"),
        ({"predicted": [{"layer": "x"}]}, "malformed plan"),
        ({"input_shape": [3, -1]}, "input_shape"),
    ],
)
def test_bad_plans_are_one_line_errors(change, needle):
    d = {**_plan().to_dict(), **change}
    with pytest.raises(ConfigError, match=needle) as err:
        ParallelPlan.from_dict(d, "plan file 'p.json'")
    assert "\n" not in str(err.value)


def test_bad_plan_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ParallelPlan.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ParallelPlan.load(tmp_path / "bad.json")


MODULES = [
    "",
    "features",
    "features.0",
    "features.1",
    "features.3",
    "classifier",
    "classifier.1",
    "classifier.2",
    "classifier.4",
    "classifier.6",
]
LAYERS = ["features.0", "features.3", "classifier.1", "classifier.4", "classifier.6"]


def test_first_matching_entry_wins_and_containers_cover_their_layers():
    styles = {
        "classifier.6": Style.batch(4),
        "classifier": Style.model(2, 2),
        "*": Style.model(4, 1),
    }
    got = assign_styles(styles, MODULES, LAYERS, 4)
    assert {k: v.label for k, v in got.items()} == {
        "features.0": "model(4x1)",
        "features.3": "model(4x1)",
        "classifier.1": "model(2x2)",
        "classifier.4": "model(2x2)",
        "classifier.6": "batch",
    }
    assert assign_styles({}, MODULES, LAYERS, 4)["features.0"] == Style.batch(4)


def test_entries_that_cover_no_layer_are_errors():
    with pytest.raises(ConfigError, match=r"'classifer\.1' names no module"):
        assign_styles({"classifer.1": Style.batch(4)}, MODULES, LAYERS, 4)
    with pytest.raises(ConfigError, match="has no Linear or Conv2d"):
        assign_styles({"classifier.2": Style.model(4, 1)}, MODULES, LAYERS, 4)


def test_choices_have_one_default_and_one_spelling():
    """The plan's choices are hybridpar.core.choices.Choices, the same object the configs nest: one
    default each (global BN), compress normalised from any spelling, JSON as the plan's keys."""
    c = Choices()
    assert (c.codec, c.reducer, c.bn, c.amp, c.device) == (
        "none",
        "process-group",
        "global",
        "none",
        "auto",
    )
    assert Choices(compress="grads, activations").compress == ("activations", "grads")
    assert Choices(compress=["grads"]).compress == ("grads",)
    assert ParallelPlan(2, 4).choices == c
    d = ParallelPlan(2, 4, choices=Choices(codec="linear", compress="grads")).to_dict()
    assert (d["codec"], d["compress"], d["bn"]) == ("linear", ["grads"], "global")
    assert ParallelPlan.from_dict(d).choices == Choices(codec="linear", compress=("grads",))
