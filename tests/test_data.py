"""Tests for parallelkit.data, on tiny files written into tmp_path."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from parallelkit.data import (
    CORPUS_BYTES,
    Dataset,
    batches,
    corpus,
    digits,
    load_cifar10,
    load_mnist,
    split,
    synthetic,
    text,
)

CORPUS_SHA256 = "c915303e6ab5f90e9acf116fa86cda995c05bbf22607607cec4f4340e4c74771"  # corpus.txt.gz unpacked

# --- fixtures -------------------------------------------------------------------------


def _idx_bytes(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    return header + struct.pack(f">{array.ndim}i", *array.shape) + array.astype(np.uint8).tobytes()


def _write(file: Path, payload: bytes, gz: bool) -> None:
    if gz:
        file.with_name(file.name + ".gz").write_bytes(gzip.compress(payload))
    else:
        file.write_bytes(payload)


def _mnist_arrays(n: int = 3, rows: int = 28, cols: int = 28) -> tuple[np.ndarray, np.ndarray]:
    images = np.arange(n * rows * cols, dtype=np.int64).reshape(n, rows, cols) % 256
    return images.astype(np.uint8), np.array([7, 0, 9][:n], dtype=np.uint8)


def _write_mnist(directory: Path, prefix: str = "train", gz: bool = False, n: int = 3) -> tuple:
    images, labels = _mnist_arrays(n)
    _write(directory / f"{prefix}-images-idx3-ubyte", _idx_bytes(images), gz)
    _write(directory / f"{prefix}-labels-idx1-ubyte", _idx_bytes(labels), gz)
    return images, labels


def _cifar_batch(first_label: int) -> dict:
    """3 images: image 0 has one pure red pixel at (row 2, col 5), image 1 is all blue."""
    data = np.zeros((3, 3072), dtype=np.uint8)
    data[0, 0 * 1024 + 2 * 32 + 5] = 255  # red plane
    data[1, 2 * 1024 : 3 * 1024] = 51  # blue plane, 51 / 255 = 0.2
    data[2, 1 * 1024 + 31 * 32 + 31] = 102  # green, bottom-right
    return {b"data": data, b"labels": [first_label, 1, 2], b"batch_label": b"x"}


def _write_cifar(directory: Path) -> Path:
    folder = directory / "cifar-10-batches-py"
    folder.mkdir()
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for label, name in enumerate(names):
        (folder / name).write_bytes(pickle.dumps(_cifar_batch(label)))
    return folder


# --- Dataset --------------------------------------------------------------------------


def test_dataset_properties_and_length_check():
    ds = Dataset(np.zeros((4, 2, 3), np.float32), np.zeros(4, np.int32), 3, "t")
    assert len(ds) == 4
    assert ds.input_shape == (2, 3)
    with pytest.raises(ValueError, match="4 examples but 5 labels"):
        Dataset(np.zeros((4, 2), np.float32), np.zeros(5, np.int32), 3, "t")


# --- digits / synthetic ---------------------------------------------------------------


def test_digits():
    ds = digits()
    assert ds.x.shape == (1797, 8, 8, 1) and ds.x.dtype == np.float32
    assert ds.x.min() == 0.0 and ds.x.max() == 1.0
    assert ds.y.dtype == np.int32 and set(ds.y.tolist()) == set(range(10))
    assert (ds.num_classes, ds.name) == (10, "digits")


def test_digits_read_from_the_bundled_file_equal_scikit_learns_loader(monkeypatch):
    """The file read without importing scikit-learn, and the fallback where it is missing, give load_digits' data."""
    from sklearn.datasets import load_digits

    import parallelkit.data as data

    bunch = load_digits()
    for ds in (digits(), _without_bundled_file(monkeypatch, data)):
        np.testing.assert_array_equal(ds.x[..., 0], (bunch.images / 16.0).astype(np.float32))
        np.testing.assert_array_equal(ds.y, bunch.target)


def _without_bundled_file(monkeypatch, data):
    """``digits()`` where ``importlib`` finds no scikit-learn directory: the loader's fallback."""
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    return data.digits()


def test_synthetic_is_deterministic_and_learnable():
    a, b = synthetic(seed=3), synthetic(seed=3)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.x, synthetic(seed=4).x)
    assert a.x.shape == (4096, 8, 8, 1) and a.x.dtype == np.float32 and a.y.dtype == np.int32
    assert np.bincount(a.y).tolist() == [410] * 6 + [409] * 4
    # Nearest class mean classifies (almost) everything: the labels are learnable.
    flat = a.x.reshape(len(a), -1)
    means = np.stack([flat[a.y == c].mean(0) for c in range(10)])
    predicted = np.argmin(((flat[:, None] - means[None]) ** 2).sum(-1), axis=1)
    assert (predicted == a.y).mean() > 0.95


# --- MNIST ----------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_round_trip(tmp_path, gz):
    images, labels = _write_mnist(tmp_path, gz=gz)
    ds = load_mnist(tmp_path)
    assert ds.x.shape == (3, 28, 28, 1) and ds.x.dtype == np.float32
    np.testing.assert_array_equal(np.rint(ds.x[..., 0] * 255).astype(np.uint8), images)
    assert ds.y.tolist() == [7, 0, 9] and ds.y.dtype == np.int32
    assert ds.num_classes == 10


