"""The Horovod engine on a Ray cluster through Horovod's own launcher, ``horovod.ray.RayExecutor``.

    python examples/frameworks/horovod_ray.py            # starts a local Ray cluster, 2 Horovod workers

(Ray Train's ``HorovodTrainer`` is gone from Ray; ``RayExecutor`` ships with Horovod 0.28.1 and still runs
on Ray 2.60.) Each worker is a Horovod rank: ``hvd.init()``, ``hat.DistributedOptimizer``, the usual recipe.
"""
import argparse
import hashlib
import json

import ray
import torch


def train(ratio: float, steps: int, accumulate: int) -> dict:
    import horovod.torch as hvd

    import horovod_adtopk as hat

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), backward_passes_per_step=accumulate,
                                         compression=hat.Compression.adtopk(ratio=ratio))
    hat.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1 + hvd.rank())  # this rank's data
    for _ in range(steps):
        for _ in range(accumulate):  # backward_passes_per_step: the exchange runs on the last pass
            x = torch.randn(4, 32, generator=g)
            (torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1)) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = optimizer.stats()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"rank": hvd.rank(), "params": digest, **{k: stats[k] for k in ("steps", "bytes_sent", "bytes_dense")}}


if __name__ == "__main__":
    from horovod.ray import RayExecutor

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--report", help="write every worker's result to this JSON file")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False)  # a local cluster (or RAY_ADDRESS to join one)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2, cpus_per_worker=1, use_gpu=False)
    executor.start()
    try:
        results = executor.run(train, args=[args.ratio, args.steps, args.accumulate])
    finally:
        executor.shutdown()
        ray.shutdown()
    print(results)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(results, f)
