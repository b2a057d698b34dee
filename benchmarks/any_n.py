"""Any N: does a pre-trained DiffEqFormer hold its quality at another solver step count?

Trains the same model twice per seed — on the uniform time grid (`fixed`) and with a
training time-grid option (`--option`, a `model.train_time_grid` value) — at equal
tokens (same init, data order, batch, steps and schedule), then evaluates both on the
same tokens with N ∈ {K/2, K, 3K/2, 2K, 4K} Euler steps of the uniform grid. It also
times both train steps side by side (interleaved rounds of the product's train step).
The last line is the option's solver robustness, on the seed-mean perplexities:

  any-N: max ppl(N)/ppl(K) over N in {3K/2, 2K, 4K}: R

  python -m benchmarks.any_n                   # configs/default.py, 3 seeds × 2 modes
  python -m benchmarks.any_n --seeds=1 --steps=100 --option=random_offset
  python -m benchmarks.any_n --runs=D1,D2 --data=local:DIR/test.txt   # no training

`--runs` scores pre-trained DiffEqFormer workdirs (any training run's, e.g. those of
`benchmarks.single_epoch`) at the same N ∈ {K/2, …, 4K} of each run's own K instead of
training, on `--data` (default: each run's eval split), and prints one row per run
(named by its time grid and step time) and the ratio line for each.

Defaults are configs/default.py's (K = 4, 500 steps, the embedded corpus, so no data
is needed; its run time is in benchmarks/README.md, "Any N"). A `--workdir`
that holds runs of the same code and config is reused (`common.keyed_run`): a finished
run's scores are read back, and its line says so and names the code version; runs of
other code or another config are moved aside and trained afresh.
"""

import json
import os
import tempfile
import time

from absl import logging

from benchmarks import common
from configs import default
from odetransformer import cli_flags, errors
from odetransformer.errors import UserError
from odetransformer.model import config as config_lib
from odetransformer.model.solvers import STEP_TIMES
from odetransformer.model.time_grid import TRAIN_TIME_GRIDS
from odetransformer.runtime.logs import quiet_tool_logs
from odetransformer.train import evaluation, loading

ROBUST_N = ("3K/2", "2K", "4K")