def test_load_mnist_test_split_and_other_shapes(tmp_path):
    images = np.full((2, 5, 4), 255, np.uint8)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(images))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(np.array([1, 2], np.uint8)))
    ds = load_mnist(tmp_path, split="test")
    assert ds.x.shape == (2, 5, 4, 1) and np.all(ds.x == 1.0)
    assert ds.y.tolist() == [1, 2]
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist(tmp_path)  # only the test split is there
    with pytest.raises(ValueError, match="split"):
        load_mnist(tmp_path, split="validation")


def test_load_mnist_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\.gz.*MNIST"):
        load_mnist(tmp_path)
    images, _ = _mnist_arrays()
    (tmp_path / "train-images-idx3-ubyte").write_bytes(_idx_bytes(images))
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        load_mnist(tmp_path)


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [(0, 1, "magic"), (2, 0x0D, "0x0d"), (3, 2, "2 dimension")],
)
def test_load_mnist_bad_header(tmp_path, offset, value, message):
    _write_mnist(tmp_path)
    file = tmp_path / "train-images-idx3-ubyte"
    raw = bytearray(file.read_bytes())
    raw[offset] = value
    file.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=message) as info:
        load_mnist(tmp_path)
    assert "train-images-idx3-ubyte" in str(info.value)


def test_load_mnist_truncated_and_count_mismatch(tmp_path):
    _write_mnist(tmp_path)
    file = tmp_path / "train-images-idx3-ubyte"
    file.write_bytes(file.read_bytes()[:-1])
    with pytest.raises(ValueError, match="data bytes"):
        load_mnist(tmp_path)
    _write_mnist(tmp_path, n=2)  # 2 images; the labels file is replaced by 3 labels below
    labels = np.array([7, 0, 9], np.uint8)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(labels))
    with pytest.raises(ValueError, match="2 images but 3 labels"):
        load_mnist(tmp_path)


# --- CIFAR-10 -------------------------------------------------------------------------


def test_load_cifar10_train_layout(tmp_path):
    folder = _write_cifar(tmp_path)
    ds = load_cifar10(folder)
    assert ds.x.shape == (15, 32, 32, 3) and ds.x.dtype == np.float32
    assert ds.y.dtype == np.int32 and ds.num_classes == 10
    assert ds.y.tolist() == [0, 1, 2, 1, 1, 2, 2, 1, 2, 3, 1, 2, 4, 1, 2]
    red = ds.x[0]
    assert red[2, 5].tolist() == [1.0, 0.0, 0.0]
    assert red.sum() == 1.0  # nothing else lit
    assert np.all(ds.x[1, ..., 2] == np.float32(0.2)) and ds.x[1, ..., :2].sum() == 0
    assert ds.x[2, 31, 31].tolist() == pytest.approx([0.0, 0.4, 0.0])
    np.testing.assert_array_equal(ds.x[3:6], ds.x[0:3])  # batches are concatenated in order


def test_load_cifar10_test_split_and_parent_dir(tmp_path):
    _write_cifar(tmp_path)
    ds = load_cifar10(tmp_path, split="test")  # the parent of cifar-10-batches-py
    assert len(ds) == 3 and ds.y.tolist() == [5, 1, 2]
    assert ds.x[0, 2, 5, 0] == 1.0


def test_load_cifar10_missing_and_bad_batches(tmp_path):
    folder = _write_cifar(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar10(folder)
    assert len(load_cifar10(folder, split="test")) == 3  # test split does not need it
    bad = {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}
    (folder / "test_batch").write_bytes(pickle.dumps(bad))
    with pytest.raises(ValueError, match="test_batch"):
        load_cifar10(folder, split="test")
    with pytest.raises(FileNotFoundError, match="test_batch"):
        load_cifar10(tmp_path / "nowhere", split="test")


# --- batches --------------------------------------------------------------------------


def _tiny(n: int = 10) -> Dataset:
    x = np.arange(n, dtype=np.float32)[:, None]
    return Dataset(x=x, y=np.arange(n, dtype=np.int32), num_classes=n, name="tiny")


def test_batches_shapes_and_pairing():
    out = list(batches(_tiny(), 4, steps=5))
    assert len(out) == 5
    for b in out:
        assert set(b) == {"x", "y"}
        assert b["x"].shape == (4, 1) and b["y"].shape == (4,)
        np.testing.assert_array_equal(b["x"][:, 0], b["y"])  # x and y stay paired


def test_batches_epochs_drop_remainder_and_reshuffle():
    out = list(batches(_tiny(), 4, epochs=3))
    assert len(out) == 6  # 10 // 4 = 2 per epoch; the 2 left over each epoch are dropped
    epochs = [np.concatenate([b["y"] for b in out[i : i + 2]]) for i in (0, 2, 4)]
    for seen in epochs:
        assert len(set(seen.tolist())) == 8  # no repeats inside an epoch
    assert not all(np.array_equal(epochs[0], e) for e in epochs[1:])


def test_batches_deterministic_prefix_and_seed():
    def ys(**kw):
        return [b["y"].tolist() for b in batches(_tiny(), 3, **kw)]

    assert ys(steps=7, seed=1) == ys(steps=7, seed=1)
    assert ys(steps=4, seed=1) == ys(steps=11, seed=1)[:4]
    assert ys(epochs=2, seed=1) == ys(steps=6, seed=1)
    assert ys(steps=7, seed=1) != ys(steps=7, seed=2)


def test_batches_no_shuffle_and_forever():
    assert [b["y"].tolist() for b in batches(_tiny(5), 2, epochs=2, shuffle=False)] == [
        [0, 1],
        [2, 3],
        [0, 1],
        [2, 3],
    ]
    it = batches(_tiny(3), 3)
    first = [next(it)["y"] for _ in range(50)]  # never runs out
    assert all(sorted(y.tolist()) == [0, 1, 2] for y in first)
    assert list(batches(_tiny(), 2, steps=0)) == [] and list(batches(_tiny(), 2, epochs=0)) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "from 1 to the dataset size 10, got 0"),
        ({"batch_size": 11}, "from 1 to the dataset size 10, got 11"),
        ({"batch_size": 2, "steps": 1, "epochs": 1}, "not both"),
        ({"batch_size": 2, "steps": -1}, "steps must be >= 0"),
    ],
)
def test_batches_errors_are_raised_at_call(kwargs, message):
    with pytest.raises(ValueError, match=message):
        batches(_tiny(), **kwargs)  # no next(): arguments are checked eagerly


