"""What a loss is divided by: the trainer sums a loss over the outputs each rank holds (examples,
or the bands of a dense prediction's images) and divides by what torch's `reduction="mean"`
divides by on the whole global batch, so the gradient summed over the ranks is the mean's.

| loss (a torch.nn.functional loss, or a functools.partial of one) | divided by                   |
| ----------------------------------------------------------------- | ---------------------------- |
| cross_entropy, nll_loss with class indices                        | the targets not ignored      |
|   ... with `weight`                                               | the summed weights of those  |
| cross_entropy with class probabilities                            | the targets (N x H x W)      |
| mse, l1, smooth L1, Huber, binary cross-entropy                   | the elements                 |
| any of them with reduction="sum" given                            | 1                            |

torch's loss modules (`nn.CrossEntropyLoss(weight=..., ignore_index=..., label_smoothing=...)`,
`nn.BCEWithLogitsLoss(pos_weight=...)`, ...) are the functional loss with their attributes
(`as_function`); any other callable, which may not split (a lambda that returns a mean, a Dice
of another library, a function of the user's even where it takes a reduction), runs on the whole
batch's outputs joined on every rank (`Joined`), its value taken as it is.

Each rank reads the global batch's targets, so the divisor needs no collective.

`Dice` is not a sum over pixels: its per-class sums over the whole batch (every rank's bands and
examples) finish with one all-reduce of 2 x classes numbers forward; backward nothing moves, since
every rank computes the same loss from the same sums and the gradients of the parameters are
summed over the ranks anyway. Any loss may take that path: one with `sums(out, target)` (a
differentiable tensor of sums over the outputs given, which add up over the ranks) and
`value(total)` (the loss of the whole batch's sums) is computed so (`by_sums`); `DiceCE` is Dice
plus the mean cross-entropy (its sum and count two more numbers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "Dice",
    "DiceCE",
    "Joined",
    "as_function",
    "by_sums",
    "compares_values",
    "counted",
    "dice_scores",
    "divisor",
    "divisor_by_shape",
    "mean_iou",
    "named",
    "overlaps",
]

_PER_TARGET = (F.cross_entropy, F.nll_loss)
_PER_ELEMENT = (
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
)


class Dice:
    """The soft Dice loss of a dense prediction, 1 - mean over the classes of (2 I + s) / (S + s)
    with I the summed softmax probability of the class on its labelled pixels and S the summed
    probability plus the labelled pixels, over the whole batch (ignored labels left out)."""

    def __init__(self, smooth: float = 1.0, ignore_index: int = -100) -> None:
        self.smooth, self.ignore_index = smooth, ignore_index

    def sums(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """(2, classes): I and S of these outputs and labels (differentiable)."""
        kept = (target != self.ignore_index).unsqueeze(1).to(out.dtype)
        probs = out.float().softmax(1).to(out.dtype) * kept
        hot = F.one_hot(target.clamp(0, out.shape[1] - 1), out.shape[1]).movedim(-1, 1) * kept
        dims = [0, *range(2, out.dim())]
        both = (probs * hot).sum(dims)
        return torch.stack([both, probs.sum(dims) + hot.sum(dims)])

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        """The loss of the whole batch's sums."""
        return 1 - ((2 * sums[0] + self.smooth) / (sums[1] + self.smooth)).mean()

    def __call__(self, out: torch.Tensor, target: torch.Tensor, reduction: str = "mean"):
        """On one process: the loss of these outputs alone (reduction is ignored: the loss is
        not a sum)."""
        return self.value(self.sums(out, target))


# torch's loss modules -> their functional form and the attributes it takes
_MODULES = {
    nn.CrossEntropyLoss: (F.cross_entropy, ("weight", "ignore_index", "label_smoothing")),
    nn.NLLLoss: (F.nll_loss, ("weight", "ignore_index")),
    nn.BCEWithLogitsLoss: (F.binary_cross_entropy_with_logits, ("weight", "pos_weight")),
    nn.BCELoss: (F.binary_cross_entropy, ("weight",)),
    nn.MSELoss: (F.mse_loss, ()),
    nn.L1Loss: (F.l1_loss, ()),
    nn.SmoothL1Loss: (F.smooth_l1_loss, ("beta",)),
    nn.HuberLoss: (F.huber_loss, ("delta",)),
}


