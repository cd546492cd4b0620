"""The job's command line: every flag, its checks, the defaults that depend on the dataset and the
compressor (among them the recommended compression warm-up), and the one-paragraph summary of the effective
settings that rank 0 prints at start."""
from __future__ import annotations

import argparse
from typing import List, Optional

import horovod_adtopk as hat

from .data import COMMON_DEFAULTS, DATASETS, MODEL_DEFAULTS

DESCRIPTION = "Data-parallel training with sparse gradient compression (horovod_adtopk)."
VALUE_DTYPES = hat.Compression.value_dtypes()
# The recommended warm-up for the sparse compressors (README, "Which compressor to use"): the first 50
# optimizer rounds send every gradient dense, and the density falls from --density-start to --ratio over the
# first 150 rounds. --no-warmup (or --dense-rounds 0 --density-warmup 0) turns it off.
DENSE_ROUNDS = 50
DENSITY_WARMUP = 150
OPTIMIZERS = ("sgd", "adamw")


def _compressor_name(text: str) -> str:
    return text.strip().lower().replace("-", "_")


def _add_compression_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compressor", type=_compressor_name, default="adtopk", choices=hat.Compression.names())
    p.add_argument("--ratio", type=float, default=0.01, help="density of the sparse compressors")
    p.add_argument("--value-dtype", choices=sorted(VALUE_DTYPES), default=None,
                   help="dtype of the sent values (sparse compressors; default: the gradient's dtype)")
    p.add_argument("--threshold", type=float, default=None, help="magnitude threshold of --compressor threshold")
    p.add_argument("--dense-rounds", type=int, default=None,
                   help=f"compression warm-up: send every gradient dense for the first N steps (the optimizer's "
                        f"warmup_steps; default: {DENSE_ROUNDS} for the sparse compressors, 0 for the others)")
    p.add_argument("--density-warmup", type=int, default=None,
                   help=f"sparse compressors: exponential density warm-up over N steps, from --density-start down to "
                        f"--ratio (DGC's; default: {DENSITY_WARMUP}, 0 for --compressor threshold)")
    p.add_argument("--density-start", type=float, default=0.25, help="density at the start of --density-warmup")
    p.add_argument("--no-warmup", action="store_true",
                   help="no compression warm-up: the same as --dense-rounds 0 --density-warmup 0")
    p.add_argument("--powersgd-rank", type=int, default=1, help="rank of --compressor powersgd")
    p.add_argument("--overlap", choices=("off", "on", "auto"), default="off",
                   help="--engine horovod: run selection on a worker thread while the backward pass goes on "
                        "(hat.DistributedOptimizer overlap=; auto: where the rank has a spare core)")
    p.add_argument("--exchange-when-alone", action="store_true",
                   help="--engine horovod with one process: run the whole exchange anyway (selection, error feedback, "
                        "the collectives over a world of one; hat.DistributedOptimizer exchange_when_alone=True), "
                        "instead of passing the gradients through untouched (to check the path on one GPU, where "
                        "NCCL takes one rank only)")
    p.add_argument("--exchange", choices=("allgather", "sharded", "auto"), default="allgather",
                   help="per-step sparse payloads (ADTopk rules): allgather them (W-1 payloads per rank), shard "
                        "them among owner ranks (all-to-all, the owner re-selects, allgather: about 2 payloads per "
                        "rank at any world size) or let the cost model pick per tensor; local steps: --outer-exchange")
    p.add_argument("--error-feedback-on", choices=("gradient", "update"), default=None,
                   help="sparse per-step compression: error feedback on the gradient before the optimizer (the "
                        "per-step path), or on the optimizer's update (each rank steps on its own gradient, the "
                        "update is compressed with error feedback and averaged: --sync-every 1 with an outer SGD at "
                        "lr 1; adtopk, adtopk_i and topk) (default: update for adamw, where it measured better, "
                        "gradient for sgd)")
    p.add_argument("--min-fiber-len", type=int, default=None,
                   help="adtopk / adtopk_i / adtopk_t: join whole adjacent rows shorter than this into fibers of at "
                        "least this many entries (a narrow transformer's 128-entry rows keep k = 1 each otherwise; "
                        "default: 2048 for --model gpt every step, else none; 1 turns it off)")
    p.add_argument("--fiber-join", choices=("rows", "columns"), default=None,
                   help="with --min-fiber-len: join whole adjacent rows, or whole columns (every row of every "
                        "(cols/g)-th column: one budget across a fused qkv's q, k and v) (default: columns for "
                        "--model gpt every step, else rows)")
    p.add_argument("--min-numel", type=int, default=None,
                   help="tensors with fewer elements travel dense (sparse compressors; default: the package's 1024)")


