"""Datasets and distributed sampling.

| spec                 | what                                                                      |
| -------------------- | ------------------------------------------------------------------------- |
| digits               | scikit-learn's bundled 8x8 digits (1797 real images), fixed 80/20 split    |
| synthetic[:N]        | N random examples of the model's input shape (throughput runs)            |
| digits-seg:S[:N]     | N S x S canvases of the digits (real images, scaled up), a class per      |
|                      | pixel: 0 background, 1 + the digit where it is drawn (dense prediction)  |
| path/to/file.npz     | arrays x and y (and optionally x_test, y_test; else a fixed 80/20 split);  |
|                      | y (N,) a class per example or (N, H, W) a class per pixel of x (N, C, H, W)|
| file.h5, data.zarr   | the same arrays in an HDF5 file or a Zarr group, read by band (stores.py)  |
| path/to/folder/      | an image folder: one sub-folder per class; images/ and masks/ (a mask per |
|                      | image, the same file name: a class per pixel, decoded as steps use them; |
|                      | TIFF images and NIfTI volumes read by band: stores.py);                   |
|                      | or a folder of x.npy and y.npy                                            |
|                      | (and optionally x_test.npy, y_test.npy): memory-mapped, a rank reads the  |
|                      | examples and, of an image split by height, the rows it holds             |

Sampling: every epoch is one global permutation (seeded by seed + epoch, identical on every rank),
cut into steps of B examples (the last step may be smaller, so every example is used exactly once
per epoch whatever P and the grid); a step's B examples split over the P ranks in rank order, the
first B % P ranks taking one more, so batch group c holds a contiguous block.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from hybridpar.core.errors import ConfigError
from hybridpar.runtime.train.stores import (
    ARRAY_SUFFIXES,
    VOLUME_SUFFIXES,
    ImageFile,
    arrays,
    volume_suffix,
)

__all__ = [
    "Dataset",
    "Signature",
    "epoch_steps",
    "load_data",
    "signature",
    "validate_data_spec",
]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm"}


class Mapped:
    """Examples of a memory-mapped array that nothing has read yet: `[index]` picks examples
    (still unread), `take_rows(rows, band)` reads those of a slice of them and, with `band`
    (lo, hi), only those rows of the first spatial dimension (the height; a volume's depth) as a
    tensor. `read` counts the bytes read."""

    def __init__(self, array, index: np.ndarray, dtype, counter: list[int], device=None) -> None:
        self.array, self.index, self.dtype, self.counter = array, index, dtype, counter
        self.device = torch.device(device or "cpu")

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.index), *self.array.shape[1:])

    def __getitem__(self, i) -> Mapped:
        i = i.cpu().numpy() if isinstance(i, torch.Tensor) else i
        return Mapped(self.array, self.index[i], self.dtype, self.counter, self.device)

    def take_rows(self, rows: slice, band: tuple | None = None, dims: int = 2):
        index = np.sort(self.index[rows])  # ascending: the pages in order
        order = np.argsort(np.argsort(self.index[rows]))
        if band is None:
            part = self.array[index]
        else:  # the examples' rows lo..hi - 1 of the first of `dims` spatial dimensions (a
            # tile's ((lo, hi), (first, last + 1)): its rows and columns)
            spans = [slice(*b) for b in (band if isinstance(band[0], tuple) else (band,))]
            part = self.array[(index, *[slice(None)] * (self.array.ndim - 1 - dims), *spans)]
        self.counter[0] += part.nbytes
        self.counter[1] += len(index)  # examples, and what they hold whole
        self.counter[2] += len(index) * math.prod(self.array.shape[1:]) * part.itemsize
        t = torch.as_tensor(np.ascontiguousarray(part[order]), dtype=self.dtype)
        return t.to(self.device)

    def to(self, device) -> Mapped:
        """The same examples, read onto `device` as they are used."""
        return Mapped(self.array, self.index, self.dtype, self.counter, device)


@dataclass
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    name: str
    disk: list[int] | None = None
    """bytes this process read from the files of an HDF5, Zarr, TIFF or NIfTI data set"""

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def to(self, device: torch.device | str) -> Dataset:
        """The examples on `device` (the data sets here are small: one copy, not one per batch;
        memory-mapped ones are read as they are used)."""
        move = {k: getattr(self, k).to(device) for k in ("x_train", "y_train", "x_test", "y_test")}
        return Dataset(**move, num_classes=self.num_classes, name=self.name, disk=self.disk)

    @property
    def bytes_read(self) -> int:
        """Bytes this process read of memory-mapped examples (0: none are)."""
        return self.reads[0]

    @property
    def reads(self) -> tuple[int, int, int]:
        """Of memory-mapped examples, this process's bytes read, examples read and those
        examples' bytes whole (zeros: none are memory-mapped)."""
        x = self.x_train
        return tuple(x.counter) if isinstance(x, Mapped) else (0, 0, 0)


def _split(x: np.ndarray, y: np.ndarray, seed: int = 0) -> tuple[np.ndarray, ...]:
    train, test = _order(len(x), seed)
    return x[train], y[train], x[test], y[test]


def _dataset(name: str, xtr, ytr, xte, yte) -> Dataset:
    y_all = np.concatenate([ytr, yte])
    return Dataset(
        torch.as_tensor(np.ascontiguousarray(xtr), dtype=torch.float32),
        torch.as_tensor(ytr, dtype=torch.long),
        torch.as_tensor(np.ascontiguousarray(xte), dtype=torch.float32),
        torch.as_tensor(yte, dtype=torch.long),
        int(y_all.max()) + 1,
        name,
    )


def validate_data_spec(spec: str) -> None:
    """Cheap checks before any process is spawned: the file or folder exists and looks right."""
    if spec.split(":")[0] == "digits-seg":
        _canvas(spec)
        return
    if spec == "digits" or spec.split(":")[0] == "synthetic":
        if spec.startswith("synthetic:") and not spec.split(":", 1)[1].isdigit():
            raise ConfigError(f"data {spec!r}: write synthetic:N with N a number of examples")
        return
    p = Path(spec)
    if p.suffix in ARRAY_SUFFIXES:
        if not p.exists():
            raise ConfigError(f"data {spec!r} does not exist")
        arrays(p, [0])
        return
    if p.suffix == ".npz":
        if not p.is_file():
            raise ConfigError(f"data file {spec!r} does not exist")
        try:
            with np.load(p) as f:
                keys = set(f.files)
        except Exception as exc:
            raise ConfigError(
                f"data file {spec!r} is not a readable .npz ({type(exc).__name__})"
            ) from exc
        if not {"x", "y"} <= keys:
            raise ConfigError(
                f"data file {spec!r} needs arrays named x and y; it has {sorted(keys)}"
            )
        return
    if p.is_dir() and (p / "x.npy").exists():
        _mapped_signature(spec)
        return
    if p.is_dir() and (p / "images").is_dir() and (p / "masks").is_dir():
        _pairs(spec)
        return
    if p.is_dir():
        classes = [d for d in p.iterdir() if d.is_dir()]
        if len(classes) < 2:
            raise ConfigError(f"image folder {spec!r} needs one sub-folder per class (at least 2)")
        for d in sorted(classes):  # names only: the images are read by the ranks
            if not any(f.suffix.lower() in IMAGE_SUFFIXES for f in d.iterdir()):
                kinds = ", ".join(sorted(IMAGE_SUFFIXES))
                raise ConfigError(
                    f"image folder {spec!r}: class folder {d.name!r} holds no image ({kinds}); "
                    "add images or remove it"
                )
        return
    raise ConfigError(
        f"unknown data {spec!r}; use digits, digits-seg:SIZE, synthetic[:N], a .npz file or an "
        "image folder"
    )


def _canvas(spec: str) -> tuple[int, int]:
    """(side, images) of digits-seg:S[:N] (N: 96 by default)."""
    parts = spec.split(":")[1:]
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts) or int(parts[0]) < 16:
        raise ConfigError(
            f"data {spec!r}: write digits-seg:SIZE or digits-seg:SIZE:IMAGES with SIZE >= 16 "
            "pixels, e.g. digits-seg:128"
        )
    n = int(parts[1]) if len(parts) == 2 else 96
    if n < 2:
        raise ConfigError(f"data {spec!r}: at least 2 images (a training and a test one)")
    return int(parts[0]), n


