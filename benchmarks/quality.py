"""Quality: DiffEqFormer vs a discrete baseline at the same width, depth, tokens and schedule.

For each seed, both models train on the same text with the same SentencePiece tokenizer,
data order (the seed), batch, steps and AdamW schedule, and are evaluated on every token
of the evaluation text. The baseline has the same family: GPT-2 for `--family=gpt2`,
Llama for `--family=llama`. The last line is the key ratio (< 1: DiffEqFormer is better):

  diffeqformer/gpt test perplexity ratio: R (mean of N seeds, steps S)

  python -m benchmarks.quality --data_dir=DIR        # WikiText-2 in DIR; 3 seeds × 2 models
  python -m benchmarks.quality --train_text=a.txt --eval_text=b.txt   # any UTF-8 text
  python -m benchmarks.quality --steps=20 --seeds=1 --eval_batches=2  # smoke run

Defaults (d 256, 4 heads, 6 steps/layers, seq 128, batch 16, 600 steps, vocab 4096,
d_t 64, lr 1e-3, β2 0.95) are sized for a 2-core CPU (run times: benchmarks/README.md,
"Quality"). A `--workdir` that holds runs of the same code and config is
reused (`common.keyed_run`): a finished run is only evaluated again and its line says
so, naming the code version; an unfinished one resumes from its last checkpoint (every
`--checkpoint_every` steps), so an interrupted benchmark continues where it stopped;
runs of other code or another config are moved aside and trained afresh.
"""

import os
import tempfile
import time

from absl import logging

from benchmarks import common
from configs import default
from odetransformer import cli_flags, errors
from odetransformer.model.config import FAMILIES, LLAMA_BLOCKS
from odetransformer.model.solvers import STEP_TIMES


def make_config(args, kind: str, seed: int, cache_dir: str):
  c = default.get_config()
  c.seed = seed
  c.model.kind = kind
  c.model.family = args.family
  c.model.step_time = args.step_time
  if kind == "diffeqformer":  # the baseline is the standard block
    c.model.llama_block = args.llama_block
  c.model.d_model = args.d_model
  c.model.num_heads = args.num_heads
  c.model.mlp_dim = 4 * args.d_model
  c.model.solver_steps = c.model.num_layers = args.depth
  c.model.max_len = args.seq_len
  c.model.time_embed_dim = args.time_embed_dim
  c.seq_len = args.seq_len
  c.global_batch_size = args.batch
  c.eval_batch_size = args.batch
  c.num_train_steps = args.steps
  c.log_every_steps = max(1, args.steps // 10)
  c.eval_every_steps = 0  # only at the end
  c.checkpoint_every_steps = args.checkpoint_every  # a rerun resumes from the last
  c.optim.learning_rate = args.lr
  c.optim.b2 = args.b2
  c.data.source = "local"
  c.data.train_files = args.train_text
  c.data.eval_files = args.eval_text
  c.data.vocab_size = args.vocab
  c.data.eval_max_batches = args.eval_batches
  c.data.cache_dir = cache_dir  # one tokenizer for every run
  return c


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("integer", "seeds", 3, "seeds 0..N-1, both models each")
  define("integer", "steps", 600, "training steps of each run")
  define("enum", "family", "gpt2", "model family of both runs", enum_values=list(FAMILIES))
  define(
    "enum",
    "step_time",
    "start",
    "model.step_time of the DiffEqFormer",
    enum_values=list(STEP_TIMES),
  )
  define(
    "enum",
    "llama_block",
    "paper",
    "model.llama_block of the Llama DiffEqFormer",
    enum_values=list(LLAMA_BLOCKS),
  )
  define(
    "integer",
    "checkpoint_every",
    100,
    "steps between checkpoints: a killed run rerun with the same command "
    "resumes from the last (0 = only at the end)",
  )
  define("integer", "batch", 16, "global batch size")
  define("integer", "seq_len", 128, "sequence length")
  define("integer", "d_model", 256, "model width (mlp = 4·d)")
  define("integer", "num_heads", 4, "attention heads")
  define("integer", "depth", 6, "ODE steps = baseline layers")
  define("integer", "time_embed_dim", 64, "d_t of the DiffEqFormer")
  define("integer", "vocab", 4096, "SentencePiece vocabulary size")
  define("float", "lr", 1e-3, "peak learning rate")
  define("float", "b2", 0.95, "AdamW beta2")
  define("integer", "eval_batches", 0, "0 = all of the eval text")
  define(
    "string",
    "data_dir",
    "",
    "directory with WikiText-2's valid.txt and test.txt (the defaults of "
    "--train_text and --eval_text)",
  )
  define("string", "train_text", "", "UTF-8 text to train on (default: DATA_DIR/valid.txt)")
  define("string", "eval_text", "", "UTF-8 text to evaluate on (default: DATA_DIR/test.txt)")
  define("string", "workdir", "", "default: a fresh temporary directory")


def parse_args(argv=None):
  """The flags of `argv` (without the program name; default sys.argv[1:]), checked: a
  bad value is a UserError naming the fix."""
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  if args.data_dir:
    args.train_text = args.train_text or os.path.join(args.data_dir, "valid.txt")
    args.eval_text = args.eval_text or os.path.join(args.data_dir, "test.txt")
  for flag in ("train_text", "eval_text"):
    if not os.path.isfile(getattr(args, flag)):
      raise errors.UserError(
        f"--{flag}={getattr(args, flag)} is not a file; pass a UTF-8 text file "
        "(or --data_dir with WikiText-2's valid.txt and test.txt)"
      )
  if args.seeds < 1:
    raise errors.UserError(f"--seeds={args.seeds} must be at least 1; pass --seeds=1 or more")
  if args.llama_block != "paper" and args.family != "llama":
    raise errors.UserError(
      f"--llama_block={args.llama_block} needs --family=llama; pass --family=llama "
      "or leave --llama_block out"
    )
  return args


def main(argv=None):
  args = parse_args(argv)
  logging.set_verbosity(logging.WARNING)
  root = args.workdir or tempfile.mkdtemp(prefix="odet_quality_")
  print(f"workdir {root}", flush=True)
  ratios = []
  for seed in range(args.seeds):
    ppl = {}
    for kind in ("diffeqformer", "transformer"):
      workdir = os.path.join(root, f"{kind}_{args.family}_seed{seed}")
      if kind == "diffeqformer":
        workdir += f"_{args.step_time}_{args.llama_block}"
      t = time.perf_counter()
      r, note = common.keyed_run(
        make_config(args, kind, seed, os.path.join(root, "cache")), workdir
      )
      ppl[kind] = r["eval"]["perplexity"]
      hist = r["loss_history"]
      trained = (
        f"{note}, evaluated now" if note else f"train loss {hist[0][1]:.3f} -> {hist[-1][1]:.3f}"
      )
      print(
        f"seed {seed} {kind:13s} {args.family:5s} params {r['num_params']:>12,} | "
        f"{trained} | test loss {r['eval']['loss']:.4f} | test ppl {ppl[kind]:.2f} | "
        f"test tokens {int(r['eval']['num_tokens']):,} | "
        f"{time.perf_counter() - t:.0f}s",
        flush=True,
      )
    ratios.append(ppl["diffeqformer"] / ppl["transformer"])
    print(f"seed {seed} diffeqformer/gpt test perplexity ratio: {ratios[-1]:.3f}", flush=True)
  mean = sum(ratios) / len(ratios)
  print(
    f"diffeqformer/gpt test perplexity ratio: {mean:.3f} "
    f"(mean of {len(ratios)} seeds, steps {args.steps})"
  )


if __name__ == "__main__":
  errors.run_cli(main)
