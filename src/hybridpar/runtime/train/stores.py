"""Band readers of the files large images live in: an HDF5 file (`.h5`, `.hdf5`) or a Zarr
group (`.zarr`) of arrays x and y (x_test, y_test optional) as a `.npz` holds them, and
images/ + masks/ folders of TIFF files (tiled, striped or plain) or NIfTI volumes (`.nii`; a
volume's (D, H, W) is the file's (z, y, x)). A rank reads of each example only the chunks,
strips or slices that meet its rows (its tile, its depth slices), plus the headers: each file
or store is opened through a wrapper that counts the bytes it hands the library (`Disk`).

The libraries are the `io` extra (`pip install hybridpar[io]`): h5py, zarr, tifffile, nibabel.
"""

from __future__ import annotations

import importlib
import io
from pathlib import Path

import numpy as np

from hybridpar.core.errors import ConfigError

__all__ = ["ARRAY_SUFFIXES", "VOLUME_SUFFIXES", "Disk", "ImageFile", "arrays", "volume_suffix"]

ARRAY_SUFFIXES = (".h5", ".hdf5", ".zarr")
VOLUME_SUFFIXES = (".tif", ".tiff", ".nii")
_LIBRARY = {".h5": "h5py", ".hdf5": "h5py", ".zarr": "zarr", ".tif": "tifffile",
            ".tiff": "tifffile", ".nii": "nibabel"}  # fmt: skip


def _library(suffix: str):
    name = _LIBRARY[suffix]
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(
            f"reading {suffix} files needs {name}: pip install 'hybridpar[io]'"
        ) from None


class Disk(io.RawIOBase):
    """A file opened for reading that counts the bytes read from it (`read`)."""

    def __init__(self, path: Path, counter: list[int]) -> None:
        self.raw, self.counter = open(path, "rb"), counter  # noqa: SIM115 (closed with self)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        self.counter[0] += n or 0
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def close(self) -> None:
        self.raw.close()
        super().close()


def _zarr_store(path: Path, counter: list[int]):
    """Zarr's local store, counting the bytes of every chunk and metadata document it reads."""
    from zarr.storage import LocalStore

    class Counted(LocalStore):
        async def get(self, key, prototype=None, byte_range=None):
            got = await super().get(key, prototype, byte_range)
            counter[0] += len(got) if got is not None else 0
            return got

    return Counted(path, read_only=True)


def arrays(path: Path, counter: list[int]) -> dict:
    """The arrays x, y (x_test, y_test) of an HDF5 file or a Zarr group, opened, nothing of
    them read (their bytes counted into `counter` as they are)."""
    lib = _library(path.suffix)
    try:
        if path.suffix == ".zarr":
            f = lib.open_group(_zarr_store(path, counter), mode="r")
            names = set(f.array_keys())
        else:
            f = lib.File(Disk(path, counter), "r")
            names = set(f.keys())
    except Exception as exc:  # the library's own words, in one line
        first = (str(exc).splitlines() or [""])[0]
        why = f"{type(exc).__name__}: {first}"
        raise ConfigError(f"data {str(path)!r} cannot be opened ({why})") from None
    if not {"x", "y"} <= names:
        raise ConfigError(f"data {str(path)!r} needs arrays named x and y; it has {sorted(names)}")
    return {k: f[k] for k in ("x", "y", "x_test", "y_test") if k in names}


class ImageFile:
    """One TIFF image or NIfTI volume, opened through a counting file: its shape ((H, W),
    (H, W, C) or (D, H, W)), and `read` of the rows (columns) a band (tile) needs alone."""

    def __init__(self, path: Path, counter: list[int]) -> None:
        self.path, self.counter = path, counter
        lib = _library(path.suffix)
        if path.suffix == ".nii":
            fh = Disk(path, counter)
            holder = lib.FileHolder(fileobj=fh)
            img = lib.Nifti1Image.from_file_map({"header": holder, "image": holder})
            self.data, self.nifti = img.dataobj, True
            x, y, *z = img.shape
            self.shape = (z[0], y, x) if z else (y, x)
        else:
            import zarr

            tif = lib.TiffFile(Disk(path, counter))
            self.data, self.nifti = zarr.open_array(tif.aszarr(), mode="r"), False
            self.shape = tuple(self.data.shape)

    def read(self, spans: list[slice]) -> np.ndarray:
        """The rows (and columns) `spans` of the first spatial dims, as (D or H, ...) array."""
        if self.nifti:  # the file is (x, y, z): z slices (or y rows) are contiguous
            key = [slice(None)] * len(self.shape)
            for d, s in enumerate(spans):
                key[len(self.shape) - 1 - d] = s
            return np.asarray(self.data[tuple(key)]).transpose()
        return np.asarray(self.data[tuple(spans)])


def volume_suffix(files: list[Path]) -> str | None:
    """The suffix of a folder's TIFF or NIfTI files; None for other images. A compressed NIfTI
    (.nii.gz) cannot be read by slices without an index: refused, saying so."""
    if any(f.name.endswith(".nii.gz") for f in files):
        raise ConfigError(
            "a .nii.gz volume cannot be read by slices (gzip has no index): decompress it "
            "(gunzip) to .nii for band reading"
        )
    kinds = {f.suffix.lower() for f in files} & set(VOLUME_SUFFIXES)
    return ".nii" if ".nii" in kinds else ".tif" if kinds else None
