"""Small in-memory datasets, nothing downloaded, and a deterministic batch iterator (:func:`batches`)."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_MNIST_SOURCE = "https://storage.googleapis.com/cvdf-datasets/mnist/"
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_FILES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
_CIFAR_SOURCE = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


@dataclass(frozen=True, eq=False)
class Dataset:
    """Examples ``x`` (first axis the examples) and labels ``y`` (``int32``).

    ``x`` holds ``float32`` images, or ``int32`` tokens for :func:`text` (whose ``y``
    then holds one next token per input token and ``num_classes`` is the vocabulary).

    Equality and hashing are by identity, as comparing arrays has no single answer.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"Dataset {self.name!r} has {len(self.x)} examples but {len(self.y)} labels.")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, e.g. ``(28, 28, 1)``."""
        return tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.x)


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")


def digits() -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, no download).

    >>> ds = digits()
    >>> len(ds), ds.input_shape, ds.num_classes
    (1797, (8, 8, 1), 10)
    """
    table = _digits_table()
    x = (table[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]
    return Dataset(x=x, y=table[:, -1].astype(np.int32), num_classes=10, name="digits")


def _digits_table() -> np.ndarray:
    """The digits as scikit-learn ships them: 1797 rows of 64 pixel values (0 to 16) and the label.

    Read from scikit-learn's own ``datasets/data/digits.csv.gz``, found without importing scikit-learn
    (``sklearn.datasets`` takes about half a second to import; the file, a hundredth). Where that file
    is not, ``sklearn.datasets.load_digits`` gives the same table.
    """
    spec = importlib.util.find_spec("sklearn")
    locations = spec.submodule_search_locations if spec else None
    for location in locations or []:
        bundled = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if bundled.is_file():
            with gzip.open(bundled, "rt") as f:
                return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


def synthetic(
    num_examples: int = 4096,
    input_shape: tuple[int, ...] = (8, 8, 1),
    num_classes: int = 10,
    seed: int = 0,
) -> Dataset:
    """Learnable random data: one random prototype per class plus gaussian noise.

    Classes are balanced (up to one example) and the result depends only on the
    arguments.

    >>> ds = synthetic(num_examples=100, input_shape=(4,), num_classes=5)
    >>> ds.x.shape, ds.x.dtype, sorted(set(ds.y.tolist()))
    ((100, 4), dtype('float32'), [0, 1, 2, 3, 4])
    """
    rng = np.random.default_rng(seed)
    prototypes = rng.uniform(0.0, 1.0, size=(num_classes, *input_shape))
    y = rng.permutation(np.arange(num_examples) % num_classes).astype(np.int32)
    noise = rng.normal(0.0, 0.3, size=(num_examples, *input_shape))
    x = (prototypes[y] + noise).astype(np.float32)
    return Dataset(x=x, y=y, num_classes=num_classes, name="synthetic")


def _find(directory: Path, name: str) -> Path:
    """``directory/name``, else ``directory/name.gz``."""
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Neither {name} nor {name}.gz found in {directory}. Put the MNIST IDX files there (from e.g. {_MNIST_SOURCE})."
    )


def _read_idx(file: Path, ndim: int) -> np.ndarray:
    """Read a ``uint8`` IDX array of ``ndim`` dimensions, gzipped or not."""
    raw = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
    if len(raw) < 4 or raw[:2] != b"\x00\x00":
        raise ValueError(f"{file} is not an IDX file (bad magic number {raw[:4]!r}).")
    if raw[2] != 0x08:
        raise ValueError(f"{file} holds IDX type 0x{raw[2]:02x}; expected 0x08 (uint8).")
    if raw[3] != ndim:
        raise ValueError(f"{file} has {raw[3]} dimension(s); expected {ndim}.")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{file} is truncated inside its header.")
    shape = struct.unpack(f">{ndim}i", raw[4:header])
    if len(raw) - header != int(np.prod(shape)):
        raise ValueError(f"{file} has {len(raw) - header} data bytes; its header {shape} says {np.prod(shape)}.")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def load_mnist(path: str | Path, split: str = "train") -> Dataset:
    """MNIST (or anything in its IDX format) from a local directory.

    Args:
      path: directory with ``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte``
        (``t10k-*`` for ``split="test"``), each possibly gzipped (``.gz``).
      split: ``"train"`` or ``"test"``.

    Returns:
      Images of shape ``(N, rows, cols, 1)`` scaled to ``[0, 1]``, 10 classes.

    Raises:
      FileNotFoundError: a file is missing.
      ValueError: a file is not a well-formed ``uint8`` IDX file, or the counts differ.
    """
    _check_split(split)
    directory = Path(path)
    image_name, label_name = _MNIST_FILES[split]
    images = _read_idx(_find(directory, image_name), ndim=3)
    labels = _read_idx(_find(directory, label_name), ndim=1)
    if len(images) != len(labels):
        raise ValueError(f"MNIST {split} files in {directory} hold {len(images)} images but {len(labels)} labels.")
    x = (images.astype(np.float32) / 255.0)[..., None]
    return Dataset(x=x, y=labels.astype(np.int32), num_classes=10, name="mnist")