def as_function(loss: Callable) -> Callable:
    """The loss as the trainer calls it, `loss(out, target, reduction="sum")`: a torch loss
    module (its class's own forward) as its functional form with its attributes and its
    reduction ("mean" divided as torch divides it, "sum" by 1); torch's functional losses (and
    partials of them) and losses of the whole batch's sums (Dice) as they are; any other
    callable on the joined outputs (`Joined`). A reduction that returns no number raises
    ValueError."""
    cls = next((c for c in _MODULES if type(loss) is c or (
        isinstance(loss, c) and type(loss).forward is c.forward)), None)  # fmt: skip
    if cls is not None:
        func, names = _MODULES[cls]
        kwargs = {k: getattr(loss, k) for k in names if getattr(loss, k) is not None}
        if loss.reduction not in ("mean", "sum"):
            raise ValueError(f"loss: {type(loss).__name__}(reduction={loss.reduction!r}) returns "
                             "no number to train on; give reduction='mean' or 'sum'")  # fmt: skip
        if loss.reduction == "sum":
            kwargs["reduction"] = "sum"
        return functools.partial(func, **kwargs)
    func, kwargs = _parts(loss)
    if kwargs.get("reduction", "mean") not in ("mean", "sum"):
        raise ValueError(f"loss: reduction={kwargs['reduction']!r} returns no number to train on")
    if by_sums(loss) or isinstance(loss, Joined) or func in (*_PER_TARGET, *_PER_ELEMENT):
        return loss
    return Joined(loss)  # not known to split, even where it takes a reduction: never divided


class Joined:
    """A loss that is not known to split over the outputs' parts (a lambda that returns a mean,
    MONAI's or segmentation-models' Dice, a module of the user's): the trainer calls it on the
    whole global batch's outputs, joined on every rank, against the whole targets; each rank's
    backward takes the gradient of the outputs it holds."""

    def __init__(self, loss: Callable) -> None:
        self.loss = loss

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(out, target)


