#!/usr/bin/env python
"""Data-parallel training with sparse gradient compression (horovod_adtopk).

What the job does: every rank loads the dataset (Fashion-MNIST images or Shakespeare characters), builds the
same model, wraps SGD in ``hat.DistributedOptimizer`` with the chosen ``hat.Compression`` and trains on its
own shard of the training set for ``--epochs`` (or ``--max-steps``). Gradients are averaged across ranks,
sparsely for the tensors the compressor selects. At each epoch end the model is scored on the test set;
rank 0 logs progress, writes the metrics and the checkpoints.

Launch one process per slot with any of::

    horovodrun -np 2 python examples/train.py --dataset fashion-mnist --compressor adtopk --ratio 0.01 --epochs 1
    mpirun -np 2 python examples/train.py ...          # plain MPI launcher (Horovod built with MPI)
    srun python examples/train.py ...                  # Slurm (see examples/slurm_train.sbatch)
    python examples/train.py ...                       # a single process

Conventions follow Horovod's PyTorch examples: a ``DistributedSampler`` per rank (reshuffled per epoch
through ``set_epoch``), the learning rate scaled by the number of ranks with a linear warm-up
(``torch.optim.lr_scheduler.LambdaLR``), the initial state broadcast from rank 0, metrics averaged over ranks,
logging and checkpoints on rank 0.

Horovod starts with ``hvd.init()`` under horovodrun's Gloo mode or alone, and with
``hvd.init(comm=MPI.COMM_WORLD)`` (mpi4py) whenever an MPI launcher is detected without horovodrun's
``HOROVOD_*`` variables: mpirun, srun, and horovodrun's own MPI mode (which launches through mpirun).

Sparse compressors run the recommended configuration by default: a compression warm-up (the first 50
optimizer rounds dense, ``--dense-rounds``; the density falling from 25% to ``--ratio`` over the first 150
rounds, ``--density-warmup``; ``--no-warmup`` for neither) and DGC's momentum correction
(``--no-momentum-correction`` to turn it off): the sparse-path tensors accumulate the momentum in their
error-feedback memory and are stepped by SGD without momentum, while dense-path tensors (biases, small
layers) keep SGD momentum. With plain SGD momentum on top of error feedback, one epoch of Fashion-MNIST with
ADTopk at ratio 0.01 (lr 0.05, constant after warm-up) reached 81% test accuracy, against 86% with momentum
correction. Rank 0 prints the effective settings at start.

Checkpoints (``--checkpoint-dir``) hold everything a run needs to continue *exactly* under ``--resume``:
step, epoch and position inside the epoch (the batches already consumed are skipped), model, optimizer
with every rank's compression state (error-feedback residuals), learning-rate scheduler, every rank's RNG
state and the cumulative counters. A resumed run reproduces the parameters of an uninterrupted one bit for
bit (CPU, fixed seed, same number of ranks). The newest ``--keep-checkpoints`` files are kept (default 2):
a damaged newest checkpoint (truncated, overwritten) is reported by name and ``--resume`` falls back to
the previous one. Temporary files left by a save that was killed are removed at the next save; a save that
fails (disk full) leaves no partial file and stops every rank with the reason.

Output (rank 0, through Python's ``logging``, one flushed line at a time): a live progress bar only for a
single process whose stderr is a terminal (launchers such as horovodrun, mpirun and srun tag or buffer
output, so there is none under them), otherwise a progress line every ``--log-every`` seconds and at each
epoch end (step, epoch, loss, samples/s, ETA, bytes sent vs dense, density); an evaluation line per epoch;
and one final line starting with ``Final test accuracy`` / ``Final test perplexity``. Other ranks log only
warnings and errors, prefixed with their rank. Machine-readable results: one JSON line per evaluation in
``--metrics-out`` (the last one, ``"final": true``, is the run's summary), the summary alone in
``--summary-json``, and a ``FINAL {json}`` line in the log only with ``--print-final-json``.
``--tensorboard DIR`` writes TensorBoard scalars and a per-layer density histogram.

The job's modules live in the package ``examples/job/`` beside this script (options, data, engine, build,
loop, checkpoints, resume, logs, board; see its ``__init__``); this file is the entry point.
"""
from __future__ import annotations

import sys
import time
from typing import List, Optional

# The package examples/job/, found beside this script (the script's folder comes first on the import path).
from job.build import setup
from job.common import JobFailed
from job.loop import train
from job.options import parse_args
from job.resume import resume

__all__ = ["main", "parse_args"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the job; the exit status: 0, or that of the failure every rank agreed on."""
    process_start = time.time()
    args = parse_args(argv)
    job = None
    try:
        job = setup(args, process_start)
        if args.elastic and args.engine == "horovod":
            from job.elastic import train_elastic  # hvd.elastic.run; its own resume, inside the loop
            train_elastic(job)
        else:
            progress = resume(job)
            train(job, progress)
    except JobFailed as failed:
        return failed.status
    finally:
        if job is not None:
            if job.metrics_file is not None:
                job.metrics_file.close()
            if job.tensorboard is not None:
                job.tensorboard.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