def load_cifar10(path: str | Path, split: str = "train") -> Dataset:
    """CIFAR-10's "python version" batches from a local directory.

    The batches are pickles: only load files you trust.

    Args:
      path: the extracted ``cifar-10-batches-py`` directory, or one containing it.
      split: ``"train"`` (``data_batch_1`` to ``_5``) or ``"test"`` (``test_batch``).

    Returns:
      Images of shape ``(N, 32, 32, 3)`` scaled to ``[0, 1]``, 10 classes.

    Raises:
      FileNotFoundError: a batch is missing.
      ValueError: a batch does not hold ``N x 3072`` pixels and ``N`` labels.
    """
    _check_split(split)
    directory = Path(path)
    if (directory / _CIFAR_DIR).is_dir():
        directory = directory / _CIFAR_DIR
    files = [directory / name for name in _CIFAR_FILES[split]]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 batch(es) {', '.join(missing)} not found in {directory}. Extract "
            f"{_CIFAR_SOURCE} and pass the {_CIFAR_DIR} directory."
        )
    xs, ys = [], []
    for file in files:
        with file.open("rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int32)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
            raise ValueError(
                f"{file} holds data of shape {data.shape} and {len(labels)} labels; expected (N, 3072) and N."
            )
        # Rows are channel-major (1024 R, 1024 G, 1024 B), each plane row-major 32x32.
        xs.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(labels)
    x = np.concatenate(xs).astype(np.float32) / 255.0
    return Dataset(x=x, y=np.concatenate(ys), num_classes=10, name="cifar10")


_BYTE_VOCAB = 256  # byte-level tokens: each byte of the text is one token
CORPUS_BYTES = 1 << 20  # the corpus shipped with the kit: 1 MiB of text
_CORPUS = Path(__file__).with_name("corpus.txt.gz")


def corpus(max_bytes: int | None = None) -> bytes:
    """The text the kit ships for its language models: the same bytes on every Python and machine.

    The first MiB (:data:`CORPUS_BYTES`) of the kit's own Python source as of version
    0.1.0 (the package's modules, then its tests, each group sorted by path and
    concatenated), stored in ``parallelkit/corpus.txt.gz``. It is a fixed file: later
    changes to the kit's code leave it as it is, so the numbers the course quotes from
    training on it hold on every Python and JAX the kit supports.

    Args:
      max_bytes: the first this many bytes; None for all of them.

    >>> len(corpus()), len(corpus(1000))
    (1048576, 1000)
    """
    with gzip.open(_CORPUS, "rb") as f:
        return f.read(-1 if max_bytes is None else max_bytes)


def text(path: str | Path | None = None, length: int = 128, *, max_bytes: int | None = None) -> Dataset:
    """Byte-level next-token examples: ``x`` holds ``length`` tokens, ``y`` the same tokens one step on.

    The text (the file at ``path``, or the kit's :func:`corpus` without one) is read as
    bytes, each byte one token, so the vocabulary (``num_classes``) is 256 and any file
    works. Example ``i`` is ``x = tokens[i*length : (i+1)*length]`` with targets
    ``y = tokens[i*length + 1 : (i+1)*length + 1]``: the examples do not overlap (no
    token is a target twice), and the last ``(n - 1) % length`` of the ``n`` tokens are
    left out. Inputs and targets have the same length, so a strategy that
    splits the sequence splits both the same way. :func:`batches` shuffles and batches
    them (``{"x", "y"}``, both ``int32`` of shape ``(batch, length)``).

    Args:
      path: a file of any bytes; None for the kit's :func:`corpus`.
      length: tokens per example (the model's sequence length).
      max_bytes: read at most this many bytes of the text. None: the whole file, or the
        whole corpus (:data:`CORPUS_BYTES`, 1 MiB).

    >>> ds = text(length=64, max_bytes=10_000)
    >>> len(ds), ds.x.shape, ds.y.dtype, ds.num_classes
    (156, (156, 64), dtype('int32'), 256)

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: ``length`` or ``max_bytes`` below 1, or a text shorter than one example
        (``length + 1`` bytes).
    """
    if length < 1:
        raise ValueError(f"length must be at least 1 token, got {length}.")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1 (or None for the default), got {max_bytes}.")
    if path is None:
        raw, name = corpus(max_bytes), "corpus"
    else:
        with Path(path).open("rb") as f:
            raw, name = f.read(-1 if max_bytes is None else max_bytes), Path(path).name
    count = (len(raw) - 1) // length
    if count < 1:
        raise ValueError(
            f"The text {name!r} gives {len(raw)} bytes (max_bytes={max_bytes}), but one example of length {length} "
            f"needs {length + 1} (its inputs and the token after them). Use a shorter length or a longer text."
        )
    tokens = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
    x = tokens[: count * length].reshape(count, length)
    y = tokens[1 : count * length + 1].reshape(count, length)
    return Dataset(x=x, y=y, num_classes=_BYTE_VOCAB, name=name)


def batches(
    dataset: Dataset,
    batch_size: int,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
) -> Iterator[dict[str, np.ndarray]]:
    """Yield ``{"x": ..., "y": ...}`` batches of exactly ``batch_size`` examples.

    Each epoch visits the examples in a fresh order drawn from one generator seeded
    by ``seed``, so equal arguments give equal batches and fewer ``steps`` give a
    prefix. The last ``len(dataset) % batch_size`` examples of each epoch's order are
    dropped, so all batches have one shape (what a compiled step wants).

    Args:
      dataset: the examples.
      batch_size: examples per batch, from 1 to ``len(dataset)``.
      steps: stop after this many batches.
      epochs: stop after this many passes. Give at most one of ``steps`` and
        ``epochs``; with neither, the iterator never ends.
      seed: seeds the shuffling.
      shuffle: if False, every epoch goes in dataset order.

    >>> it = batches(synthetic(num_examples=10), batch_size=4, epochs=1)
    >>> [b["x"].shape for b in it]
    [(4, 8, 8, 1), (4, 8, 8, 1)]
    """
    if steps is not None and epochs is not None:
        raise ValueError(f"Give steps or epochs, not both (got steps={steps}, epochs={epochs}).")
    if not 1 <= batch_size <= len(dataset):
        raise ValueError(f"batch_size must be from 1 to the dataset size {len(dataset)}, got {batch_size}.")
    for name, value in (("steps", steps), ("epochs", epochs)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}.")

    def generate() -> Iterator[dict[str, np.ndarray]]:  # a generator of its own, so that the checks above run now
        rng = np.random.default_rng(seed)
        per_epoch = len(dataset) // batch_size
        step = epoch = 0
        while epochs is None or epoch < epochs:
            order = rng.permutation(len(dataset)) if shuffle else np.arange(len(dataset))
            for i in range(per_epoch):
                if steps is not None and step >= steps:
                    return
                idx = order[i * batch_size : (i + 1) * batch_size]
                yield {"x": dataset.x[idx], "y": dataset.y[idx]}
                step += 1
            epoch += 1

    return generate()


def split(dataset: Dataset, fraction: float = 0.8, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Shuffle with ``seed`` and cut into ``(first, rest)``, ``first`` holding ``fraction``.

    >>> train, test = split(synthetic(num_examples=100), fraction=0.75)
    >>> len(train), len(test)
    (75, 25)
    """
    cut = round(len(dataset) * fraction)
    if not 0 < cut < len(dataset):
        raise ValueError(f"fraction={fraction} of {len(dataset)} examples leaves one side empty.")
    order = np.random.default_rng(seed).permutation(len(dataset))
    parts = (order[:cut], order[cut:])
    return tuple(Dataset(dataset.x[part], dataset.y[part], dataset.num_classes, dataset.name) for part in parts)