def digits_seg(spec: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """N canvases of S x S pixels, each with (S // 12k)^2 // 2 digits of scikit-learn's set
    drawn at random places (may overlap: the later one wins), scaled up k = S // 128 + 1 times
    (nearest); a pixel's class is 0 (background) or 1 + the digit drawn there (its value above
    4 of 16)."""
    side, n = _canvas(spec)
    images, labels = _digits()
    g = np.random.default_rng(seed)
    scale = side // 128 + 1
    box = 8 * scale
    x = np.zeros((n, 1, side, side), np.float32)
    y = np.zeros((n, side, side), np.int64)
    for i in range(n):
        for j in g.choice(len(images), max(1, (side // (12 * scale)) ** 2 // 2)):
            digit = np.kron(images[j, 0] * 16.0, np.ones((scale, scale), np.float32))
            r, c = g.integers(0, side - box + 1, 2)
            window = (slice(r, r + box), slice(c, c + box))
            drawn = digit > 4.0
            x[i, 0][window] = np.where(drawn, digit / 16.0, x[i, 0][window])
            y[i][window] = np.where(drawn, labels[j] + 1, y[i][window])
    return x, y


class Signature(NamedTuple):
    """What a data set says of the model that trains on it, read before any process starts."""

    shape: tuple[int, ...]
    """one example's input"""
    classes: int
    target: tuple[int, ...]
    """one example's target: () a class per example, (H, W) or (D, H, W) a class per pixel"""


def signature(spec: str, model_shape: tuple[int, ...], model_classes: int) -> Signature:
    """(per-example input shape, number of classes, per-example target shape) of a data set,
    without loading images: what the model is built for. Synthetic data takes the model's own
    shape and classes."""
    validate_data_spec(spec)
    if spec == "digits":
        return Signature((1, 8, 8), 10, ())
    if spec.split(":")[0] == "digits-seg":
        side = _canvas(spec)[0]
        return Signature((1, side, side), 11, (side, side))
    if spec.split(":")[0] == "synthetic":
        return Signature(tuple(model_shape), model_classes, ())
    p = Path(spec)
    if p.suffix in ARRAY_SUFFIXES:
        return _check_arrays(spec, arrays(p, [0]), read_x=False)
    if p.suffix == ".npz":
        with np.load(p) as f:
            return _check_arrays(spec, f)
    if (p / "x.npy").exists():
        return _mapped_signature(spec)
    if (p / "images").is_dir() and (p / "masks").is_dir():
        return _pairs_signature(spec)
    classes = [d for d in p.iterdir() if d.is_dir()]
    shape = (3, *model_shape[1:]) if len(model_shape) == 3 else tuple(model_shape)
    return Signature(shape, len(classes), ())


class Files:
    """Image files as a read-only array, (N, C, H, W) images or (N, H, W) masks (`mode` None: a
    class per pixel, the file's own values): indexing with (examples, [channels,] rows[,
    columns]) decodes the files it names and keeps those rows (and a tile's columns)."""

    def __init__(self, files: list[Path], shape: tuple[int, ...], mode: str | None) -> None:
        self.files, self.shape, self.mode = files, (len(files), *shape), mode
        self.ndim = len(self.shape)

    def __getitem__(self, key) -> np.ndarray:
        from PIL import Image

        index, *rest = key if isinstance(key, tuple) else (key,)
        spans = tuple(rest if self.mode is None else rest[1:])  # past the images' channels
        out = []
        for i in np.atleast_1d(index):
            with Image.open(self.files[i]) as img:
                a = np.asarray(img.convert(self.mode) if self.mode else img)[spans]
            if self.mode is None:
                out.append(a.astype(np.int64))
            else:
                a = (a / 255.0).astype(np.float32)
                out.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
        return np.stack(out)


class Volumes:
    """TIFF images or NIfTI volumes as a read-only array, (N, C, ...) images or (N, ...) masks:
    indexing with (examples, ..., rows[, columns]) reads those rows (columns) of each file
    alone (stores.ImageFile), its bytes from disk counted into `disk`."""

    def __init__(self, files: list[Path], shape: tuple, mask: bool, disk: list[int]) -> None:
        self.files, self.shape, self.mask, self.disk = files, (len(files), *shape), mask, disk
        self.ndim = len(self.shape)

    def __getitem__(self, key) -> np.ndarray:
        index, *rest = key if isinstance(key, tuple) else (key,)
        spans = [s for s in rest[0 if self.mask else 1 :] if s != slice(None)]
        out = []
        for i in np.atleast_1d(index):
            a = ImageFile(self.files[i], self.disk).read(spans)
            if self.mask:
                out.append(a.astype(np.int64))
                continue
            a = a / 255.0 if a.dtype == np.uint8 else a
            lead = a.ndim == self.ndim - 1  # (H, W, C): channels last
            out.append((np.moveaxis(a, -1, 0) if lead else a[None]).astype(np.float32))
        return np.stack(out)


def image_shape(f: Path) -> tuple[int, ...]:
    """(C, *size) of an image or volume file, from its header: an RGB(A) TIFF's channels, one of
    a grey image or a volume."""
    if f.suffix.lower() in VOLUME_SUFFIXES:
        shape = ImageFile(f, [0]).shape
        rgb = f.suffix != ".nii" and len(shape) == 3 and shape[-1] in (3, 4)
        return (shape[-1], *shape[:2]) if rgb else (1, *shape)
    from PIL import Image

    with Image.open(f) as img:
        w, h = img.size
        return (1 if img.mode in ("L", "I", "F", "1") else 3, h, w)


def _volumes_signature(spec: str, images: list[Path], masks: list[Path]) -> Signature:
    """Of TIFF or NIfTI pairs, from the headers: every image and mask of the first's size; the
    classes from the masks, 64 rows at a time."""
    channels, *dims = image_shape(images[0])
    size, classes = tuple(dims), 0
    for img, mask in zip(images, masks, strict=True):
        a, b = ImageFile(img, [0]), ImageFile(mask, [0])
        if a.shape[: len(size)] != size or b.shape != size:
            raise ConfigError(
                f"image folder {spec!r}: {img.name} and its mask are {a.shape} and {b.shape}; "
                f"every image and mask must be {size} (the first's)"
            )
        for lo in range(0, size[0], 64):
            classes = max(classes, int(b.read([slice(lo, lo + 64)]).max()) + 1)
    return Signature((channels, *size), classes, size)


def _pairs(spec: str) -> tuple[list[Path], list[Path]]:
    """The images and their masks of an images/ + masks/ folder, matched by file name."""
    root = Path(spec)

    def listed(d: str) -> dict[str, Path]:
        files = sorted((root / d).iterdir())
        volume_suffix(files)  # a .nii.gz: refused, saying why
        kinds = (*IMAGE_SUFFIXES, *VOLUME_SUFFIXES)
        return {f.stem: f for f in files if f.suffix.lower() in kinds}

    images, masks = listed("images"), listed("masks")
    missing = sorted(set(images) - set(masks))
    if missing:
        raise ConfigError(
            f"image folder {spec!r}: image {images[missing[0]].name} has no mask in masks/ "
            f"({len(missing)} images have none); give each image a mask of the same name"
        )
    if len(images) < 2:
        raise ConfigError(f"image folder {spec!r}: images/ holds fewer than 2 images")
    return [images[k] for k in sorted(images)], [masks[k] for k in sorted(images)]


def _pairs_signature(spec: str) -> Signature:
    """Checks before any process starts (the sizes from the files' headers, the classes from
    the masks one at a time): (input shape, classes)."""
    from PIL import Image

    images, masks = _pairs(spec)
    if volume_suffix(images):
        return _volumes_signature(spec, images, masks)
    channels, h, w = image_shape(images[0])
    classes = 0
    for img, mask in zip(images, masks, strict=True):
        with Image.open(img) as a, Image.open(mask) as b:
            if a.size != (w, h) or b.size != (w, h):
                raise ConfigError(
                    f"image folder {spec!r}: {img.name} and its mask are {a.size} and {b.size}; "
                    f"every image and mask must be {w} x {h} (the first's)"
                )
            classes = max(classes, int(np.asarray(b).max()) + 1)
    return Signature((channels, h, w), classes, (h, w))


def _pairs_dataset(spec: str, seed: int) -> Dataset:
    """images/ and masks/, decoded as steps use them (a fixed 80/20 split)."""
    shape, classes, target = _pairs_signature(spec)
    images, masks = _pairs(spec)
    if volume_suffix(images):
        disk = [0]
        x, y = Volumes(images, shape, False, disk), Volumes(masks, target, True, disk)
        train, test = _order(len(images), seed)
        return _unread(((x, train, y), (x, test, y)), classes, Path(spec).name, disk)
    c, h, w = shape
    x = Files(images, (c, h, w), "L" if c == 1 else "RGB")
    y = Files(masks, (h, w), None)
    train, test = _order(len(images), seed)
    return _unread(((x, train, y), (x, test, y)), classes, Path(spec).name)


def _order(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed 80/20 split of n examples: (training, test) positions."""
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, n // 5)
    return order[n_test:], order[:n_test]


def _unread(parts, classes: int, name: str, disk: list[int] | None = None) -> Dataset:
    """A data set of examples read as steps use them: ((x, positions, y) of the training and of
    the test examples); the images' bytes read counted together."""
    (xa, tr, ya), (xb, te, yb), counter = *parts, [0, 0, 0]
    return Dataset(
        Mapped(xa, tr, torch.float32, counter),
        Mapped(ya, tr, torch.long, [0, 0, 0]),
        Mapped(xb, te, torch.float32, counter),
        Mapped(yb, te, torch.long, [0, 0, 0]),
        classes,
        name,
        disk,
    )


def _mapped(folder: Path) -> dict[str, np.ndarray]:
    """The folder's arrays, memory-mapped (headers read, no data)."""
    out = {}
    for k in ("x", "y", "x_test", "y_test"):
        if (folder / f"{k}.npy").exists():
            out[k] = np.load(folder / f"{k}.npy", mmap_mode="r")
    return out


def _mapped_signature(spec: str) -> Signature:
    """The checks a folder of .npy arrays must pass before any process starts: shapes from the
    headers, the labels streamed in chunks; (input shape, classes)."""
    try:
        arrays = _mapped(Path(spec))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data folder {spec!r}: an array cannot be mapped ({exc})") from exc
    if "y" not in arrays:
        raise ConfigError(f"data folder {spec!r} has x.npy but no y.npy: add the labels")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ConfigError(f"data folder {spec!r}: give both x_test.npy and y_test.npy, or neither")
    return _check_arrays(spec, arrays, read_x=False)


def _check_arrays(spec: str, f, read_x: bool = True) -> Signature:
    """The checks a .npz must pass before any process starts; (input shape, classes). Without
    `read_x` the examples are not read (memory-mapped: whole images no rank needs)."""
    files = list(f.files) if hasattr(f, "files") else list(f)
    pairs = [("x", "y")] + ([("x_test", "y_test")] if "x_test" in files else [])
    if ("x_test" in files) != ("y_test" in files):
        raise ConfigError(f"data file {spec!r}: give both x_test and y_test, or neither")
    ys, targets = [], []
    for xk, yk in pairs:
        x, y = f[xk], f[yk]
        targets.append(tuple(y.shape[1:]))
        dense = x.ndim in (4, 5) and y.shape[1:] == x.shape[2:]  # a class per pixel (or voxel)
        if x.ndim < 2 or x.shape[0] != y.shape[0] or (y.ndim != 1 and not dense):
            raise ConfigError(
                f"data file {spec!r}: {xk} must be (N, ...) and {yk} (N,) with the same N, or "
                f"{yk} (N, H, W) a class per pixel of {xk} (N, C, H, W) (of a volume (N, C, D, H, "
                f"W): (N, D, H, W)); got {xk} {x.shape} and "
                f"{yk} {y.shape}"
            )
        y = _labels_in_chunks(y) if not read_x else y
        if not np.issubdtype(y.dtype, np.integer):
            raise ConfigError(
                f"data file {spec!r}: {yk} must hold integer class labels, got "
                f"{y.dtype}; convert it with y.astype(int)"
            )
        if y.size and y.min() < 0:
            raise ConfigError(
                f"data file {spec!r}: {yk} has negative labels ({y.min()}); number the classes 0..C-1"
            )
        if not np.issubdtype(x.dtype, np.number) or (read_x and not np.isfinite(x).all()):
            raise ConfigError(
                f"data file {spec!r}: {xk} must be finite numbers (it holds NaN, infinities or non-numbers)"
            )
        ys.append(y)
    present = np.unique(ys[0])
    classes = int(max(int(y.max()) for y in ys if y.size)) + 1
    if len(present) < 2:
        raise ConfigError(
            f"data file {spec!r}: y has {len(present)} class; training needs at least 2"
        )
    missing = classes - len(present)
    if missing:
        raise ConfigError(
            f"data file {spec!r}: labels run to {classes - 1} but {missing} of the {classes} classes "
            "have no training example; number the classes 0..C-1 (e.g. np.unique(y, return_inverse=True))"
        )
    return Signature(tuple(f["x"].shape[1:]), classes, targets[0])


def _labels_in_chunks(y: np.ndarray) -> np.ndarray:
    """A mapped label array's distinct values (what the checks read), 64 examples at a time;
    the same array where it is not an integer one (the check says so)."""
    if not np.issubdtype(y.dtype, np.integer):
        return y
    seen: set[int] = set()
    for i in range(0, y.shape[0], 64):
        seen.update(np.unique(y[i : i + 64]).tolist())
    return np.array(sorted(seen), dtype=y.dtype)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1797 8x8 images, 10 classes), read from the CSV the package ships.

    Importing sklearn.datasets would import joblib, whose loky backend creates named semaphores in
    /dev/shm in every rank; a rank killed by a signal would leave them behind. Reading the file
    directly (what load_digits does) avoids that import."""

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data 'digits' needs scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = (table[:, :64] / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    return x, table[:, 64].astype(np.int64)


def load_data(
    spec: str, input_shape: tuple[int, ...] | None = None, num_classes: int = 10, seed: int = 0
) -> Dataset:
    validate_data_spec(spec)
    if spec == "digits":
        x, y = _digits()
        return _dataset("digits", *_split(x, y))
    if spec.split(":")[0] == "digits-seg":
        return _dataset(spec, *_split(*digits_seg(spec, seed)))
    if spec.split(":")[0] == "synthetic":
        n = int(spec.split(":")[1]) if ":" in spec else 512
        shape = input_shape or (1, 8, 8)
        g = np.random.default_rng(seed)
        y = g.integers(0, num_classes, n)
        x = (
            g.standard_normal((n, *shape)).astype(np.float32)
            + y.reshape(-1, *[1] * len(shape)) * 0.1
        )
        return _dataset(f"synthetic:{n}", *_split(x, y))
    p = Path(spec)
    if p.suffix == ".npz":
        with np.load(p) as f:
            x, y = f["x"].astype(np.float32), f["y"].astype(np.int64)
            if len(x) != len(y):
                raise ConfigError(f"data file {spec!r}: x has {len(x)} rows but y has {len(y)}")
            if "x_test" in f.files and "y_test" in f.files:
                return _dataset(
                    p.name, x, y, f["x_test"].astype(np.float32), f["y_test"].astype(np.int64)
                )
        return _dataset(p.name, *_split(x, y))
    if (p / "x.npy").exists() or p.suffix in ARRAY_SUFFIXES:
        disk = [0]  # bytes the stores read from disk (of .npy arrays, mapped: not counted)
        found = arrays(p, disk) if p.suffix in ARRAY_SUFFIXES else _mapped(p)
        return _mapped_dataset(found, p.name, seed, disk)
    if (p / "images").is_dir() and (p / "masks").is_dir():
        return _pairs_dataset(spec, seed)
    return _image_folder(p, input_shape)


def _mapped_dataset(found: dict, name: str, seed: int, disk: list[int]) -> Dataset:
    """Arrays read as steps use them: a folder of .npy arrays memory-mapped, or an HDF5 file's
    or a Zarr group's (their bytes from disk counted into `disk`)."""
    x, y = found["x"], found["y"]
    if "x_test" in found:
        xt, yt = found["x_test"], found["y_test"]
        parts = (x, np.arange(x.shape[0]), y), (xt, np.arange(xt.shape[0]), yt)
    else:
        train, test = _order(x.shape[0], seed)
        parts = (x, train, y), (x, test, y)
    classes = int(max(int(_labels_in_chunks(a).max()) for a in (y, parts[1][2]))) + 1
    return _unread(parts, classes, name, disk)


def _image_folder(root: Path, input_shape: tuple[int, ...] | None) -> Dataset:
    from PIL import Image

    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    c, h, w = input_shape if input_shape and len(input_shape) == 3 else (3, 32, 32)
    xs, ys = [], []
    for label, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                img = Image.open(f).convert("L" if c == 1 else "RGB").resize((w, h))
            except OSError as exc:
                raise ConfigError(f"image {str(f)!r} cannot be read: {exc}") from exc
            a = np.asarray(img, dtype=np.float32) / 255.0
            xs.append(a[None] if c == 1 else a.transpose(2, 0, 1))
            ys.append(label)
    if len(xs) < 2:
        raise ConfigError(f"image folder {str(root)!r} has fewer than 2 images")
    return _dataset(root.name, *_split(np.stack(xs), np.array(ys, dtype=np.int64)))


def epoch_steps(n: int, batch: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """The global index batches of one epoch (identical on every rank)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n, generator=g)
    return [order[i : i + batch] for i in range(0, n, batch)]
