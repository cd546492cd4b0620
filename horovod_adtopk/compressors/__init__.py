"""Compressors: a selection rule + wire options + error-feedback options, behind one registry.

One module per family, each registering its classes with :func:`register` from :mod:`.base`:

- :mod:`.base`: codecs (how positions travel), :class:`Selection`, :class:`SparseCompressor`, the registry
  and the :class:`Compression` namespace (``Compression.adtopk(ratio=0.01)``, ``Compression.get(name)``).
- :mod:`.adtopk`: ADTopk, ADTopk-I (interleaved), ADTopk-T (threshold-estimated).
- :mod:`.topk`: exact global Top-k.  :mod:`.randomk`: Random-k.
- :mod:`.threshold`: DGC, Gaussian-k, RedSync, SIDCo, a fixed threshold.
- :mod:`.powersgd`: PowerSGD (low rank, two allreduces).

Adding a compressor: one module here (a :class:`SparseCompressor` subclass with ``name``, ``summary`` and
``_select``, decorated with ``@register``), its import below, its test and its README row.
"""
from .base import (DEFAULT_MIN_NUMEL, VALUE_DTYPES, Compression, FiberCodec, FlatCodec, Selection, SharedCodec,
                   SparseCompressor, TensorInfo, _REGISTRY, is_sparse, register, stable_seed)  # noqa: F401
from .topk import TopkCompressor
from .adtopk import ADTopkCompressor, ADTopkICompressor, ADTopkTCompressor
from .randomk import RandomkCompressor
from .threshold import (DGCCompressor, GaussiankCompressor, RedSyncCompressor, SIDCoCompressor,
                        ThresholdCompressor)
from .powersgd import PowerSGDCompressor

__all__ = ["ADTopkCompressor", "ADTopkICompressor", "ADTopkTCompressor", "Compression", "DEFAULT_MIN_NUMEL",
           "DGCCompressor", "FiberCodec", "FlatCodec", "GaussiankCompressor", "PowerSGDCompressor",
           "RandomkCompressor", "RedSyncCompressor", "SIDCoCompressor", "Selection", "SharedCodec",
           "SparseCompressor", "TensorInfo", "ThresholdCompressor", "TopkCompressor", "VALUE_DTYPES",
           "is_sparse", "register", "stable_seed"]
