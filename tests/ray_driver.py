"""Driver of the Ray Train test: ``python -m tests.ray_driver OUTDIR`` (run under the harness timeout).

One local Ray cluster (``ray.init(num_cpus=4)``, no dashboard), two ``TorchTrainer.fit()`` runs of the
example's own ``train_loop`` (examples/frameworks/ray_train.py): 2 epochs straight (a checkpoint per epoch),
then a new run resumed from the epoch-0 checkpoint. Starting the cluster once keeps the test to one cluster
start (the slow part here). Writes ``straight.json`` and ``resumed.json`` (every rank's digests).
"""
import os
import sys
from pathlib import Path

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

from tests.harness import example_module

ray_train = example_module("frameworks/ray_train")  # registered as "ray_train", pickled by value below
train_loop = ray_train.train_loop


def fit(outdir: Path, name: str, resume) -> "ray.train.Result":
    config = {"epochs": 2, "accumulate": 2, "ratio": 0.01, "resume": resume, "report": str(outdir / f"{name}.json")}
    trainer = TorchTrainer(train_loop, train_loop_config=config,
                           scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=ray.train.RunConfig(name=name, storage_path=str(outdir / "store")))
    return trainer.fit()


def main(outdir: Path) -> None:
    import ray.cloudpickle
    ray.cloudpickle.register_pickle_by_value(ray_train)  # the workers need not find the example on their path
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        fit(outdir, "straight", None)
        first = sorted((outdir / "store" / "straight").glob("checkpoint_*"))[0]
        saved = torch.load(first / "state.pt", weights_only=True)
        (outdir / "saved.txt").write_text(f"{saved['epoch']} {saved['hat']['round']} {sorted(saved['hat']['ranks'])}")
        fit(outdir, "resumed", str(first))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
