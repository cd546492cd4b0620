"""The shortest complete data-parallel training script with ADTopk: Horovod's usual recipe plus one line.

    horovodrun -np 2 python examples/minimal.py

Every rank trains the same small network on its own shard of Fashion-MNIST; gradients are averaged across
ranks, each layer's gradient sparsified to 1% of its entries per row (ADTopk) on the way.
"""
import argparse
import gzip
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd
import horovod_adtopk as hat

DATA = "/usr/share/datasets/fashion-mnist"  # the Debian package dataset-fashion-mnist (IDX files)


def fashion_mnist(split: str, data_dir: str) -> TensorDataset:
    """Images scaled to zero mean and unit variance, labels 0-9. IDX: 16 header bytes for the images, 8 for labels."""
    prefix = os.path.join(data_dir, "train" if split == "train" else "t10k")
    if not os.path.exists(prefix + "-labels-idx1-ubyte.gz"):
        raise SystemExit(f"no Fashion-MNIST in {data_dir}: apt-get install dataset-fashion-mnist, or pass --data-dir")
    with gzip.open(prefix + "-images-idx3-ubyte.gz") as f:
        images = torch.frombuffer(bytearray(f.read()[16:]), dtype=torch.uint8).view(-1, 1, 28, 28)
    with gzip.open(prefix + "-labels-idx1-ubyte.gz") as f:
        labels = torch.frombuffer(bytearray(f.read()[8:]), dtype=torch.uint8).long()
    return TensorDataset((images.float() / 255 - 0.286) / 0.353, labels)


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--ratio", type=float, default=0.01, help="fraction of each gradient's entries sent")
parser.add_argument("--data-dir", default=DATA)
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores

train_set, test_set = fashion_mnist("train", args.data_dir), fashion_mnist("test", args.data_dir)
sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=42)
loader = DataLoader(train_set, batch_size=64, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
# Plain SGD, the learning rate scaled by the number of ranks. (Error feedback already carries what was not sent to
# later steps; for SGD momentum with a sparse compressor, see "momentum correction" in the README.)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())
# The drop-in: hvd.DistributedOptimizer(...) -> hat.DistributedOptimizer(..., compression=hat.Compression.adtopk(...))
optimizer = hat.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hat.Compression.adtopk(ratio=args.ratio))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # every rank starts from rank 0's weights
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # a new shuffle per epoch, the same on every rank
    model.train()
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()  # waits for the sparse exchange, then steps SGD with the averaged gradient

    # Every rank scores its share of the test set; the counts are summed over ranks.
    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors[0][hvd.rank()::hvd.size()], test_set.tensors[1][hvd.rank()::hvd.size()]
        counts = torch.tensor([float((model(x).argmax(1) == y).sum()), float(len(y))])
    correct, total = hvd.allreduce(counts, op=hvd.Sum, name="test_counts").tolist()
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}: train loss {loss.item():.4f}, test accuracy {correct / total:.4f}", flush=True)

stats = optimizer.stats()  # this rank's counters: what its link carried, what a dense allreduce would have, density
if hvd.rank() == 0:
    print(f"link carried {stats['wire_bytes_sent'] / 1e6:.2f} MB sent / {stats['wire_bytes_received'] / 1e6:.2f} MB "
          f"received instead of {stats['wire_bytes_dense'] / 1e6:.2f} MB for a dense allreduce at {hvd.size()} ranks "
          f"({stats['wire_compression']:.0f}x less), density {stats['density']:.4f}", flush=True)