def step_counts(k: int) -> dict:
  """Label -> N for the evaluated step counts."""
  return {"K/2": k // 2, "K": k, "3K/2": 3 * k // 2, "2K": 2 * k, "4K": 4 * k}


def worst_ratio(row: dict) -> float:
  """max ppl(N)/ppl(K) over the N of `ROBUST_N`, for a row label -> perplexity."""
  return max(row[label] / row["K"] for label in ROBUST_N)


def make_config(args, mode: str, seed: int, cache_dir: str):
  c = default.get_config()
  c.seed = seed
  c.model.train_time_grid = mode
  c.num_train_steps = args.steps
  c.log_every_steps = max(1, args.steps // 5)
  c.eval_every_steps = 0  # evaluated below, at every N
  c.checkpoint_every_steps = 0  # only at the end
  c.data.cache_dir = cache_dir  # one tokenizer for every run
  # Only what a flag sets differs from configs/default.py (0 = keep the config's).
  for node, key, value in (
    (c.model, "solver_steps", args.solver_steps),
    (c.model, "d_model", args.d_model),
    (c.model, "mlp_dim", 4 * args.d_model),
    (c.model, "num_heads", args.num_heads),
    (c.model, "time_embed_dim", args.time_embed_dim),
    (c.model, "time_sinusoids", args.time_sinusoids),
    (c.model, "step_time", args.step_time),
    (c.model, "max_len", args.seq_len),
    (c, "seq_len", args.seq_len),
    (c, "global_batch_size", args.batch),
    (c.data, "vocab_size", args.vocab),
    (c.data, "tokenizer_sample_bytes", args.tokenizer_sample_bytes),
  ):
    if value:
      setattr(node, key, value)
  c.eval_batch_size = c.global_batch_size
  c.data.eval_max_batches = args.eval_batches
  return c


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("integer", "seeds", 3, "number of seeds, both modes each")
  define(
    "integer",
    "first_seed",
    0,
    "seeds first_seed … first_seed + seeds - 1 (split runs over processes)",
  )
  define(
    "string",
    "option",
    "random_offset",
    f"the model.train_time_grid to compare with 'fixed' "
    f"({', '.join(g for g in TRAIN_TIME_GRIDS if g != 'fixed')})",
  )
  define(
    "enum",
    "step_time",
    "",
    "model.step_time of both runs ('' = the config's)",
    enum_values=["", *STEP_TIMES],
  )
  define("integer", "steps", 0, "train steps (0 = the config's)")
  define("integer", "solver_steps", 0, "K, even (0 = the config's)")
  define("integer", "d_model", 0, "0 = the config's (mlp = 4·d)")
  define("integer", "num_heads", 0, "0 = the config's")
  define("integer", "time_embed_dim", 0, "d_t (0 = the config's)")
  define("integer", "time_sinusoids", 0, "S (0 = the config's)")
  define("integer", "seq_len", 0, "0 = the config's")
  define("integer", "batch", 0, "0 = the config's")
  define("integer", "vocab", 0, "0 = the config's")
  define("integer", "tokenizer_sample_bytes", 0, "0 = the config's")
  define("integer", "eval_batches", 16, "evaluation batches per N (0 = the whole eval split)")
  define("integer", "rounds", 20, "interleaved timing rounds (0 = no timing)")
  define("string", "workdir", "", "default: a fresh temporary directory")
  define(
    "string",
    "runs",
    "",
    "comma-separated pre-trained DiffEqFormer "
    "workdirs to score at every N (no training; the flags above that shape "
    "or train a run do not apply)",
  )
  define(
    "string",
    "data",
    "",
    "with --runs: the evaluation text, 'local:<glob>' or a data.source ('' = each run's "
    "eval split)",
  )


def parse_args(argv=None):
  """The flags of `argv` (without the program name; default sys.argv[1:]), checked: a
  bad value is a UserError naming the fix."""
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  args.runs = [r for r in args.runs.split(",") if r]
  if args.data and not args.runs:
    raise UserError("--data applies to --runs only; the trained runs score on their eval split")
  if args.option not in TRAIN_TIME_GRIDS or args.option == "fixed":
    raise UserError(
      f"--option={args.option!r}: choose one of {[g for g in TRAIN_TIME_GRIDS if g != 'fixed']}"
    )
  if args.seeds < 1:
    raise UserError(f"--seeds={args.seeds} must be at least 1; pass --seeds=1 or more")
  if args.rounds < 0 or args.first_seed < 0:
    raise UserError(
      f"--rounds={args.rounds} and --first_seed={args.first_seed} must be >= 0; pass "
      "non-negative values"
    )
  args.steps = args.steps or default.get_config().num_train_steps
  k = args.solver_steps or default.get_config().model.solver_steps
  if k < 2 or k % 2:
    raise UserError(
      f"--solver_steps={k}: K must be even and >= 2 (K/2 and 3K/2 are evaluated); "
      "pass an even --solver_steps"
    )
  return args


def train_tokens_per_second(config, rounds: int, option: str) -> dict:
  """Mode -> train tokens/s of the product's train step for 'fixed' and `option` (the
  model of `config` under either training grid), both timed in turn."""
  modes = ("fixed", option)
  cfg = config_lib.model_config(config, config.data.vocab_size)
  trainers = {m: common.Trainer(common.replace(cfg, train_time_grid=m), seed=0) for m in modes}
  b, length = config.global_batch_size, config.seq_len
  batch = trainers["fixed"].batch(b, length)
  seconds = common.time_alternating(
    {m: (lambda t=t: t.step(batch)) for m, t in trainers.items()}, rounds
  )
  return {m: b * length / s for m, s in seconds.items()}


def train_and_score(config, workdir: str, eval_batches: int):
  """Trains (or reuses, `common.keyed_run`) one run and scores it at every N: (label ->
  perplexity, a line). The scores are kept in the run's workdir under the code version
  and the evaluation settings, so a rerun of the same code only reads them (and says so)."""
  counts = step_counts(config.model.solver_steps)
  scores = os.path.join(workdir, "any_n_scores.json")
  t = time.perf_counter()
  r, note = common.keyed_run(config, workdir)
  trained = time.perf_counter() - t
  hist = r["loss_history"]
  key = {
    "code": common.code_version(),
    "step": int(r["step"]),
    "eval_batches": eval_batches,
    "counts": counts,
  }
  stored = {}
  if os.path.exists(scores):
    with open(scores) as f:
      stored = json.load(f)
  if stored.get("key") == key:
    source = f"read back from {scores} (code {key['code']}, trained earlier: {r['step']} steps)"
  else:
    results = evaluation.evaluate(workdir, list(counts.values()), max_batches=eval_batches)
    stored = {
      "key": key,
      "perplexity": {label: res.perplexity for label, res in zip(counts, results)},
      "tokens": results[0].num_tokens,
    }
    with open(scores, "w") as f:
      json.dump(stored, f)
    source = (
      f"train loss {hist[0][1]:.3f} -> {hist[-1][1]:.3f}" if not note else f"{note}, scored now"
    )
  row = stored["perplexity"]
  cells = " | ".join(f"N={counts[label]} {row[label]:.2f}" for label in counts)
  return row, (
    f"{source} | ppl {cells} | max ratio {worst_ratio(row):.3f} | "
    f"eval tokens {stored['tokens']:,} | {trained:.0f}s"
  )


def score_runs(runs: list, data: str, eval_batches: int) -> None:
  """Scores each pre-trained run at every N of its own K (`evaluation.evaluate`) and prints
  a row per run and the ratio lines."""
  rows = []
  for workdir in runs:
    cfg = loading.load_run_config(workdir).model
    if cfg.kind != "diffeqformer":
      raise UserError(
        f"--runs: {workdir} holds a {cfg.kind!r} model, and any N needs a "
        "DiffEqFormer; pass DiffEqFormer runs"
      )
    counts = step_counts(int(cfg.solver_steps))
    t = time.perf_counter()
    results = evaluation.evaluate(
      workdir, list(counts.values()), data=data, max_batches=eval_batches
    )
    row = {label: r.perplexity for label, r in zip(counts, results)}
    name = f"{cfg.train_time_grid} grid, step_time {cfg.step_time}"
    rows.append((name, row, worst_ratio(row)))
    print(
      f"{workdir} ({name}): ppl "
      + " | ".join(f"N={n} {row[label]:.2f}" for label, n in counts.items())
      + f" | eval tokens {results[0].num_tokens:,} | {time.perf_counter() - t:.0f}s",
      flush=True,
    )
  print(
    f"{'run':40s} "
    + " ".join(f"{label:>9s}" for label in rows[0][1])
    + "   max ppl(N)/ppl(K) over N in {3K/2, 2K, 4K}"
  )
  for name, row, worst in rows:
    print(f"{name:40s} " + " ".join(f"{v:9.2f}" for v in row.values()) + f"   {worst:.3f}")
  for name, _, worst in rows:
    print(f"any-N ({name}): max ppl(N)/ppl(K) over N in {{3K/2, 2K, 4K}}: {worst:.3f}")


def main(argv=None):
  args = parse_args(argv)
  logging.set_verbosity(logging.WARNING)
  quiet_tool_logs()
  if args.runs:
    score_runs(args.runs, args.data, args.eval_batches)
    return
  root = args.workdir or tempfile.mkdtemp(prefix="odet_any_n_")
  print(f"workdir {root}", flush=True)
  modes = ("fixed", args.option)
  ppl = {m: [] for m in modes}  # per seed: label -> perplexity
  config = None
  seeds = range(args.first_seed, args.first_seed + args.seeds)
  for seed in seeds:
    for mode in (args.option, "fixed"):
      config = make_config(args, mode, seed, os.path.join(root, "cache"))
      workdir = os.path.join(root, f"{mode}_seed{seed}")
      row, line = train_and_score(config, workdir, args.eval_batches)
      ppl[mode].append(row)
      print(f"seed {seed} {mode:14s} {line}", flush=True)

  k = config.model.solver_steps
  counts = step_counts(k)
  mean = {
    m: {label: sum(row[label] for row in ppl[m]) / len(ppl[m]) for label in counts} for m in modes
  }
  print(f"mean perplexity of seed(s) {', '.join(map(str, seeds))}, {args.steps} steps, K = {k}:")
  print(
    f"{'mode':14s} "
    + " ".join(f"{f'N={n}':>9s}" for n in counts.values())
    + "   max ppl(N)/ppl(K) over N in {3K/2, 2K, 4K}"
  )
  ratios = {}
  for m in modes:
    ratios[m] = worst_ratio(mean[m])
    print(
      f"{m:14s} " + " ".join(f"{mean[m][label]:9.2f}" for label in counts) + f"   {ratios[m]:.3f}"
    )
  print(f"{args.option}/fixed perplexity at K: {mean[args.option]['K'] / mean['fixed']['K']:.4f}")
  if args.rounds:
    tps = train_tokens_per_second(config, args.rounds, args.option)
    print(
      f"train tokens/s: fixed {tps['fixed']:,.0f}, {args.option} {tps[args.option]:,.0f} "
      f"({args.option}/fixed time per step {tps['fixed'] / tps[args.option]:.3f}; "
      f"median of {args.rounds} interleaved rounds)"
    )
  print(f"any-N: max ppl(N)/ppl(K) over N in {{3K/2, 2K, 4K}}: {ratios[args.option]:.3f}")


if __name__ == "__main__":
  errors.run_cli(main)