def _add_local_steps_flags(p: argparse.ArgumentParser) -> None:
    """Local steps with an outer exchange (DiLoCo / SparseLoCo style; both engines): the compressor then
    compresses the pseudo-gradient of each sync, and --dense-rounds / --density-warmup count syncs."""
    g = p.add_argument_group("local steps (synchronizing rarely)")
    g.add_argument("--sync-every", type=int, default=0,
                   help="run H local optimizer steps per rank with no communication, then exchange the pseudo-"
                        "gradient through --compressor and apply the outer optimizer (0: off, every step averaged)")
    g.add_argument("--outer-lr", type=float, default=0.7, help="outer learning rate (DiLoCo's 0.7)")
    g.add_argument("--outer-momentum", type=float, default=0.9,
                   help="outer Nesterov momentum (DiLoCo's 0.9; 0: plain outer SGD, SparseLoCo's choice)")
    g.add_argument("--outer-feedback-decay", type=float, default=1.0,
                   help="a sparse compressor's error-feedback memory is multiplied by this at every sync before the "
                        "pseudo-gradient is added (SparseLoCo's beta; 1: nothing is dropped)")
    g.add_argument("--outer-value-bits", type=int, default=None, choices=range(1, 9), metavar="{1..8}",
                   help="a sparse pseudo-gradient's values travel as this many bits each (1 sign bit, the rest a "
                        "magnitude level per fiber) and its indices bit-packed (SparseLoCo uses 2); what the codes "
                        "do not carry stays in the error-feedback memory (default: the compressor's value dtype)")
    g.add_argument("--outer-exchange", default="auto", choices=("auto", "allgather", "sharded"),
                   help="how a sparse or low-bit pseudo-gradient travels: auto picks per tensor, at this world size, "
                        "whichever of an allgather, an allreduce and the owner-sharded two-stage exchange (about two "
                        "payloads per rank whatever the ranks) moves the fewest bytes")
    g.add_argument("--outer-value-group", type=int, default=None, metavar="N",
                   help="with --outer-value-bits: whole fibers share one set of magnitude levels until a set serves "
                        "at least N kept entries (short fibers keep few entries, and their levels would cost more "
                        "than their codes; default: one set per fiber)")


