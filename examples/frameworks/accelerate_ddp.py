"""ADTopk inside Hugging Face Accelerate: one call after ``accelerator.prepare`` (CPU or CUDA, 2 processes).

    accelerate launch --multi_gpu --num_processes 2 examples/frameworks/accelerate_ddp.py
    accelerate launch --multi_gpu --num_processes 2 examples/frameworks/accelerate_ddp.py --ckpt-dir ckpt --epochs 1
    accelerate launch --multi_gpu --num_processes 2 examples/frameworks/accelerate_ddp.py --ckpt-dir ckpt --resume

(``cpu=`` below makes the same command run both processes on the CPU, over Gloo, where there is no GPU.) Not
``DistributedDataParallelKwargs(comm_hook=...)``: it takes only Accelerate's own hooks. ``register`` puts
horovod_adtopk's hook on the prepared model and every rank's residuals into ``accelerator.save_state``.
"""
import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

import horovod_adtopk as hat
from horovod_adtopk.integrations.accelerate import register
from _report import report, toy_data  # noqa: E402 (beside this script)




parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--ratio", type=float, default=0.01)
parser.add_argument("--ckpt-dir", help="accelerator.save_state here after each epoch (epoch_<i>)")
parser.add_argument("--resume", action="store_true", help="load the last epoch's state from --ckpt-dir first")
parser.add_argument("--report", help="write the ranks' digests and traffic to this JSON file")
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, cpu=not torch.cuda.is_available())
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(toy_data(), batch_size=4))
state = register(accelerator, model, hat.Compression.adtopk(ratio=args.ratio))  # before load_state

first = 0
if args.resume:
    first = max(int(p.rsplit("_", 1)[1]) for p in __import__("os").listdir(args.ckpt_dir)) + 1
    accelerator.load_state(f"{args.ckpt_dir}/epoch_{first - 1}")
for epoch in range(first, args.epochs):
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    if args.ckpt_dir:
        accelerator.save_state(f"{args.ckpt_dir}/epoch_{epoch}")
stats = state.stats()
accelerator.print(f"{stats['round']} rounds, {stats['bytes_sent']} bytes sent of {stats['bytes_dense']} dense "
                  f"({stats['bytes_sent'] / stats['bytes_dense']:.1%})")
if args.report:
    report(args.report, accelerator.unwrap_model(model), state)
accelerator.end_training()  # destroys the process group
hat.ddp.wait_for_gloo_workers()  # Gloo's threads finish before the interpreter does (else a rank may abort)
