"""horovod_adtopk: all-dimension top-k (ADTopk) gradient compression for Horovod + PyTorch.

    import horovod.torch as hvd
    import horovod_adtopk as hat

    hvd.init()
    opt = hat.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hat.Compression.adtopk(ratio=0.01))
"""
from .compressors import Compression, SparseCompressor
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "DistributedOptimizer", "SparseCompressor"]
__version__ = "0.1.0"
