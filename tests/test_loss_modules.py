"""The loss objects people pass (issue 73): torch's loss modules and their functions, with
their weight, ignore_index, label_smoothing, pos_weight, beta, delta and reduction, the losses
of the whole batch's sums (Dice, Dice + cross-entropy), and losses that are not known to split
(a lambda that returns a mean, a Dice module written by hand: run on the joined outputs), 24 in
all, train on bands, tiles, batches and a channel split's replicated outputs exactly as one
process calling the same object on the whole output does (float64, 3 steps, rtol 1e-7, P = 2
and 3), the ledger's bytes per (layer, term) the plan's, the join's included; `train --loss
dice+ce` trains Dice plus the cross-entropy."""

import functools

import pytest
import torch
from dist_helpers import bytes_are_predicted, run_ranks
from torch import nn
from torch.nn import functional as F

from hybridpar.core.analysis import analyze
from hybridpar.core.choices import Choices
from hybridpar.core.cluster import Cluster
from hybridpar.core.layers import cost_layers
from hybridpar.core.plan import Style
from hybridpar.planning.request import PlanRequest
from hybridpar.planning.search import evaluate, export
from hybridpar.runtime.parallel import losses
from hybridpar.runtime.parallel.trainer import HybridTrainer

NET = Cluster("test-net", alpha=1e-6, beta=1e-9, flops=1e12)
SHAPE, CLASSES, STEPS = (3, 6, 5), 3, 3


class HandDice(nn.Module):
    """A soft Dice loss as people write one: softmax, one-hot, a mean over the classes."""

    def forward(self, out, target):
        p = out.softmax(1)
        hot = F.one_hot(target, out.shape[1]).movedim(-1, 1).to(p)
        dims = [0, *range(2, out.dim())]
        inter, total = (p * hot).sum(dims), (p + hot).sum(dims)
        return 1 - ((2 * inter + 1) / (total + 1)).mean()


class Dense(nn.Module):
    def __init__(self, probabilities: bool = False) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, CLASSES, 3, padding=1)
        self.probabilities = probabilities

    def forward(self, x):
        y = self.b(F.relu(self.a(x)))
        return y.sigmoid() if self.probabilities else y


def _cases() -> dict:
    """name -> (loss, whether its targets are one-hot floats, whether the net ends in sigmoid)"""
    w = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    pos = torch.tensor([1.5, 0.5, 3.0], dtype=torch.float64).view(CLASSES, 1, 1)
    return {
        "ce": (nn.CrossEntropyLoss(), False, False),
        "ce weighted smoothed ignoring 0": (
            nn.CrossEntropyLoss(weight=w, ignore_index=0, label_smoothing=0.1), False, False),
        "ce sum": (nn.CrossEntropyLoss(reduction="sum"), False, False),
        "nll weighted": (nn.NLLLoss(weight=w), False, False),
        "bce logits one-hot": (nn.BCEWithLogitsLoss(pos_weight=pos), True, False),
        "bce": (nn.BCELoss(), True, True),
        "mse": (nn.MSELoss(), True, False),
        "l1 sum": (nn.L1Loss(reduction="sum"), True, False),
        "smooth l1": (nn.SmoothL1Loss(beta=0.5), True, False),
        "huber": (nn.HuberLoss(delta=0.5), True, False),
        "partial ce sum": (functools.partial(F.cross_entropy, reduction="sum"), False, False),
        "F.cross_entropy smoothed": (
            functools.partial(F.cross_entropy, weight=w, label_smoothing=0.1), False, False),
        "F.nll_loss ignoring 2": (functools.partial(F.nll_loss, ignore_index=2), False, False),
        "F.bce logits": (
            functools.partial(F.binary_cross_entropy_with_logits, pos_weight=pos), True, False),
        "F.bce": (F.binary_cross_entropy, True, True),
        "F.mse": (F.mse_loss, True, False),
        "F.l1": (F.l1_loss, True, False),
        "F.smooth l1": (functools.partial(F.smooth_l1_loss, beta=0.5), True, False),
        "F.huber": (functools.partial(F.huber_loss, delta=0.5), True, False),
        "dice": (losses.Dice(), False, False),
        "lambda mean ce (joined)": (lambda o, y: F.cross_entropy(o, y), False, False),
        "hand dice (joined)": (HandDice(), False, False),
        "lambda mse (joined)": (lambda o, y: ((o - y) ** 2).mean(), True, False),
        "dice+ce ignoring 0": (losses.DiceCE(ignore_index=0), False, False),
    }  # fmt: skip


def _data(b: int, hot: bool):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randn(b, *SHAPE, generator=g, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (b, *SHAPE[1:]), generator=g)
        out.append((x, F.one_hot(y, CLASSES).movedim(-1, 1).double() if hot else y))
    return out


