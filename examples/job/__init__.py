"""The modules of the training job ``examples/train.py``, one job each.

- ``options``: the command line, its checks and resolved defaults (the recommended warm-up), the settings line
- ``data``: the datasets (loader, models, default flags, scoring), the model builder and the loss
- ``engine``: the only module that talks to Horovod: init, the wrapped optimizer, broadcasts, collectives
- ``ddp_engine``: the same methods over ``torch.distributed`` (``--engine ddp``, torchrun), without Horovod
- ``optim``: the compressor and the optimizer (SGD or AdamW groups) the flags name, for both engines
- ``build``: set-up of a run (device, data, model, optimizer, lr schedule) into one ``state.Job``
- ``state``: ``Progress`` (where a run stands) and ``Job`` (what it runs with), the summed counters
- ``loop``: training steps, evaluation, metrics lines and the final summary
- ``checkpoints``: checkpoint files (rotation, atomic writes, reading), no collectives
- ``resume``: saving and resuming as collectives (rank 0 writes and picks, every rank restores)
- ``logs``: rank-0 log lines and the progress bar or timed progress lines
- ``board``: ``--tensorboard``
- ``common``: the logger, ``JobFailed``, ``agree`` and the launchers' environment variables
"""
