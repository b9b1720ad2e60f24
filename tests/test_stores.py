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


@pytest.mark.parametrize("P", [2, 3, 4])
def test_each_rank_reads_its_band_and_the_chunks_that_round_it(tmp_path, P):
    """One 64 x 48 image in each format, read by each of P ranks' bands (halo.bands): the bytes
    from disk are the band's rows rounded out to whole chunks (8 rows; TIFF tiles of 16 x 16,
    strips of 8 rows), and nothing else but, per format: the headers read when a TIFF or NIfTI
    file is opened (counted apart), the one B-tree node of a chunked HDF5 dataset's chunk index
    (the same bytes for every band), and a Zarr chunk as stored (compressed, its file's size)."""
    import h5py
    import nibabel as nib
    import tifffile
    import zarr

    from hybridpar.core.halo import bands
    from hybridpar.runtime.train.stores import ImageFile, arrays

    x = np.random.default_rng(0).standard_normal((1, 1, H, W)).astype(np.float32)
    img = (x[0, 0] * 40 + 128).clip(0, 255).astype(np.uint8)
    with h5py.File(tmp_path / "c.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(1, 1, 8, W))
        f.create_dataset("y", data=np.zeros((1, H, W), int))
    with h5py.File(tmp_path / "p.h5", "w") as f:  # contiguous: no chunks
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=np.zeros((1, H, W), int))
    g = zarr.open_group(tmp_path / "d.zarr", mode="w")
    g.create_array("x", data=x, chunks=(1, 1, 8, W))
    g.create_array("y", data=np.zeros((1, H, W), int), chunks=(1, 8, W))
    tifffile.imwrite(tmp_path / "t.tif", img, tile=(16, 16))
    tifffile.imwrite(tmp_path / "s.tif", img, rowsperstrip=8)
    nib.save(nib.Nifti1Image(x[0, 0].T.copy(), np.eye(4)), tmp_path / "n.nii")

    def rounded(lo, hi, k):  # rows [lo, hi) out to whole chunks of k rows
        return (lo // k) * k, -(-hi // k) * k

    index = set()
    for lo, hi in bands(H, P):
        got = {}
        for name in ("c.h5", "p.h5", "d.zarr"):
            c = [0]
            a = arrays(tmp_path / name, c)["x"]
            opened = c[0]
            a[(np.array([0]), slice(None), slice(lo, hi))]
            got[name] = c[0] - opened
        for name in ("t.tif", "s.tif", "n.nii"):
            c = [0]
            f = ImageFile(tmp_path / name, c)
            opened = c[0]
            np.testing.assert_array_equal(
                f.read([slice(lo, hi)]), (x[0, 0] if name == "n.nii" else img)[lo:hi]
            )
            got[name] = c[0] - opened
        a, b = rounded(lo, hi, 8)
        assert got["p.h5"] == (hi - lo) * W * 4  # contiguous rows: exactly the band
        index.add(got["c.h5"] - (b - a) * W * 4)  # the chunks and their index node
        stored = sum(
            (tmp_path / "d.zarr" / "x" / "c" / "0" / "0" / str(i) / "0").stat().st_size
            for i in range(a // 8, b // 8)
        )
        assert got["d.zarr"] == stored
        t0, t1 = rounded(lo, hi, 16)
        assert got["t.tif"] == (t1 - t0) * W  # tiles of 16 rows (3 across the width)
        assert got["s.tif"] == (b - a) * W  # strips of 8 rows
        assert got["n.nii"] == (hi - lo) * W * 4  # (z, y, x): rows of y are contiguous
    assert len(index) == 1 and 0 < index.pop() < 4096  # the chunk index: one node


def _train(tmp_path, capsys, spec, model, name) -> dict:
    import torch

    from hybridpar.commands import cli

    # priced where bytes cost: the domain preset bands the input (test_dense's volume run)
    net = tmp_path / "bytes.json"
    net.write_text('{"name": "bytes", "alpha": 1e-6, "beta": 1e-8, "flops": 1e12}')
    argv = ["train", "--model", model, "--data", str(spec), "--nproc", "2", "--batch", "2"]
    argv += ["--preset", "domain", "--epochs", "1", "--max-steps", "2", "--quiet"]
    argv += ["--save", str(tmp_path / f"{name}.pt"), "--cluster", str(net)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    return torch.load(tmp_path / f"{name}.pt"), out


def _write_pairs(root, xs, ys, suffix):
    import nibabel as nib
    import tifffile

    for d in ("images", "masks"):
        os.makedirs(root / d)
    for i, (a, m) in enumerate(zip(xs, ys, strict=True)):
        if suffix == ".tif":
            tifffile.imwrite(root / "images" / f"{i}.tif", a, tile=(16, 16))
            tifffile.imwrite(root / "masks" / f"{i}.tif", m.astype(np.uint8), rowsperstrip=8)
        else:  # (D, H, W) or (H, W) as the file's (z, y, x)
            nib.save(nib.Nifti1Image(a.T.copy(), np.eye(4)), root / "images" / f"{i}.nii")
            mask = nib.Nifti1Image(m.T.astype(np.int16).copy(), np.eye(4))
            nib.save(mask, root / "masks" / f"{i}.nii")


def test_training_from_each_format_equals_training_from_npy(tmp_path, capsys):
    """The zoo U-Net on 32 x 32 images split by height over 2 ranks, 2 steps: the weights from
    an HDF5 file, a Zarr group, TIFF and NIfTI pairs equal, bit for bit, those from the same
    images as .npy arrays (TIFF holds bytes: the arrays hold them / 255)."""
    import h5py
    import torch
    import zarr

    g = np.random.default_rng(0)
    img = g.integers(0, 256, (5, 32, 32)).astype(np.uint8)
    x = (img / 255.0).astype(np.float32)[:, None]
    y = g.integers(0, 11, (5, 32, 32))
    y[0, 0, 0] = 10
    specs = {}
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "x.npy", x)
    np.save(tmp_path / "npy" / "y.npy", y)
    specs["npy"] = tmp_path / "npy"
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(1, 1, 8, 32))
        f.create_dataset("y", data=y, chunks=(1, 8, 32))
    specs["h5"] = tmp_path / "d.h5"
    z = zarr.open_group(tmp_path / "d.zarr", mode="w")
    z.create_array("x", data=x, chunks=(1, 1, 8, 32))
    z.create_array("y", data=y, chunks=(1, 8, 32))
    specs["zarr"] = tmp_path / "d.zarr"
    for suffix, data in ((".tif", img), (".nii", x[:, 0])):
        _write_pairs(tmp_path / suffix[1:], data, y, suffix)
        specs[suffix[1:]] = tmp_path / suffix[1:]
    want, _ = _train(tmp_path, capsys, specs.pop("npy"), "unet", "npy")
    for name, spec in specs.items():
        got, _ = _train(tmp_path, capsys, spec, "unet", name)
        for k, v in want.items():
            assert torch.equal(got[k], v), f"{name}: {k}"


def test_a_nifti_volume_trains_by_depth_slices(tmp_path, capsys):
    """The 3-D U-Net on NIfTI volumes split by depth over 2 ranks: each rank reads half of each
    volume's slices (printed), and the weights equal those from the same volumes as .npy."""
    import torch

    g = np.random.default_rng(0)
    x = g.standard_normal((5, 10, 8, 8)).astype(np.float32)
    y = g.integers(0, 3, (5, 10, 8, 8))
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "x.npy", x[:, None])
    np.save(tmp_path / "npy" / "y.npy", y)
    _write_pairs(tmp_path / "nii", x, y, ".nii")
    want, _ = _train(tmp_path, capsys, tmp_path / "npy", "unet3d", "npy")
    got, out = _train(tmp_path, capsys, tmp_path / "nii", "unet3d", "nii")
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    whole = 10 * 8 * 8 * 4 / 2**10  # KiB of one volume; a rank reads 5 of its 10 slices
    assert f"{whole / 2:.1f} KiB an example of its {whole:.1f} KiB" in out, out


def test_png_pairs_read_a_tile_by_its_rows_and_columns(tmp_path):
    """A tile's key is (examples, channels, rows, columns): a PNG pair keeps the tile's rows and
    columns (it once took the columns' slice as the rows)."""
    from PIL import Image

    for d in ("images", "masks"):
        (tmp_path / d).mkdir()
    g = np.random.default_rng(0)
    img = g.integers(0, 256, (3, 16, 12)).astype(np.uint8)
    mask = g.integers(0, 3, (3, 16, 12)).astype(np.uint8)
    for i in range(3):
        Image.fromarray(img[i]).save(tmp_path / "images" / f"{i}.png")
        Image.fromarray(mask[i]).save(tmp_path / "masks" / f"{i}.png")
    data = load_data(str(tmp_path))
    order = data.x_train.index[:2]
    tile = ((8, 16), (0, 6))
    x = data.x_train[np.arange(2)].take_rows(slice(None), tile).numpy()
    y = data.y_train[np.arange(2)].take_rows(slice(None), tile).numpy()
    want = (img[order][:, 8:16, 0:6] / 255.0).astype(np.float32)
    np.testing.assert_array_equal(x[:, 0], want)
    np.testing.assert_array_equal(y, mask[order][:, 8:16, 0:6])
