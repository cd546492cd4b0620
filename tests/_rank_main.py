"""Entry point of one rank under the harness: ``python -m tests._rank_main [MODULE:]WORKER ARGS.json OUTDIR``."""
import json
import sys
import traceback
from pathlib import Path


def main() -> int:
    worker, args_path, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
    import horovod.torch as hvd

    import importlib

    # ``module:function`` runs ``tests.<module>.<function>``; a bare name runs ``tests.workers.<name>``.
    module, _, worker = worker.rpartition(":")
    workers = importlib.import_module("tests." + (module or "workers"))

    hvd.init()
    args = json.loads(Path(args_path).read_text())
    rank = hvd.rank()
    try:
        result = getattr(workers, worker)(args, outdir)
    except Exception:
        traceback.print_exc()
        Path(outdir, f"rank{rank}.error").write_text(traceback.format_exc())
        return 1
    if isinstance(result, dict):
        result.setdefault("outdir", outdir)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