def _resolve_local_steps(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks of the local-steps flags; with --sync-every no momentum correction and, unless given, no
    compression warm-up (its rounds would be syncs)."""
    if args.sync_every < 0:
        p.error("--sync-every must be >= 0 (0: off)")
    if not args.sync_every:
        return
    if not args.outer_lr > 0:
        p.error("--outer-lr must be > 0")
    if not 0.0 <= args.outer_momentum < 1.0:
        p.error("--outer-momentum must lie in [0, 1)")
    if args.compressor == "powersgd":
        p.error("--sync-every compresses the pseudo-gradient with adtopk, adtopk_i, topk, fp16 or none, not powersgd")
    if args.momentum_correction:
        p.error("--momentum-correction does not apply with --sync-every (the inner SGD keeps its own momentum)")
    if args.overlap == "on":
        p.error("--overlap does not apply with --sync-every (nothing is communicated during the backward pass)")
    args.momentum_correction = False
    args.overlap = "off"
    if args.dense_rounds is None:
        args.dense_rounds = 0
    if args.density_warmup is None:
        args.density_warmup = 0


def _add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (across epochs and resumes)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: 64 fashion-mnist, 32 shakespeare)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="the wrapped optimizer: sgd (momentum, --weight-decay coupled) or adamw (--betas, decoupled "
                        "--weight-decay on weight matrices and embeddings only, none on biases and LayerNorms) "
                        "(default: adamw for gpt, sgd otherwise)")
    p.add_argument("--lr", type=float, default=None,
                   help="sgd: single-rank learning rate, scaled by the number of ranks (default: 0.1 fashion-mnist, "
                        "0.5 shakespeare); adamw: the peak rate, not scaled (default: 2e-3 for gpt)")
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), metavar=("BETA1", "BETA2"),
                   help="AdamW's moment decay rates (--optimizer adamw)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=None,
                   help="sparse compressors: apply --momentum inside the error-feedback memory of the sparse tensors "
                        "(DGC's momentum correction) instead of in SGD; dense-path tensors keep SGD momentum "
                        "(default: on for sparse compressors)")
    p.add_argument("--weight-decay", type=float, default=None, help="(default: 0.1 for gpt with adamw, else 0)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after (and on top of) the warm-up: constant, or cosine annealing to 0 at the end of --epochs")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear lr warm-up over this many steps: sgd from lr to lr*ranks, adamw from lr/N to lr "
                        "(default: one epoch; 100 steps for gpt)")
    p.add_argument("--clip-grad", type=float, default=None,
                   help="clip the averaged gradient to this global norm; 0: off (default: off / 1.0 for lstm)")
    p.add_argument("--bf16", action="store_true",
                   help="run the forward pass under bfloat16 autocast (CPU or CUDA); the loss, the gradients, the "
                        "parameters and the optimizer state stay float32; on a CPU without native bfloat16 "
                        "(AVX512-BF16, AMX) it is several times slower than float32, and the job warns")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even when a GPU is available")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--test-batches", type=int, default=None, help="evaluate on at most this many batches per rank")
    p.add_argument("--test-batch-size", type=int, default=500)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2,
                   help="keep the newest N checkpoint files, delete older ones (0: keep all); with 2 or more a "
                        "damaged newest checkpoint leaves a previous one to resume from")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --checkpoint-dir")
    p.add_argument("--elastic", action="store_true",
                   help="elastic training, ranks may be lost or join: --engine horovod under horovodrun --min-np/"
                        "--max-np/--host-discovery-script (hvd.elastic.run, the state committed in memory); --engine "
                        "ddp under torchrun --nnodes MIN:MAX --max-restarts N (needs --checkpoint-dir, implies "
                        "--resume: every restart continues from the newest checkpoint, also one of another world "
                        "size, with the error-feedback residuals folded onto the new ranks)")
    p.add_argument("--metrics-out", default=None,
                   help="JSONL file: one line per evaluation; the last (\"final\": true) is the run's summary")
    p.add_argument("--summary-json", default=None, help="also write the run's summary (one JSON object) here")
    p.add_argument("--channel-stats", default=None, metavar="FILE",
                   help="write per-layer update density and the share of output channels updated per step here "
                        "(JSON, rank 0; examples/job/channels.py)")
    p.add_argument("--print-final-json", action="store_true",
                   help="also log the summary as a last line 'FINAL {json}' (for scripts reading the log)")
    p.add_argument("--log-every", type=float, default=10.0,
                   help="seconds between progress lines when there is no progress bar (0: only at epoch ends)")
    p.add_argument("--progress", action="store_true",
                   help="show the live progress bar even when stderr is not a terminal or a launcher runs the job")
    p.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard scalars and a per-layer density histogram here (needs "
                        "'pip install tensorboard')")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it, or there is none to show (None, False)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of examples/train.py, defaults shown in ``--help``."""
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=_HelpFormatter)
    p.add_argument("--dataset", choices=sorted(DATASETS), default="fashion-mnist")
    p.add_argument("--model", default=None,
                   help="cnn, resnet or vgg for fashion-mnist, lstm or gpt for shakespeare (default: cnn / lstm)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the installed data)")
    p.add_argument("--engine", choices=("horovod", "ddp"), default="horovod",
                   help="horovod: hat.DistributedOptimizer under horovodrun/mpirun/srun; ddp: PyTorch "
                        "DistributedDataParallel with the horovod_adtopk.ddp hook under torchrun (--compressor "
                        "powersgd: PyTorch's own PowerSGD hook)")
    p.add_argument("--ddp-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="--engine ddp: the process group's backend (auto: nccl on GPUs, gloo on the CPU; gloo also "
                        "runs several processes on one GPU, which NCCL refuses)")
    _add_compression_flags(p)
    _add_optimizer_flags(p)
    _add_local_steps_flags(p)
    p.add_argument("--seq-len", type=int, default=None,
                   help="shakespeare window length, the gpt's context (default: 64 lstm, 128 gpt)")
    p.add_argument("--lstm-hidden", type=int, default=256)
    p.add_argument("--lstm-layers", type=int, default=2)
    p.add_argument("--gpt-dim", type=int, default=128, help="gpt: model width D (qkv [3D, D], MLP [4D, D])")
    p.add_argument("--gpt-layers", type=int, default=5, help="gpt: transformer blocks")
    p.add_argument("--gpt-heads", type=int, default=4, help="gpt: attention heads (must divide --gpt-dim)")
    p.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="gpt: the output head is the token embedding (one parameter used twice)")
    _add_output_flags(p)
    _add_elastic_horovod_flags(p)
    return p


