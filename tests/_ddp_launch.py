"""Launcher of the DDP tests: ``python -m tests._ddp_launch NP [MODULE:]WORKER ARGS.json OUTDIR``.

Starts NP rank processes (``python -m tests._ddp_launch --rank R ...``) on 127.0.0.1 with a free port and
waits for *all* of them (unlike torchrun, it never kills the others when one dies: the tests check that the
survivors end on their own). Exits with the first non-zero rank exit code. Run it under
``tests.harness.run_command``, whose timeout kills the whole process tree.

Each rank: ``torch.distributed.init_process_group("gloo", timeout=args["pg_timeout"] or 60 s)``, then
``tests.<module>.<worker>(args, outdir)`` (module ``ddp_workers`` by default); its JSON result goes to
``OUTDIR/rank<r>.json``, a traceback to ``OUTDIR/rank<r>.error``. ``args["block_horovod"]`` makes
``import horovod`` fail in the rank (the DDP engine must not need it).
"""
import json
import os
import socket
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(np_: int, worker: str, args_path: str, outdir: str) -> int:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(np_),
               GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    procs = [subprocess.Popen([sys.executable, "-m", "tests._ddp_launch", "--rank", str(r), worker, args_path, outdir],
                              env=dict(env, RANK=str(r))) for r in range(np_)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def rank_main(rank: int, worker: str, args_path: str, outdir: str) -> int:
    args = json.loads(Path(args_path).read_text())
    if args.get("block_horovod"):
        sys.modules["horovod"] = None  # any ``import horovod...`` now raises ImportError
    import importlib

    import torch.distributed as dist

    module, _, name = worker.rpartition(":")
    fn = getattr(importlib.import_module("tests." + (module or "ddp_workers")), name)
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=args.get("pg_timeout", 60)))
    try:
        result = fn(args, outdir)
    except Exception:
        traceback.print_exc()
        Path(outdir, f"rank{rank}.error").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a failed collective may leave the process group unable to shut down cleanly
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    # the orderly end a user's script has (barrier, destroy, Gloo's threads finish): the process then exits
    # through the interpreter's own teardown, which must not abort (issue 56)
    import horovod_adtopk.ddp
    horovod_adtopk.ddp.shutdown()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        sys.exit(rank_main(int(sys.argv[2]), *sys.argv[3:6]))
    sys.exit(launch(int(sys.argv[1]), *sys.argv[2:5]))
