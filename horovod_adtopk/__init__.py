"""horovod_adtopk: all-dimension top-k (ADTopk) gradient compression for Horovod + PyTorch.

    import horovod.torch as hvd
    import horovod_adtopk as hat

    hvd.init()
    opt = hat.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hat.Compression.adtopk(ratio=0.01))

``Compression`` and ``DistributedOptimizer`` need Horovod and are imported on first use, so the pure
tensor modules (``horovod_adtopk.selection``, ``wire``, ``models``, ``datasets``) also work where Horovod is
not installed (e.g. a GPU box used only for kernel benchmarks). ``hat.ddp`` is the PyTorch DDP engine (a
communication hook, :mod:`horovod_adtopk.ddp`), also without Horovod.
"""
__all__ = ["Compression", "DistributedOptimizer", "Outer", "SparseCompressor", "broadcast_parameters", "ddp"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("Compression", "SparseCompressor"):
        from . import compressors
        return getattr(compressors, name)
    if name == "ddp":  # the PyTorch DDP engine (a communication hook); needs no Horovod
        import importlib
        return importlib.import_module(".ddp", __name__)
    if name == "Outer":  # the outer optimizer of local steps (sync_every=H); needs no framework
        from .outer import Outer
        return Outer
    if name == "DistributedOptimizer":
        from .optimizer import DistributedOptimizer
        return DistributedOptimizer
    if name == "broadcast_parameters":
        from .functions import broadcast_parameters
        return broadcast_parameters
    raise AttributeError(f"module 'horovod_adtopk' has no attribute {name!r}")