# --- text -----------------------------------------------------------------------------


def test_the_corpus_is_the_shipped_bytes_on_every_python():
    """The default text is a file shipped with the kit, not read from the running Python: its hash is fixed."""
    assert hashlib.sha256(corpus()).hexdigest() == CORPUS_SHA256
    assert len(corpus()) == CORPUS_BYTES and corpus(1000) == corpus()[:1000]


def test_text_defaults_to_the_corpus_as_byte_tokens():
    first, again = text(length=64), text(length=64)
    np.testing.assert_array_equal(first.x, again.x)
    np.testing.assert_array_equal(first.y, again.y)
    assert first.name == "corpus" and first.num_classes == 256 and first.input_shape == (64,)
    assert first.x.dtype == first.y.dtype == np.int32
    assert len(first) == (CORPUS_BYTES - 1) // 64
    source = np.frombuffer(corpus(), dtype=np.uint8)
    np.testing.assert_array_equal(first.x.ravel(), source[: first.x.size])
    np.testing.assert_array_equal(first.y.ravel(), source[1 : first.x.size + 1])
    assert len(text(length=64, max_bytes=1000)) == 999 // 64


def test_text_file_targets_are_the_next_tokens(tmp_path):
    file = tmp_path / "words.txt"
    file.write_bytes(bytes(range(256)) + "héllo".encode())  # every byte value, and UTF-8 as its bytes
    ds = text(file, length=10)
    tokens = np.frombuffer(file.read_bytes(), dtype=np.uint8)
    assert len(ds) == (len(tokens) - 1) // 10 == 26 and ds.name == "words.txt"
    np.testing.assert_array_equal(ds.x.ravel(), tokens[:260])
    np.testing.assert_array_equal(ds.y.ravel(), tokens[1:261])
    assert text(file, length=10, max_bytes=21).x.tolist() == [list(range(10)), list(range(10, 20))]
    batch = next(batches(ds, 4, steps=1))
    assert batch["x"].shape == batch["y"].shape == (4, 10) and batch["x"].dtype == np.int32
    np.testing.assert_array_equal(batch["x"][:, 1:], batch["y"][:, :-1])


def test_text_errors(tmp_path):
    file = tmp_path / "short.txt"
    file.write_bytes(b"0123456789")
    with pytest.raises(ValueError, match="gives 10 bytes .* length 10 needs 11 .*shorter length"):
        text(file, length=10)
    with pytest.raises(ValueError, match="length must be at least 1"):
        text(file, length=0)
    with pytest.raises(ValueError, match="max_bytes must be at least 1"):
        text(file, length=4, max_bytes=0)
    with pytest.raises(FileNotFoundError):
        text(tmp_path / "missing.txt")


# --- split ----------------------------------------------------------------------------


def test_split_sizes_disjoint_and_deterministic():
    ds = _tiny(50)
    train, test = split(ds, fraction=0.8, seed=5)
    assert (len(train), len(test)) == (40, 10)
    assert set(train.y.tolist()).isdisjoint(test.y.tolist())
    assert sorted(train.y.tolist() + test.y.tolist()) == list(range(50))
    np.testing.assert_array_equal(train.x[:, 0], train.y)
    assert train.y.tolist() == split(ds, fraction=0.8, seed=5)[0].y.tolist()
    assert train.y.tolist() != split(ds, fraction=0.8, seed=6)[0].y.tolist()
    assert (train.num_classes, train.name) == (50, "tiny")


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.01])
def test_split_rejects_empty_side(fraction):
    with pytest.raises(ValueError, match="empty"):
        split(_tiny(10), fraction=fraction)
