"""ADTopk inside PyTorch Lightning: one callback on a DDP Trainer (CPU or CUDA, 2 processes).

    python examples/frameworks/lightning_ddp.py                      # Trainer(devices=2) starts both ranks
    python examples/frameworks/lightning_ddp.py --ckpt-dir ckpts --epochs 1
    python examples/frameworks/lightning_ddp.py --ckpt-dir ckpts --resume ckpts/epoch=0.ckpt

Not ``DDPStrategy(ddp_comm_hook=...)``: Lightning registers that hook only on CUDA, so on CPU it would train
uncompressed without a word. ``DDPCompression`` registers the hook on any device, and its residuals (one set
per rank) travel in Lightning's own checkpoints.
"""
import argparse

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import horovod_adtopk as hat
from horovod_adtopk.integrations.lightning import DDPCompression
from _report import report, toy_data  # noqa: E402 (beside this script)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)




if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--ckpt-dir", help="save a checkpoint (with every rank's residuals) after each epoch")
    parser.add_argument("--resume", help="a checkpoint to resume from")
    parser.add_argument("--report", help="write the ranks' digests and traffic to this JSON file")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    compression = DDPCompression(hat.Compression.adtopk(ratio=args.ratio))
    callbacks = [compression]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(accelerator="auto", devices=2, strategy="ddp", max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate, callbacks=callbacks, logger=False,
                         enable_checkpointing=bool(args.ckpt_dir), enable_progress_bar=False,
                         enable_model_summary=False)
    model = Classifier()
    trainer.fit(model, DataLoader(toy_data(), batch_size=4), ckpt_path=args.resume)
    stats = compression.state.stats()
    if trainer.is_global_zero:
        print(f"{stats['round']} rounds, {stats['bytes_sent']} bytes sent of {stats['bytes_dense']} dense "
              f"({stats['bytes_sent'] / stats['bytes_dense']:.1%})")
    if args.report:
        report(args.report, model, compression.state)
    hat.ddp.shutdown()  # Lightning leaves the group to interpreter exit: destroy it, let Gloo's threads finish