def _add_elastic_horovod_flags(p: argparse.ArgumentParser) -> None:
    """The knobs of --elastic on the Horovod engine (examples/job/elastic.py)."""
    g = p.add_argument_group("elastic training, --engine horovod")
    g.add_argument("--commit-every", type=int, default=20,
                   help="--elastic: commit the state in memory every N steps (and at each epoch end); a failed "
                        "collective rolls every survivor back to the last commit, so up to N steps are replayed")
    g.add_argument("--elastic-batch", choices=("per-rank", "global"), default="per-rank",
                   help="--elastic: per-rank: every rank keeps --batch-size, so the global batch and SGD's scaled "
                        "rate follow the world size (Horovod's convention; fewer ranks take more, smaller steps per "
                        "epoch); global: the global batch stays --batch-size x the world size at start and each "
                        "rank takes its share of it (the same samples in every step whatever the world size, the "
                        "rate unchanged; the global batch must split evenly, else it is rounded down)")
    g.add_argument("--elastic-log", default=None, metavar="FILE",
                   help="--elastic: every rank appends JSON lines here (shared file system): each commit with the "
                        "step, world size, members, a SHA-256 of the parameters, the residual norm and one step's "
                        "gradient norm; each membership change and the first step after it")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on the first N examples of the training set only (small runs and tests)")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The flags, checked, with every default resolved (``argparse`` exits with status 2 on bad input)."""
    p = build_parser()
    args = p.parse_args(argv)
    spec = DATASETS[args.dataset]
    args.model = (args.model or spec.models[0]).lower()
    if args.model not in spec.models:
        p.error(f"--model {args.model} does not fit --dataset {args.dataset}; choose {' or '.join(spec.models)}")
    for defaults in (MODEL_DEFAULTS.get(args.model, {}), spec.defaults, COMMON_DEFAULTS):
        for key, value in defaults.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    args.betas = tuple(args.betas)
    _check_ranges(p, args)
    _resolve_local_steps(p, args)
    _resolve_warmup(p, args)
    _resolve_compression(p, args)
    _resolve_feedback(p, args)
    _resolve_feedback_decay(p, args)
    _resolve_value_bits(p, args)
    _check_elastic(p, args)
    return args


