"""Without horovod_adtopk: a rank of a plain Gloo/DDP job that finished can abort at interpreter exit.

    torchrun --standalone --nproc-per-node 2 docs/clean_exit/gloo_exit_abort.py            # may abort
    torchrun --standalone --nproc-per-node 2 docs/clean_exit/gloo_exit_abort.py --workaround

On a loaded machine a rank sometimes ends with "terminate called without an active exception" (SIGABRT,
exit -6) after printing "done": one of ProcessGroupGloo's worker threads (pt_gloo_runloop) is still dropping
the last all_gather when the interpreter starts finalizing; it asks for the GIL to release the tensors, CPython
ends it with pthread_exit, and the unwinding crosses a noexcept destructor (see docs/troubleshooting.md). It
is rare and load-dependent (CPU hogs beside it, a large program whose teardown takes long, as with the
Transformers Trainer), so launch it many times. --workaround runs wait_for_gloo_workers() (a copy of
horovod_adtopk.ddp.teardown's) before the interpreter exits.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def wait_for_gloo_workers(timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Wait until every pt_gloo_runloop thread of this process sleeps and stays asleep while the GIL is free."""
    def sample():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != "pt_gloo_runloop":
                        continue
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/self/task/{tid}/status") as f:
                    switches = sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
            except (OSError, IndexError, ValueError):
                continue
            out[tid] = (state, switches)
        return out

    deadline, before, quiet = time.monotonic() + timeout, sample(), 0
    while before:
        time.sleep(interval)  # the GIL is free: a worker waiting for it runs now
        now = sample()
        quiet = quiet + 1 if now == before and all(s == "S" for s, _ in now.values()) else 0
        if quiet >= 2 or not now:
            return True
        if time.monotonic() > deadline:
            return False
        before = now
    return True


parser = argparse.ArgumentParser()
parser.add_argument("--workaround", action="store_true")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))  # DDP keeps the group alive
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(args.steps):
    opt.zero_grad()
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
gathered = [torch.empty(1) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, torch.ones(1))  # a last collective, as Trainer.train() ends with (store_flos)
print(f"rank {dist.get_rank()} done", flush=True)
dist.barrier()
dist.destroy_process_group()  # does not join the group's threads: DDP's imports keep the group referenced
if args.workaround:
    wait_for_gloo_workers()
