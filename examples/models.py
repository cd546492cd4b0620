"""Models for the examples and benchmarks, and a name-based factory.

Trainable models (plain PyTorch, no Horovod):

- :class:`SmallCNN`: two conv layers + two linear layers for 1x28x28 inputs (~225k parameters).
- :class:`ResNetCNN`: a small ResNet (3 stages of basic residual blocks, widths 16/32/64) for 1x28x28.
- :class:`CharLSTM`: embedding -> LSTM -> linear, a character-level language model.
- :class:`MLP`: Linear+ReLU stack; ~25M parameters with its defaults, for communication benchmarks.
- :class:`ResNet18Style`: the ResNet-18 layout (4 stages x 2 basic blocks, 64..512) for 32x32 inputs.
- :class:`GPT`: a GPT-style causal transformer (pre-LayerNorm blocks, fused qkv, GELU MLP, learned positions,
  optional tied embedding/head), a character-level language model.

:func:`build_model` makes any of them by name.

:class:`ResNet50` and :class:`VGG16` are the torchvision layouts (same parameter names and shapes), for the
benchmarks' layer shapes (``benchmarks/common.py`` builds them on the ``meta`` device). They are kept here
instead of ``torchvision.models`` because a torchvision wheel only works with the torch build it was made
for: the PyPI wheel needs the CUDA torch and fails to import with a CPU-only torch. BERT-base's shapes come
from ``transformers`` (``BertModel(BertConfig())``).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SmallCNN",
    "BasicBlock",
    "ResNetCNN",
    "CharLSTM",
    "MLP",
    "ResNet18Style",
    "GPT",
    "MODEL_NAMES",
    "build_model",
    "ResNet50",
    "VGG16",
    "count_parameters",
]


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters in ``model`` (works on the meta device too)."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# Trainable models
# --------------------------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    """conv(1->32, 3x3) - ReLU - maxpool - conv(32->64, 3x3) - ReLU - maxpool - fc(1600->128) - ReLU - fc(128->10).

    For 1x28x28 inputs (28 -> 26 -> 13 -> 11 -> 5); 225,034 parameters with the defaults.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, hidden: int = 128) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.fc1 = nn.Linear(64 * 5 * 5, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity (or 1x1 conv+BN projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def _stage(in_channels: int, out_channels: int, blocks: int, stride: int) -> nn.Sequential:
    layers = [BasicBlock(in_channels, out_channels, stride)]
    layers += [BasicBlock(out_channels, out_channels, 1) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


class ResNetCNN(nn.Module):
    """A small ResNet for 1x28x28: 3x3 stem, 3 stages of basic blocks (strides 1/2/2), global pool, linear.

    With the defaults (widths 16/32/64, 2 blocks per stage) it has 174,970 parameters.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int = 2,
    ) -> None:
        super().__init__()
        if len(widths) < 1 or blocks_per_stage < 1:
            raise ValueError(f"ResNetCNN needs at least one stage and one block per stage, got widths={widths}, "
                             f"blocks_per_stage={blocks_per_stage}")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages = []
        prev = widths[0]
        for i, w in enumerate(widths):
            stages.append(_stage(prev, w, blocks_per_stage, stride=1 if i == 0 else 2))
            prev = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CharLSTM(nn.Module):
    """Character-level language model: embedding -> ``nn.LSTM(batch_first=True)`` -> linear to the vocabulary.

    ``forward(x)`` maps int64 ids ``[B, T]`` to logits ``[B, T, vocab_size]``; :meth:`step` also
    takes and returns the recurrent state, for generation.
    """

    def __init__(self, vocab_size: int, embed: int = 64, hidden: int = 256, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.head = nn.Linear(hidden, vocab_size)

    def step(
        self, x: torch.Tensor, state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Logits ``[B, T, V]`` and the new ``(h, c)`` state, starting from ``state`` (zeros if None)."""
        out, new_state = self.lstm(self.embedding(x), state)
        return self.head(out), new_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step(x)[0]


class MLP(nn.Module):
    """Linear layers of the given ``sizes`` with ReLU between them (none after the last).

    Inputs with more than two dimensions are flattened from dimension 1. The defaults
    (2048, 4096, 4096, 10) give 25,214,986 parameters.
    """

    def __init__(self, sizes: Sequence[int] = (2048, 4096, 4096, 10)) -> None:
        super().__init__()
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"MLP sizes must list at least an input and an output size, all positive; got {sizes}")
        self.sizes = sizes
        layers: List[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU(inplace=True))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.flatten(x, 1) if x.dim() > 2 else x)


class ResNet18Style(nn.Module):
    """ResNet-18 layout for 32x32 inputs: 3x3 stem (no max-pool), 4 stages x 2 basic blocks, widths 64/128/256/512.

    11,173,962 parameters for 10 classes and 3 input channels.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = _stage(64, 64, 2, 1)
        self.layer2 = _stage(64, 128, 2, 2)
        self.layer3 = _stage(128, 256, 2, 2)
        self.layer4 = _stage(256, 512, 2, 2)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGGStyle(nn.Module):
    """A VGG-style stack for 1x28x28 whose parameters sit in wide layers at low resolution (so a CPU trains it
    in minutes): conv 16 @28 -> pool -> conv 32 @14 -> pool -> conv 128 @7 -> pool -> conv 256, conv 256 @3
    -> fc 512 -> fc ``num_classes``; batch norm and ReLU after each convolution, ReLU after fc 512.

    2,113,018 parameters for 10 classes; the largest weights are conv [256, 128, 3, 3] and [256, 256, 3, 3] and
    fc [512, 2304] (many output channels with long fibers: where per-channel selection should matter).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> List[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*block(in_channels, 16), nn.MaxPool2d(2), *block(16, 32), nn.MaxPool2d(2),
                                      *block(32, 128), nn.MaxPool2d(2), *block(128, 256), *block(256, 256))
        self.fc1 = nn.Linear(256 * 3 * 3, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(torch.flatten(self.features(x), 1))))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused ``qkv`` projection ``[3D, D]``, attention through
    ``F.scaled_dot_product_attention(is_causal=True)``, an output projection ``proj`` ``[D, D]``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"the model width ({dim}) must be a multiple of the number of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D/H]
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` with a GELU MLP ``D -> 4D -> D``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-style causal language model for token ids ``[B, T]`` (``T <= context``) -> logits ``[B, T, V]``.

    Token embedding ``tok_emb`` ``[V, D]``, learned positions ``pos_emb`` ``[context, D]``, ``layers`` pre-LayerNorm
    blocks (:class:`TransformerBlock`: ``attn.qkv`` ``[3D, D]``, ``attn.proj`` ``[D, D]``, ``fc`` ``[4D, D]``,
    ``proj`` ``[D, 4D]``), a final LayerNorm and the head ``[V, D]``. With ``tie_weights`` the head is the token
    embedding (one parameter reached twice in the forward pass; its gradient is the sum of both uses, and it is
    listed once in ``named_parameters()``, as ``tok_emb.weight``). Weights start as in GPT-2: normal(0, 0.02),
    the residual projections scaled by ``1/sqrt(2 layers)``, biases zero.

    The defaults (width 128, 4 heads, 5 layers, context 128) give 1,018,752 parameters with the Shakespeare
    text's 84-character vocabulary and the tied head.
    """

    def __init__(self, vocab_size: int, dim: int = 128, heads: int = 4, layers: int = 5, context: int = 128,
                 tie_weights: bool = True) -> None:
        super().__init__()
        if vocab_size < 1 or dim < 1 or heads < 1 or layers < 1 or context < 1:
            raise ValueError(f"GPT sizes must be positive: vocab_size={vocab_size}, dim={dim}, heads={heads}, "
                             f"layers={layers}, context={context}")
        self.vocab_size, self.context = vocab_size, context
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.context}; use --seq-len <= "
                             f"--context")
        h = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


_MODELS: Dict[str, Callable[..., nn.Module]] = {
    "cnn": SmallCNN,
    "resnet": ResNetCNN,
    "lstm": CharLSTM,
    "mlp": MLP,
    "resnet18": ResNet18Style,
    "vgg": VGGStyle,
    "gpt": GPT,
}
MODEL_NAMES: Tuple[str, ...] = tuple(_MODELS)


def build_model(name: str, **kwargs) -> nn.Module:
    """Build a model by name: "cnn" (:class:`SmallCNN`), "resnet" (:class:`ResNetCNN`), "lstm"
    (:class:`CharLSTM`, needs ``vocab_size=``), "mlp" (:class:`MLP`), "resnet18" (:class:`ResNet18Style`), "vgg"
    (:class:`VGGStyle`), "gpt" (:class:`GPT`, needs ``vocab_size=``).

    Keyword arguments go to the model's constructor.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
        TypeError: arguments the model does not accept, or a missing required one.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _MODELS:
        raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    cls = _MODELS[key]
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise TypeError(f"build_model({key!r}) could not build {cls.__name__} with {sorted(kwargs)}: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Real-model layouts (for the benchmarks' layer shapes; usable as ordinary modules too)
# --------------------------------------------------------------------------------------------------


class _Bottleneck(nn.Module):
    """ResNet-50 bottleneck: 1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4, projection shortcut when needed."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample: Optional[nn.Module] = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet50(nn.Module):
    """ImageNet ResNet-50 (blocks 3/4/6/3, bottleneck widths 64..512, 1000 classes): 25,557,032 parameters."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        prev = 64
        for i, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
            stride = 1 if i == 0 else 2
            layer = []
            for b in range(blocks):
                layer.append(_Bottleneck(prev, width, stride if b == 0 else 1))
                prev = width * _Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGG16(nn.Module):
    """VGG-16 (configuration D, no BatchNorm, 1000 classes): 138,357,544 parameters.

    Parameter names follow the usual layout: ``features.<i>`` for the conv layers (ReLU and max-pool
    take indices too) and ``classifier.0/3/6`` for the three linear layers.
    """

    CONFIG: Tuple[object, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")

    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        prev = in_channels
        for item in self.CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                assert isinstance(item, int)
                layers += [nn.Conv2d(prev, item, 3, padding=1), nn.ReLU(inplace=True)]
                prev = item
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(prev * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), (7, 7))
        return self.classifier(torch.flatten(x, 1))