class DiceCE(Dice):
    """Dice plus the mean cross-entropy over the labelled pixels (MONAI's DiceCELoss with both
    weights 1 and its softmax Dice), from the whole batch's sums: the Dice's per class and, in
    one more column, the cross-entropy's sum and the labelled pixels."""

    def sums(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(out, target, ignore_index=self.ignore_index, reduction="sum")
        kept = (target != self.ignore_index).sum().to(out.dtype)
        return torch.cat([super().sums(out, target), torch.stack([ce, kept]).view(2, 1)], 1)

    def value(self, sums: torch.Tensor) -> torch.Tensor:
        return super().value(sums[:, :-1]) + sums[0, -1] / sums[1, -1]


def named(spec: str, factory: Callable[[], object] | None = None) -> Callable:
    """The loss `--loss` names (cross-entropy, dice, dice+ce), or what the user's `factory`
    returns, as the trainer calls it (`as_function`; its error as a ValueError)."""
    if factory is None:
        ours = {"cross-entropy": F.cross_entropy, "dice": Dice(), "dice+ce": DiceCE()}
        return ours[spec] if spec in ours else getattr(F, spec)
    try:
        made = factory()
    except Exception as exc:  # the user's factory: any error in one line
        raise ValueError(f"calling it failed ({type(exc).__name__}: {exc})") from None
    if not callable(made):
        raise ValueError(f"it returned a {type(made).__name__}, not a loss")
    return as_function(made)


def compares_values(loss: Callable) -> bool:
    """Whether `loss` compares the outputs with targets of their shape (MSE, L1, BCE), not
    class labels."""
    return _parts(loss)[0] in _PER_ELEMENT


def by_sums(loss: Callable) -> bool:
    """Whether `loss` is computed from the whole batch's sums (`sums` and `value`: Dice)."""
    return callable(getattr(loss, "sums", None)) and callable(getattr(loss, "value", None))


def _parts(loss: Callable) -> tuple[Callable, dict]:
    """The function under any functools.partial, and the keywords given to it."""
    kwargs: dict = {}
    while isinstance(loss, functools.partial):
        kwargs = {**loss.keywords, **kwargs}
        loss = loss.func
    return loss, kwargs


def _kept(y: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return y != kwargs.get("ignore_index", -100)


def divisor(loss: Callable, y: torch.Tensor) -> torch.Tensor:
    """What `loss` with reduction="mean" divides its sum by over the targets `y` (a float64
    scalar on y's device)."""
    func, kwargs = _parts(loss)
    if kwargs.get("reduction") == "sum":
        return torch.ones((), dtype=torch.float64, device=y.device)
    if func not in _PER_TARGET or y.is_floating_point():
        n = divisor_by_shape(loss, tuple(y.shape), y.is_floating_point())
        return torch.tensor(n, dtype=torch.float64, device=y.device)
    kept = _kept(y, kwargs)  # class indices: the ignored ones (-100 unless given) left out
    weight = kwargs.get("weight")
    if weight is None:
        return kept.sum().double()
    return weight.to(y.device, torch.float64)[y[kept]].sum()


def divisor_by_shape(loss: Callable, shape: tuple[int, ...], floating: bool) -> int | None:
    """`divisor` from the targets' shape alone, where their values do not change it (no class
    weights, no ignore_index given, and labels that are class ids: no -100); None where they
    do."""
    func, kwargs = _parts(loss)
    if kwargs.get("reduction") == "sum":
        return 1
    elements = 1
    for n in shape:
        elements *= n
    if func in _PER_TARGET:
        if floating:
            return elements // shape[1]
        return None if {"weight", "ignore_index"} & set(kwargs) else elements
    return elements if func in _PER_ELEMENT else shape[0]


def counted(loss: Callable, target: torch.Tensor) -> torch.Tensor:
    """How many targets of `target` the metrics count: the class labels not ignored (a pixel
    each in a dense prediction), else the examples (a float64 scalar on target's device, read
    with the step's other numbers)."""
    func, kwargs = _parts(loss)
    whole = by_sums(loss) or isinstance(loss, Joined)
    if whole and not target.is_floating_point():  # a Dice's labelled pixels
        return (target != getattr(loss, "ignore_index", -100)).sum().double()
    if func in _PER_TARGET and not target.is_floating_point():
        return _kept(target, kwargs).sum().double()
    return torch.tensor(len(target), dtype=torch.float64, device=target.device)


def overlaps(out: torch.Tensor, target: torch.Tensor, classes: int, loss: Callable) -> torch.Tensor:
    """Per class, the pixels (or examples) whose predicted class (argmax over dim 1) and label
    are both it, and either of them, ignored labels left out: (2, classes) float64. Summed over
    the ranks' bands and batches they give the mean IoU of the whole images."""
    _, kwargs = _parts(loss)
    kept = _kept(target, kwargs)
    pred, label = out.argmax(1)[kept], target[kept]
    both = torch.bincount(label[pred == label], minlength=classes)[:classes]
    each = (
        torch.bincount(pred, minlength=classes)[:classes]
        + torch.bincount(label, minlength=classes)[:classes]
    )
    return torch.stack([both, each - both]).double()


def mean_iou(sums: torch.Tensor | list[float], classes: int) -> float:
    """The mean over the classes present (in the predictions or the labels) of intersection
    over union, from `overlaps` summed."""
    t = torch.as_tensor(sums, dtype=torch.float64).view(2, classes)
    present = t[1] > 0
    return float((t[0][present] / t[1][present]).mean()) if present.any() else float("nan")


def dice_scores(sums: torch.Tensor | list[float], classes: int) -> list[float]:
    """Per class, the Dice score 2 I / (predicted + labelled) = 2 I / (I + U) from `overlaps`
    summed (nan for a class neither predicted nor labelled); their mean over the classes
    present is what segmentation papers report beside the mean IoU."""
    t = torch.as_tensor(sums, dtype=torch.float64).view(2, classes)
    return (2 * t[0] / (t[0] + t[1])).tolist()