def _check_elastic(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks of the --elastic flags on the Horovod engine (the DDP engine's are its own)."""
    if args.train_samples is not None and args.train_samples < 1:
        p.error("--train-samples must be >= 1")
    if not args.elastic:
        if args.elastic_log:
            p.error("--elastic-log needs --elastic")
        return
    if args.engine != "horovod":
        return
    if args.commit_every < 1:
        p.error("--commit-every must be >= 1")
    if args.max_steps is not None:
        p.error("--elastic --engine horovod trains whole epochs (the number of steps depends on the world size, "
                "which may change); drop --max-steps and use --epochs (and --train-samples for a short run)")
    if args.tensorboard:
        p.error("--tensorboard does not apply with --elastic (rank 0, which writes it, may change)")
    if args.channel_stats:
        p.error("--channel-stats does not apply with --elastic (its per-step record assumes a fixed world)")
    if args.checkpoint_every and args.checkpoint_every % args.commit_every:
        p.error(f"--elastic: --checkpoint-every ({args.checkpoint_every}) must be a multiple of --commit-every "
                f"({args.commit_every}): checkpoints are written at commits")


def _check_ranges(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.max_steps is not None and args.max_steps < 0:
        p.error("--max-steps must be >= 0")
    for name in ("batch_size", "test_batch_size", "seq_len", "lstm_hidden", "lstm_layers", "gpt_dim", "gpt_layers",
                 "gpt_heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.model == "gpt" and args.gpt_dim % args.gpt_heads:
        p.error(f"--gpt-heads ({args.gpt_heads}) must divide --gpt-dim ({args.gpt_dim})")
    if not all(0.0 <= b < 1.0 for b in args.betas):
        p.error(f"--betas must lie in [0, 1), got {list(args.betas)}")
    if args.lr <= 0 or args.weight_decay < 0:
        p.error("--lr must be > 0 and --weight-decay >= 0")
    if args.test_batches is not None and args.test_batches < 0:
        p.error("--test-batches must be >= 0")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    if args.keep_checkpoints < 0:
        p.error("--keep-checkpoints must be >= 0")
    if args.log_every < 0:
        p.error("--log-every must be >= 0")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        p.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if (args.dense_rounds or 0) < 0 or (args.density_warmup or 0) < 0:
        p.error("--dense-rounds and --density-warmup must be >= 0")
    if args.overlap != "off" and args.engine != "horovod":
        p.error("--overlap applies to --engine horovod (DDP runs its hook on its own schedule)")
    if args.exchange_when_alone and args.engine != "horovod":
        p.error("--exchange-when-alone applies to --engine horovod")


# Compressors whose fixed-size payloads can carry an update through the outer exchange (horovod_adtopk.local_steps)
UPDATE_FEEDBACK_COMPRESSORS = ("adtopk", "adtopk_i", "topk")


def _resolve_feedback(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Where error feedback applies with a per-step sparse compressor. AdamW normalises every coordinate by its
    own gradient history, so a residual delivered late as one large entry moves its weight far less than the
    steps it stands for would have (docs/results.md, GPT with AdamW, 400 steps); compressing AdamW's *update* with error feedback keeps
    the sum of the updates instead. That is local steps with ``sync_every=1`` and ``Outer.sgd(lr=1)``."""
    if args.error_feedback_on is None:
        per_step_sparse = not args.sync_every and args.compressor in UPDATE_FEEDBACK_COMPRESSORS
        args.error_feedback_on = "update" if args.optimizer == "adamw" and per_step_sparse else "gradient"
    if args.error_feedback_on == "gradient":
        return
    if args.sync_every:
        p.error("--error-feedback-on update already means local steps (--sync-every 1, outer SGD lr 1); "
                "drop one of them")
    if args.compressor not in UPDATE_FEEDBACK_COMPRESSORS:
        p.error(f"--error-feedback-on update needs --compressor {', '.join(UPDATE_FEEDBACK_COMPRESSORS)} "
                f"(fixed-size payloads), not {args.compressor}")
    if args.momentum_correction:
        p.error("--error-feedback-on update keeps the optimizer's own momentum; drop --momentum-correction")
    if args.overlap == "on":
        p.error("--overlap does not apply with --error-feedback-on update (the exchange follows the step)")
    args.sync_every, args.outer_lr, args.outer_momentum, args.overlap = 1, 1.0, 0.0, "off"


def _resolve_feedback_decay(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--outer-feedback-decay acts on the outer exchange's error-feedback memory: local steps (--sync-every, or
    --error-feedback-on update, which is local steps with H = 1) with a sparse compressor."""
    decay = args.outer_feedback_decay
    if not 0.0 < decay <= 1.0:
        p.error("--outer-feedback-decay must lie in (0, 1]")
    if decay == 1.0:
        return
    if not args.sync_every:
        p.error("--outer-feedback-decay applies to local steps (--sync-every) or to error feedback on the update "
                "(--error-feedback-on update)")
    if not is_sparse_rule(args.compressor) and not (args.compressor == "none" and args.outer_value_bits):
        p.error("--outer-feedback-decay decays the error-feedback memory of a sparse compressor or of low-bit values; "
                "use it with --compressor adtopk, adtopk_i or topk, or --compressor none --outer-value-bits B")


def _resolve_value_bits(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--outer-value-bits quantizes the payload of a local-steps sync (a sparse one, or with --compressor none every
    entry); --outer-value-group groups its levels."""
    group = getattr(args, "outer_value_group", None)
    if getattr(args, "outer_value_bits", None) is None:
        if group is not None:
            p.error("--outer-value-group groups the levels of low-bit values; add --outer-value-bits B (e.g. 2)")
        return
    if not args.sync_every:
        p.error("--outer-value-bits applies to the outer exchange of local steps; add --sync-every H")
    if (not is_sparse_rule(args.compressor) and args.compressor != "none") or args.threshold is not None:
        p.error("--outer-value-bits quantizes the pseudo-gradient's values; use it with --compressor adtopk, adtopk_i "
                "or topk (sparse), or none (every entry as a low-bit code)")
    if group is not None and group < 1:
        p.error(f"--outer-value-group must be >= 1 (kept entries per set of levels), got {group}")


def is_sparse_rule(compressor: str) -> bool:
    """A compressor that sends a fraction ``--ratio`` of the entries (not dense, not PowerSGD's low rank)."""
    return not hat.Compression.is_dense_name(compressor) and compressor != "powersgd"


def _resolve_warmup(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The recommended warm-up for the sparse compressors, unless turned off or given."""
    if args.no_warmup:
        if args.dense_rounds or args.density_warmup:
            p.error("--no-warmup contradicts a non-zero --dense-rounds or --density-warmup; give one or the other")
        args.dense_rounds = args.density_warmup = 0
        return
    sparse = is_sparse_rule(args.compressor)
    if args.dense_rounds is None:
        args.dense_rounds = DENSE_ROUNDS if sparse else 0
    if args.density_warmup is None:
        # a fixed --threshold has no density to warm up
        args.density_warmup = DENSITY_WARMUP if sparse and args.compressor != "threshold" else 0


FIBER_RULES = ("adtopk", "adtopk_i", "adtopk_t")
GPT_MIN_FIBER_LEN = 2048  # --model gpt's default --min-fiber-len with a per-step fiber rule


def _resolve_compression(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.fiber_join is not None and args.compressor not in FIBER_RULES:
        p.error(f"--fiber-join applies to the fiber rules (adtopk, adtopk_i, adtopk_t) with --min-fiber-len, "
                f"not --compressor {args.compressor}")
    if args.compressor != "powersgd":
        args.powersgd_rank = None
    if hat.Compression.is_dense_name(args.compressor):
        args.density_warmup = 0
        args.density_start = None
        if args.value_dtype is not None:
            p.error(f"--value-dtype applies to sparse compressors; --compressor {args.compressor} is dense "
                    "(use --compressor fp16 for a float16 dense allreduce)")
        args.ratio = None  # dense: the whole gradient travels
        args.threshold = None
        args.min_numel = None
        args.min_fiber_len = None
        if args.momentum_correction:
            p.error("--momentum-correction needs a sparse compressor")
        args.momentum_correction = False
        return
    if not 0.0 < args.ratio <= 1.0:
        p.error("--ratio must lie in (0, 1]")
    if args.compressor == "threshold" and args.threshold is None:
        p.error("--compressor threshold needs --threshold")
    if args.compressor != "threshold":
        args.threshold = None
    if args.min_fiber_len is not None:
        if args.compressor not in FIBER_RULES:
            p.error(f"--min-fiber-len applies to the fiber rules (adtopk, adtopk_i, adtopk_t), not --compressor "
                    f"{args.compressor}")
        if args.min_fiber_len < 1:
            p.error("--min-fiber-len must be >= 1")
    elif args.model == "gpt" and args.compressor in FIBER_RULES and not args.sync_every:
        # per-step compression of the transformer: its 128-entry rows keep k = 1 each at 0.01; joined to >= 2,048
        # entries the 2,000-step test loss went from +10.2% of dense's to +7.4% (docs/results.md#gpt-accuracy)
        args.min_fiber_len = GPT_MIN_FIBER_LEN
    if args.fiber_join is not None and (args.min_fiber_len or 1) <= 1:
        p.error("--fiber-join says how --min-fiber-len joins short fibers: give --min-fiber-len L > 1 too "
                "(or, with --model gpt every step, leave --min-fiber-len out for its default 2048)")
    if (args.fiber_join is None and args.model == "gpt" and args.compressor in FIBER_RULES and not args.sync_every
            and (args.min_fiber_len or 1) > 1):
        # the transformer's default: whole columns joined, so every fiber of the fused qkv spans q, k and v;
        # at 2,000 steps 1.560 +- 0.001 against joined rows' 1.572 +- 0.008 (docs/results.md#gpt-accuracy)
        args.fiber_join = "columns"
    if args.fiber_join == "rows" or (args.min_fiber_len or 1) <= 1:
        args.fiber_join = None  # rows, the library's default: None, as checkpoints from before the flag say
    if args.compressor == "powersgd":
        if args.momentum_correction:
            p.error("--momentum-correction applies to the sparse compressors; PowerSGD uses SGD momentum")
        args.momentum_correction = False
        args.ratio = args.density_start = None
        args.density_warmup = 0
    if args.optimizer == "adamw":
        if args.momentum_correction:
            p.error("--momentum-correction is SGD's (DGC): it moves SGD's momentum into the error-feedback memory; "
                    "AdamW keeps its moments in the optimizer, so drop the flag or use --optimizer sgd")
        args.momentum_correction = False
    if args.momentum_correction is None:
        args.momentum_correction = True
    if args.momentum_correction and not 0.0 <= args.momentum < 1.0:
        p.error("--momentum-correction needs --momentum in [0, 1)")
    args.momentum_correction = bool(args.momentum_correction and args.momentum > 0)


def describe_compression(args: argparse.Namespace) -> str:
    """The effective compression settings in words, e.g. ``adtopk: ratio 0.01, momentum correction 0.9;
    compression warm-up: 50 dense rounds, density 0.25 -> 0.01 over 150 rounds``."""
    c = args.compressor
    base = (f"AdamW betas {args.betas[0]}/{args.betas[1]}, weight decay {args.weight_decay}"
            if args.optimizer == "adamw" else f"SGD momentum {args.momentum}")
    if hat.Compression.is_dense_name(c):
        text = f"{c}: dense, {base}"
    elif c == "powersgd":
        text = f"{c}: rank {args.powersgd_rank}, {base}"
    else:
        text = f"{c}: ratio {args.ratio}" + (f", threshold {args.threshold}" if args.threshold is not None else "")
        if (getattr(args, "min_fiber_len", None) or 1) > 1:
            joined = getattr(args, "fiber_join", None) or "rows"
            text += f", short {joined} joined into fibers of >= {args.min_fiber_len} entries"
        text += (f", momentum correction {args.momentum} (the sparse tensors' SGD without momentum)"
                 if args.momentum_correction else f", {base}")
    if getattr(args, "error_feedback_on", None) == "update":
        text += "; error feedback on the optimizer's update (local steps: sync every step, outer SGD lr 1)"
    elif getattr(args, "sync_every", 0):
        outer = (f"Nesterov lr {args.outer_lr} momentum {args.outer_momentum}" if args.outer_momentum
                 else f"SGD lr {args.outer_lr}")
        if args.outer_feedback_decay != 1.0:
            outer += f", error feedback decayed by {args.outer_feedback_decay} per sync"
        if getattr(args, "outer_value_bits", None) is not None and c == "none":
            outer += f", every entry as a {args.outer_value_bits}-bit code"
        elif getattr(args, "outer_value_bits", None) is not None:
            outer += f", {args.outer_value_bits}-bit values and bit-packed indices"
            if getattr(args, "outer_value_group", None) is not None:
                outer += f" (levels shared by at least {args.outer_value_group} entries)"
        text += f"; local steps: sync every {args.sync_every} steps, outer {outer} (rounds below are syncs)"
        if args.outer_momentum and args.optimizer == "sgd" and args.momentum:
            # docs/results.md#cnn-accuracy (local steps): on the CNN, H = 10 diverged on one seed of two (both with a sparse pseudo-gradient)
            text += (" [caution: an outer momentum on top of SGD's own momentum compounds; it diverged on the CNN "
                     "at H = 10 where --outer-lr 1 --outer-momentum 0 (local SGD) trained best]")
    parts = []
    if args.dense_rounds:
        parts.append(f"{args.dense_rounds} dense rounds")
    if args.density_warmup:
        parts.append(f"density {args.density_start} -> {args.ratio} over {args.density_warmup} rounds")
    if not parts:
        return f"{text}; no compression warm-up"
    return f"{text}; compression warm-up: {', '.join(parts)}" + (" (--no-warmup: off)" if is_sparse_rule(c) else "")
