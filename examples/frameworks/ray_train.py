"""ADTopk inside Ray Train: register the hook on the model ``prepare_model`` returns (CPU or CUDA, 2 workers).

    python examples/frameworks/ray_train.py --storage ray_results           # starts a local Ray cluster
    python examples/frameworks/ray_train.py --storage ray_results --resume ray_results/adtopk/checkpoint_...

``prepare_model`` returns a plain ``DistributedDataParallel``; ``hat.ddp.register`` puts the hook on it. Every
worker gathers the residuals (one set per rank) and rank 0 reports them in its ``ray.train.Checkpoint``.
"""
import argparse
import hashlib
import json
import os
import tempfile
from contextlib import nullcontext

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model
from torch.utils.data import DataLoader, TensorDataset

import horovod_adtopk as hat
from horovod_adtopk.integrations import GatheredState


def toy_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4)


def digests(model: torch.nn.Module, state: "hat.ddp.CompressionState") -> dict:
    """--report: this rank's parameter and residual digests and traffic."""
    mem = state.state_dict()["ranks"][dist.get_rank()]["memory"].get("residuals", {})
    return {"params": hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest(),
            "residuals": hashlib.sha256(b"".join(mem[n].numpy().tobytes() for n in sorted(mem))).hexdigest(),
            **{k: state.stats()[k] for k in ("round", "bytes_sent", "bytes_dense")}}


def train_loop(config: dict) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)))
    state = hat.ddp.register(model, hat.Compression.adtopk(ratio=config["ratio"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first, ckpt = 0, ray.train.get_checkpoint() or (ray.train.Checkpoint(config["resume"]) if config["resume"] else None)
    if ckpt:
        with ckpt.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hat"])  # every rank picks its own residuals
        first = saved["epoch"] + 1
    loader, acc = prepare_data_loader(DataLoader(toy_data(), batch_size=4)), config["accumulate"]
    for epoch in range(first, config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            with model.no_sync() if (i + 1) % acc else nullcontext():  # communicate on the last micro-batch only
                (torch.nn.functional.cross_entropy(model(x), y) / acc).backward()
            if (i + 1) % acc == 0:
                optimizer.step()
                optimizer.zero_grad()
        hat_state = GatheredState(state).state_dict()  # collective: every rank's residuals
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ray.train.get_context().get_world_rank() == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "hat": hat_state,
                            "epoch": epoch}, os.path.join(tmp, "state.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({"epoch": epoch, "round": state.round}, checkpoint=checkpoint)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digests(model.module, state))
    if dist.get_rank() == 0 and config["report"]:
        with open(config["report"], "w") as f:
            json.dump(every, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--storage", default=os.path.abspath("ray_results"), help="where Ray keeps checkpoints")
    parser.add_argument("--resume", help="a checkpoint directory to resume from")
    parser.add_argument("--report", help="write the ranks' digests and traffic to this JSON file")
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False)  # a local cluster (or RAY_ADDRESS to join one)
    trainer = TorchTrainer(
        train_loop, train_loop_config={k: getattr(args, k) for k in ("epochs", "accumulate", "ratio", "resume", "report")},
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=torch.cuda.is_available()),
        run_config=ray.train.RunConfig(name="adtopk", storage_path=os.path.abspath(args.storage)))
    result = trainer.fit()
    print(f"{result.metrics['round']} rounds; last checkpoint {result.checkpoint.path}")
    ray.shutdown()
