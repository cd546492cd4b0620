"""What every module of the job shares: its logger, the agreed failure, and the launchers' variables."""
from __future__ import annotations

import logging
from typing import Optional

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
