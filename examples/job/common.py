"""What every module of the job shares: its logger, the agreed failure, the launchers' variables and the model's
digest."""
from __future__ import annotations

import hashlib
import logging
from typing import Optional

import torch

LOG = logging.getLogger("horovod_adtopk.train")

# Variables horovodrun sets in every process it starts (its Gloo mode; its MPI mode goes through mpirun).
HOROVODRUN_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_CONTROLLER")
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS")
# Variables that launchers set in each process they start; with more than one process (or under horovodrun,
# which tags even one) the output is prefixed or collected by the launcher, so a redrawn bar would break.
LAUNCHER_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


class JobFailed(Exception):
    """A failure every rank agreed on; rank 0 has logged why. ``main`` turns it into the exit status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def agree(engine, error: Optional[str], what: str, status: int = 2) -> None:
    """Collective: if any rank reports an error, rank 0 logs each distinct one and every rank stops."""
    errors = engine.allgather_object(error, name=f"train.agree.{what}")
    if all(e is None for e in errors):
        return
    if engine.rank == 0:
        seen = []
        for r, e in enumerate(errors):
            if e is not None and e not in seen:
                seen.append(e)
                LOG.error(e + ("" if engine.size == 1 else f" (rank {r})"))
    raise JobFailed(status)


def model_digest(model: torch.nn.Module, buffers: bool = True) -> str:
    """SHA-256 over the model's state dict (``buffers=False``: its parameters only, as batch-norm statistics
    are each rank's own under Horovod): every tensor's name, dtype, shape and raw bytes."""
    h = hashlib.sha256()
    tensors = model.state_dict().items() if buffers else model.named_parameters()
    for name, tensor in tensors:
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
