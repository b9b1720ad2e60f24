"""The files large images live in (issue 73, item 2): HDF5, Zarr, TIFF (tiled and striped) and
NIfTI read by band. A band's read returns exactly the source's rows (columns, depth slices); what
it reads from disk, counted by the wrapper the file or store is opened through, is a fraction of
what the whole examples take; the CLI trains a U-Net on bands from an HDF5 file; a compressed
NIfTI and a missing library are one line each."""

import os

import numpy as np
import pytest

from hybridpar.core.errors import ConfigError
from hybridpar.runtime.train.data import load_data, signature

N, H, W = 5, 64, 48


def _arrays(rng):
    x = rng.standard_normal((N, 1, H, W)).astype(np.float32)
    return x, rng.integers(0, 3, (N, H, W))


def _h5(path, x, y):
    import h5py

    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(1, 1, 8, W))
        f.create_dataset("y", data=y, chunks=(1, 8, W))


def _zarr(path, x, y):
    import zarr

    g = zarr.open_group(path, mode="w")
    g.create_array("x", data=x, chunks=(1, 1, 8, W))
    g.create_array("y", data=y, chunks=(1, 8, W))


def _tiff(path, x, y, tiled: bool):
    import tifffile

    for d in ("images", "masks"):
        os.makedirs(path / d)
    for i in range(N):
        layout = {"tile": (16, 16)} if tiled else {"rowsperstrip": 8}
        img = (x[i, 0] * 40 + 128).clip(0, 255).astype(np.uint8)
        tifffile.imwrite(path / "images" / f"{i}.tif", img, **layout)
        tifffile.imwrite(path / "masks" / f"{i}.tif", y[i].astype(np.uint8), **layout)


def _nifti(path, x, y):
    import nibabel as nib

    for d in ("images", "masks"):
        os.makedirs(path / d)
    for i in range(N):  # (D, H, W) = the file's (z, y, x): the arrays transposed
        nib.save(nib.Nifti1Image(x[i, 0].T.copy(), np.eye(4)), path / "images" / f"{i}.nii")
        m = y[i].T.astype(np.int16).copy()
        nib.save(nib.Nifti1Image(m, np.eye(4)), path / "masks" / f"{i}.nii")


@pytest.mark.parametrize("kind", ["h5", "zarr", "tiff tiled", "tiff striped", "nifti"])
def test_a_band_reads_its_rows_and_only_what_meets_them(tmp_path, kind):
    x, y = _arrays(np.random.default_rng(0))
    if kind == "h5":
        spec = tmp_path / "d.h5"
        _h5(spec, x, y)
    elif kind == "zarr":
        spec = tmp_path / "d.zarr"
        _zarr(spec, x, y)
    elif kind.startswith("tiff"):
        spec = tmp_path / "t"
        _tiff(spec, x, y, kind.endswith("tiled"))
        x = ((x * 40 + 128).clip(0, 255).astype(np.uint8) / 255.0).astype(np.float32)
    else:
        spec = tmp_path / "n"
        _nifti(spec, x, y)  # 2-d slices (y, x) = (H, W); a volume's depth reads the same way
    sig = signature(str(spec), (1, H, W), 3)
    assert sig.classes == 3 and sig.target[:2] == (H, W)
    costs = {}
    for band in ((16, 32), None):
        data = load_data(str(spec))  # a fresh open: no library cache from the other read
        opened = data.disk[0]
        order = data.x_train.index[:2]
        got = data.x_train[np.arange(2)].take_rows(slice(None), band).numpy()
        want = x[order] if band is None else x[order][:, :, slice(*band)]
        np.testing.assert_array_equal(got.reshape(want.shape), want)
        labels = data.y_train[np.arange(2)].take_rows(slice(None), band).numpy()
        want_y = y[order] if band is None else y[order][:, slice(*band)]
        np.testing.assert_array_equal(labels.reshape(want_y.shape), want_y)
        costs[band] = data.disk[0] - opened
    assert costs[(16, 32)] < 0.45 * costs[None], costs  # a quarter of the rows, headers aside


def test_what_a_band_reader_cannot_read_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    (tmp_path / "images" / "a.nii.gz").write_bytes(b"")
    (tmp_path / "masks" / "a.nii.gz").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"\.nii\.gz volume cannot be read by slices"):
        signature(str(tmp_path), (1, 8, 8), 3)
    monkeypatch.setitem(__import__("sys").modules, "h5py", None)
    (tmp_path / "d.h5").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"needs h5py: pip install 'hybridpar\[io\]'"):
        signature(str(tmp_path / "d.h5"), (1, 8, 8), 3)


def test_train_reads_bands_of_an_hdf5_file(tmp_path, capsys):
    """`hybridpar train` on an HDF5 file with the domain preset: each rank reads its band."""
    from hybridpar.commands import cli

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 32, 32)).astype(np.float32)
    y = rng.integers(0, 11, (4, 32, 32))
    y[0, 0, 0] = 10
    _h5_path = tmp_path / "d.h5"
    import h5py

    with h5py.File(_h5_path, "w") as f:
        f.create_dataset("x", data=x, chunks=(1, 1, 8, 32))
        f.create_dataset("y", data=y, chunks=(1, 8, 32))
    argv = ["train", "--model", "unet", "--data", str(_h5_path), "--nproc", "2", "--batch", "1"]
    argv += ["--preset", "domain", "--epochs", "1", "--save", str(tmp_path / "w.pt")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    whole = 32 * 32 * 4 / 2**10  # KiB of one image; a rank reads its 16-row band
    assert f"{whole / 2:.1f} KiB an example of its {whole:.1f} KiB" in out, out