def _model(probabilities: bool) -> nn.Module:
    torch.manual_seed(0)
    return Dense(probabilities).double()


def _train(P: int) -> list[str]:
    done = []
    layers = cost_layers(analyze(Dense(), SHAPE))
    tiles = Style.domain(P, 1, 2 if P == 2 else 3)  # 1 x 2, 1 x 3 tiles
    for style, b in [
        (Style.domain(P, 1), 2),
        (tiles, 1),
        (Style.batch(P), P),
        (Style.model(P, 1), 2),
    ]:
        plans = {}
        for joined in (False, True):  # a plan that prices the outputs' join, for a loss of it
            c = Choices(joined_loss=joined)
            r = PlanRequest(P, b, NET, choices=c, elem_bytes=8)
            made = evaluate(layers, [style] * len(layers), r)
            plans[joined] = export(made, procs=P, batch=b, choices=c, input_shape=SHAPE, model="d")
        for name, (loss, hot, probs) in _cases().items():
            plan = plans["joined" in name]
            if style.kind == "model" and "dice" in name and "joined" not in name:
                continue  # a loss of the batch's sums needs every rank to hold other outputs
            ref = _model(probs)
            opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            for x, y in _data(b, hot):
                opt.zero_grad()
                loss(ref(x), y).backward()
                opt.step()
            sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
            t = HybridTrainer(_model(probs), plan, sgd, loss, input_shape=SHAPE, verify=False)
            for x, y in _data(b, hot):
                t.step(x, y)
            got = t.full_state_dict()
            for k, v in ref.state_dict().items():
                msg = f"{name} {style}: {k}"
                torch.testing.assert_close(got[k], v, rtol=1e-7, atol=1e-10, msg=msg)
            bytes_are_predicted(t.ledger, plan, f"{name} {style}", STEPS)  # the join's too
            joins = sum(e.bytes for e in t.ledger.entries if e.term == "loss_join")
            assert (joins > 0) == ("joined" in name), (name, joins)
            done.append(f"{name} {style}")
    return done


@pytest.mark.parametrize("P", [2, 3])
def test_torch_loss_modules_train_as_one_process_calling_them(P):
    done = run_ranks(_train, P, P, timeout_s=300)[0]
    assert len(done) == 4 * len(_cases()) - 2, done


def test_what_does_not_split_runs_joined_and_what_returns_no_number_is_refused():
    assert isinstance(losses.as_function(lambda o, y: F.cross_entropy(o, y)), losses.Joined)
    assert isinstance(losses.as_function(HandDice()), losses.Joined)  # by its forward
    with pytest.raises(ValueError, match=r"MSELoss\(reduction='none'\) returns no number"):
        losses.as_function(nn.MSELoss(reduction="none"))
    assert losses.as_function(losses.Dice()).__class__ is losses.Dice


def test_train_loss_dice_ce_from_the_command_line(tmp_path, capsys):
    """One step of the U-Net on the same images from the same initial weights, with --loss
    cross-entropy and --loss dice+ce: the epoch's losses differ by the Dice term, in (0, 1)."""
    import json

    from hybridpar.commands import cli

    got = {}
    for loss in ("cross-entropy", "dice+ce"):
        report = tmp_path / f"{loss}.json"
        argv = ["train", "--model", "unet", "--data", "digits-seg:16:8", "--nproc", "2"]
        argv += ["--batch", "2", "--epochs", "1", "--max-steps", "1", "--loss", loss, "--quiet"]
        argv += ["--save", str(tmp_path / "w.pt"), "--report", str(report)]
        assert cli.main(argv) == 0
        r = json.loads(report.read_text())
        assert r["config"]["loss"] == loss
        got[loss] = r["epochs"][0]["loss"]
    assert 0 < got["dice+ce"] - got["cross-entropy"] < 1, got


def test_dice_per_class_from_summed_counts_is_the_whole_images():
    """Dice per class (2 |P & L| / (|P| + |L|)) from the overlaps of three bands, summed, equals
    the Dice computed directly on the whole images; a class neither predicted nor labelled is
    nan and left out of the mean."""
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 4, 6, 5, generator=g, dtype=torch.float64)
    out[:, 3] = -100  # class 3 is never predicted
    y = torch.randint(0, 3, (2, 6, 5), generator=g)  # nor labelled
    parts = [
        losses.overlaps(out[:, :, a:b], y[:, a:b], 4, F.cross_entropy)
        for a, b in ((0, 2), (2, 4), (4, 6))
    ]  # fmt: skip: three ranks' bands
    got = losses.dice_scores(sum(parts), 4)
    pred = out.argmax(1)
    for c in range(3):
        p, lab = pred == c, y == c
        want = 2 * (p & lab).sum().double() / (p.sum() + lab.sum())
        assert got[c] == pytest.approx(float(want), rel=1e-12)
    assert got[3] != got[3]  # nan
