"""The second engine: horovod_adtopk's compressors as a PyTorch DDP communication hook (beside PowerSGD).

Two lines turn a plain ``DistributedDataParallel`` script into ADTopk::

    import horovod_adtopk as hat
    model = torch.nn.parallel.DistributedDataParallel(model)
    hat.ddp.register(model, hat.Compression.adtopk(ratio=0.01))      # or, PowerSGD-style:
    # state = hat.ddp.CompressionState(process_group=None, compression=hat.Compression.adtopk(ratio=0.01))
    # model.register_comm_hook(state, hat.ddp.hook)

Per bucket (:mod:`.bucket`): every gradient dense or sparse by the Horovod optimizer's rules, sparse ones
through error feedback and the same selection kernels, all of the bucket's payloads in one ``uint8`` buffer
and one asynchronous allgather, the dense ones in one allreduce; the future's result is the averaged bucket.
All state lives in :class:`CompressionState` (:mod:`.state`); the only module that calls
``torch.distributed`` is :mod:`.communicator`. Imports without Horovod.

Works with Gloo and NCCL, CPU and CUDA tensors, ``no_sync()`` (a round is a communicated iteration),
``find_unused_parameters`` (an unused parameter contributes nothing and keeps its memory),
``static_graph`` and ``gradient_as_bucket_view``. Always averages (DDP's semantics). Not supported: our
PowerSGD (use PyTorch's ``powerSGD_hook``), sparse gradients (``nn.Embedding(sparse=True)``).

Local steps with a sparse outer exchange (DiLoCo / SparseLoCo style): :func:`local_steps` (:mod:`.local`).

The end of a script: :func:`shutdown` (barrier, destroy the group, let Gloo's worker threads finish: a rank
that exits while one still drops a collective aborts, see :mod:`.teardown`); importing this package also
registers :func:`wait_for_gloo_workers` to run at exit.
"""
import torch
import torch.distributed as dist

from .communicator import PeerLostError, ProcessGroupComm
from .state import CompressionState

from .local import local_steps
from .teardown import shutdown, wait_at_exit, wait_for_gloo_workers

__all__ = ["CompressionState", "PeerLostError", "ProcessGroupComm", "hook", "local_steps", "register", "shutdown",
           "wait_for_gloo_workers"]

# At exit, Gloo's worker threads finish before the interpreter finalizes (else a rank may abort after a complete
# run). Registered at import: atexit runs handlers last-registered first, so this one runs after the teardown
# handlers a script or framework registers later (which may run collectives).
wait_at_exit()


def hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # (no ``from __future__ import annotations`` here: DDP compares the return annotation itself)
    """The DDP communication hook: ``model.register_comm_hook(state, hat.ddp.hook)``.

    Returns a future whose result is ``bucket.buffer()`` holding the averaged (decompressed) gradients.
    """
    from .bucket import BucketExchange, _done

    comm = state.comm()
    if comm.size() == 1 and not state.exchange_when_alone:  # nothing to communicate (as Horovod with one process)
        if bucket.is_last():
            state.end_round()
        return _done(bucket.buffer())
    for p in bucket.parameters():
        state.tensor_info(p)
    state.check_config()
    fut = BucketExchange(state, comm, bucket).launch()
    if bucket.is_last():
        state.end_round()
    return fut


def register(model: torch.nn.Module, compression=None, process_group=None, warmup_steps: int = 0,
             exchange: str = "allgather") -> CompressionState:
    """Build a :class:`CompressionState` named after ``model``'s parameters and register :func:`hook` on the
    ``DistributedDataParallel`` ``model``; returns the state (for ``state_dict()`` and ``stats()``).
    ``exchange``: ``"allgather"``, ``"sharded"`` or ``"auto"`` (:class:`CompressionState`)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() takes the DistributedDataParallel model, got {type(model).__name__}; wrap it "
                        "first: model = torch.nn.parallel.DistributedDataParallel(model)")
    state = CompressionState(process_group=process_group, compression=compression, warmup_steps=warmup_steps,
                             named_parameters=model.module.named_parameters(), exchange=exchange)
    model.register_comm_hook(state, hook)
    # Adam-family optimizer + per-step sparse compression with error feedback: one warning on rank 0, at the first
    # step of the optimizer that holds the model's parameters (this engine never sees the optimizer itself)
    from .. import advice
    group = process_group if process_group is not None else dist.group.WORLD
    advice.advise_at_first_step(model.parameters(), compression, world_size=dist.get_world_size(group),
                                rank=dist.get_rank())
    return state
