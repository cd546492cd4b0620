"""The datasets: everything that differs between Fashion-MNIST and Shakespeare (loader, models, default
flags, scoring, headline metric), the model builder and the loss."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

# examples/datasets.py and examples/models.py: siblings of this package. Run as examples/train.py the
# examples folder is the script's own (the first entry of the import path), so they are top-level modules;
# imported from the repository root (the tests) they are examples.datasets and examples.models.
if __package__ and "." in __package__:
    from .. import datasets
    from ..models import build_model
else:
    import datasets
    from models import build_model


def _score_classification(loss_sum: float, correct: float, count: float) -> Dict[str, float]:
    nan = float("nan")
    return {"test_loss": loss_sum / count if count else nan, "test_examples": int(count),
            "test_accuracy": correct / count if count else nan}


def _score_language_model(loss_sum: float, correct: float, count: float) -> Dict[str, float]:
    nan = float("nan")
    loss = loss_sum / count if count else nan
    return {"test_loss": loss, "test_tokens": int(count),
            "test_perplexity": math.exp(min(loss, 700.0)) if count else nan,
            "test_char_accuracy": correct / count if count else nan}


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: how to load it, which models fit, its default flags and its headline metric."""
    load: Callable[[argparse.Namespace], tuple]  # args -> (train, test, vocab size or None)
    models: Tuple[str, ...]  # the first is the default
    defaults: Dict[str, float]  # values for the flags left unset on the command line
    score: Callable[[float, float, float], Dict[str, float]]  # (loss sum, correct, count) -> test metrics
    metric: str  # key of the headline test metric
    metric_label: str
    metric_format: Callable[[float], str]

    def describe(self, res: dict) -> str:
        """``"test accuracy 85.99%"``: the headline metric of a result row."""
        value = res.get(self.metric)
        return f"{self.metric_label} {'nan' if value is None else self.metric_format(value)}"


DATASETS: Dict[str, DatasetSpec] = {
    "fashion-mnist": DatasetSpec(
        load=lambda args: (*datasets.load_fashion_mnist(args.data_dir), None),
        models=("cnn", "resnet", "vgg"),
        defaults={"batch_size": 64, "lr": 0.1, "clip_grad": 0.0},
        score=_score_classification,
        metric="test_accuracy", metric_label="test accuracy", metric_format=lambda v: f"{100 * v:.2f}%"),
    "shakespeare": DatasetSpec(
        load=lambda args: datasets.load_shakespeare(args.data_dir, seq_len=args.seq_len),
        models=("lstm", "gpt"),
        defaults={"batch_size": 32, "lr": 0.5, "clip_grad": 1.0},
        score=_score_language_model,
        metric="test_perplexity", metric_label="test perplexity", metric_format=lambda v: f"{v:.3f}"),
}


# Flags whose default depends on the model (they win over the dataset's): the transformer trains with AdamW
# (decoupled weight decay 0.1 on the matrices, none on biases and LayerNorms), lr 2e-3 not scaled by the number
# of ranks, gradient clipping at 1.0 and a 128-character context. The SGD models keep the dataset's defaults.
MODEL_DEFAULTS: Dict[str, Dict[str, object]] = {
    "gpt": {"optimizer": "adamw", "lr": 2e-3, "weight_decay": 0.1, "clip_grad": 1.0, "seq_len": 128,
            "warmup_steps": 100},
}
# The defaults every model shares, applied last.
COMMON_DEFAULTS: Dict[str, object] = {"optimizer": "sgd", "weight_decay": 0.0, "seq_len": 64}


def make_model(args: argparse.Namespace, vocab_size: Optional[int]) -> torch.nn.Module:
    """The model ``--model`` names (the LSTM sized by ``--lstm-hidden``/``--lstm-layers`` and the vocabulary,
    the GPT by ``--gpt-dim``/``--gpt-layers``/``--gpt-heads``, its context ``--seq-len``)."""
    if args.model == "gpt":
        return build_model("gpt", vocab_size=vocab_size, dim=args.gpt_dim, heads=args.gpt_heads,
                           layers=args.gpt_layers, context=args.seq_len, tie_weights=args.tie_weights)
    if args.model == "lstm":
        return build_model("lstm", vocab_size=vocab_size, hidden=args.lstm_hidden, layers=args.lstm_layers)
    return build_model(args.model)


def compute_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of classifier logits ``[B, C]`` or language-model logits ``[B, T, V]``."""
    if logits.dim() == 3:  # language model: [B, T, V]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction=reduction)
    return F.cross_entropy(logits, target, reduction=reduction)
