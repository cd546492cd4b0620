"""ADTopk inside the Transformers Trainer: one ``attach`` before ``train()`` (CPU or CUDA, 2 processes).

    torchrun --nproc_per_node 2 examples/frameworks/transformers_trainer.py --out run
    torchrun --nproc_per_node 2 examples/frameworks/transformers_trainer.py --out run --resume run/checkpoint-8

The Trainer has no communication-hook option; ``attach`` registers horovod_adtopk's hook on the model the Trainer
wraps and saves every rank's residuals into each ``checkpoint-<step>`` folder (and loads them on resume).
"""
import argparse

import torch
from transformers import Trainer, TrainingArguments

import horovod_adtopk as hat
from horovod_adtopk.integrations.transformers import attach
from _report import report  # noqa: E402 (beside this script)


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def toy_data(n: int = 64) -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


parser = argparse.ArgumentParser()
parser.add_argument("--out", default="trainer_run", help="the Trainer's output_dir (checkpoints go here)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
parser.add_argument("--ratio", type=float, default=0.01)
parser.add_argument("--resume", help="a checkpoint-<step> folder to resume from")
parser.add_argument("--report", help="write the ranks' digests and traffic to this JSON file")
args = parser.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
model = Classifier()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
training_args = TrainingArguments(
    output_dir=args.out, num_train_epochs=args.epochs, per_device_train_batch_size=4,
    gradient_accumulation_steps=args.accumulate, train_sampling_strategy="sequential", lr_scheduler_type="constant",
    max_grad_norm=0.0, save_strategy="epoch", use_cpu=not torch.cuda.is_available(), report_to="none",
    logging_strategy="no", disable_tqdm=True, ddp_find_unused_parameters=False)
trainer = Trainer(model=model, args=training_args, train_dataset=toy_data(), optimizers=(optimizer, None))
compression = attach(trainer, hat.Compression.adtopk(ratio=args.ratio))
trainer.train(resume_from_checkpoint=args.resume)
stats = compression.state.stats()
if trainer.is_world_process_zero():
    print(f"{stats['round']} rounds, {stats['bytes_sent']} bytes sent of {stats['bytes_dense']} dense "
          f"({stats['bytes_sent'] / stats['bytes_dense']:.1%})")
if args.report:
    report(args.report, model, compression.state)
hat.ddp.shutdown()  # the Trainer leaves the group to interpreter exit: destroy it, let Gloo's threads finish
