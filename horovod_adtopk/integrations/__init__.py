"""Glue between the DDP engine (:mod:`horovod_adtopk.ddp`) and training frameworks, one module per framework.

    from horovod_adtopk.integrations.lightning import DDPCompression     # a Lightning Callback
    from horovod_adtopk.integrations.accelerate import register          # on an Accelerate-prepared model
    from horovod_adtopk.integrations.transformers import attach          # a Transformers Trainer callback

Each framework module imports its framework when it is imported (never ``import horovod_adtopk`` itself) and
says what to install when the framework is missing. This package module owns what they share and imports no
framework: :class:`GatheredState`, the checkpointable view of a :class:`~horovod_adtopk.ddp.CompressionState`.

Why a view: the error-feedback residuals are *rank-private* (each rank keeps what it did not send of its own
gradient), but every framework here writes its checkpoint from rank 0 only. Handing the framework the state
itself would save rank 0's residuals and silently drop every other rank's; the view's ``state_dict()`` gathers
every rank's entry (a collective) into one dict keyed by rank, and ``load_state_dict`` on each rank picks its
own entry out of it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["GatheredState", "require"]


def require(module: str, package: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that says which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"horovod_adtopk.integrations needs {package} for this: pip install {package} "
                          f"(or pip install 'horovod_adtopk[integrations]'); importing {module!r} failed: {exc}") from exc


class GatheredState:
    """``state_dict()`` / ``load_state_dict()`` of a CompressionState with every rank's entry (see above).

    ``state_dict()`` is collective: every rank must call it (the frameworks here do: they build the checkpoint
    on every rank and write it on rank 0). ``load_state_dict()`` is local. Loading is allowed before the hook
    ran (the memory waits on the CPU until its parameter is first met).
    """

    def __init__(self, state) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state.gather_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.load_state_dict(state_dict)
