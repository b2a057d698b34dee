"""Any N: does a DiffEqFormer trained at K steps keep its perplexity at other N?

Trains the same model once per candidate and seed — 'fixed' (a DiffEqFormer without
any-N training: the uniform grid, no penalty) and each training option (`CANDIDATES`: a
time-grid sampler, a mix of grids, a smooth time embedding, a penalty on the solve's
local error) — at equal tokens (same init, data order, batch, steps and schedule),
evaluates every run on
the same tokens at N ∈ {K/2, K, 2K, 4K, 8K} Euler steps of the uniform grid, and times
every candidate's train step side by side (interleaved rounds of the product's step).

The table gives each candidate's perplexity at every N (mean ± std over the seeds), and
the targets of a default: max(ppl(2K), ppl(4K)) within 3% of ppl(K), ppl(K/2) within
10%, ppl(K) within 1% of 'fixed', and a train step within 10% of its time. The
chosen candidate is the one meeting all four with the lowest ppl(K) ('fixed' when none
does); the last line is its ratio:

  any-N: chosen C: max(ppl(2K), ppl(4K)) / ppl(K) = R

  python -m benchmarks.any_n --seeds=3 --workdir=D                   # configs/default.py
  python -m benchmarks.any_n --preset=bench-small --seeds=3 --workdir=D2
  python -m benchmarks.any_n --candidates=fixed,shift_half --seeds=1 --steps=100
  python -m benchmarks.any_n --runs=D1,D2 --data=local:DIR/test.txt  # no training
  python -m benchmarks.any_n --seeds=3 --rows=A/any_n_rows.json,B/any_n_rows.json

`--preset=default` is configs/default.py (K = 4, 500 steps, the embedded corpus: no data
needed); `bench-small` is benchmarks.common's preset shape (d 256, 4 heads, K = 6, d_t
64, seq 256, batch 8) on the same corpus. A PNG of perplexity against N, one curve per
candidate, is written to the workdir. `--runs` scores pre-trained DiffEqFormer workdirs
(e.g. those of `benchmarks.single_epoch`) at the same N of each run's own K instead of
training. A `--workdir` holding runs of the same code and config is reused
(`common.keyed_run`): a finished run's scores are read back, and its line says so and
names the code version; an interrupted one resumes; runs of other code or another config
are moved aside and trained afresh.

Every scored run is added to `<workdir>/any_n_rows.json` as it finishes (its candidate,
seed, perplexities and run key: code version and config), so the seeds of one table can
be trained by several processes or machines: `--rows` adds the rows of such files to this
run's (a run they hold is not trained again; with `--seeds=0` nothing is), after checking
that each was made by this code with the config this command gives its candidate and seed.
"""

import json
import math
import os
import statistics
import tempfile
import time

from absl import logging

from benchmarks import common
from configs import default
from odetransformer import cli_flags, errors
from odetransformer.errors import UserError
from odetransformer.model import config as config_lib
from odetransformer.model.solvers import STEP_TIMES
from odetransformer.runtime.logs import quiet_tool_logs
from odetransformer.train import evaluation, loading

# The model fields the candidates set, at the values of a DiffEqFormer without any-N
# training (the uniform grid k/K, s = 1000, no penalty): each candidate is these with its
# own changes, whatever configs/default.py sets them to.
BASE = {
  "train_time_grid": "fixed",
  "train_time_grid_fraction": 1.0,
  "time_scale": 1000.0,
  "local_error_weight": 0.0,
  "local_error_stride": 1,
  "local_error_form": "steps",
  "time_interp_weight": 0.0,
}
# Training options compared with 'fixed' (BASE itself): model fields each changes.
CANDIDATES = {
  "fixed": {},
  "random_shift": {"train_time_grid": "random_shift"},
  "shift_half": {"train_time_grid": "random_shift", "train_time_grid_fraction": 0.5},
  "shift_quarter": {"train_time_grid": "random_shift", "train_time_grid_fraction": 0.25},
  "smooth_t": {"time_scale": 10.0},
  "local_error_1": {"local_error_weight": 1.0},
  "local_error_10": {"local_error_weight": 10.0},
  "local_error_30": {"local_error_weight": 30.0},
  "local_error_100": {"local_error_weight": 100.0},
  "local_error_300": {"local_error_weight": 300.0},
  "local_error_1000": {"local_error_weight": 1000.0},
  "interp_1": {"time_interp_weight": 1.0},
  "local_error_300_interp_1": {"local_error_weight": 300.0, "time_interp_weight": 1.0},
  "local_error_300_interp_10": {"local_error_weight": 300.0, "time_interp_weight": 10.0},
  "local_error_3000": {"local_error_weight": 3000.0},
  "local_error_3000_rows2": {"local_error_weight": 3000.0, "local_error_stride": 2},
  "local_error_3000_rows4": {"local_error_weight": 3000.0, "local_error_stride": 4},
  "local_error_3000_rows8": {"local_error_weight": 3000.0, "local_error_stride": 8},
  # λ on another estimate (model.local_error_form): 'halves' one step split in two Euler
  # halves (the field between the nodes), 'both' the node terms and the halves term
  **{
    f"local_error_{form}_{w}_rows4": {
      "local_error_weight": float(w),
      "local_error_stride": 4,
      "local_error_form": form,
    }
    for form, weights in (("halves", (3000, 10000, 30000)), ("both", (3000, 10000)))
    for w in weights
  },
  "local_error_10000": {"local_error_weight": 10000.0},
  "local_error_30000": {"local_error_weight": 30000.0},
  "local_error_3000_interp_0.1": {"local_error_weight": 3000.0, "time_interp_weight": 0.1},
  "local_error_1000_interp_1": {"local_error_weight": 1000.0, "time_interp_weight": 1.0},
  "local_error_1000_interp_10": {"local_error_weight": 1000.0, "time_interp_weight": 10.0},
  "local_error_10_shift_quarter": {
    "local_error_weight": 10.0,
    "train_time_grid": "random_shift",
    "train_time_grid_fraction": 0.25,
  },
  "local_error_30_shift_quarter": {
    "local_error_weight": 30.0,
    "train_time_grid": "random_shift",
    "train_time_grid_fraction": 0.25,
  },
  "local_error_100_shift_quarter": {
    "local_error_weight": 100.0,
    "train_time_grid": "random_shift",
    "train_time_grid_fraction": 0.25,
  },
  "smooth_t_shift_half": {
    "time_scale": 10.0,
    "train_time_grid": "random_shift",
    "train_time_grid_fraction": 0.5,
  },
}
DEFAULT = "fixed"
assert all(set(fields) <= set(BASE) for fields in CANDIDATES.values()), "BASE misses a field"
# The targets a candidate must meet to become the default (module docstring).
MAX_FINER_RATIO, MAX_HALF_RATIO, MAX_K_COST, MAX_STEP_COST = 1.03, 1.10, 1.01, 1.10
PRESETS = ("default", "bench-small")
ROWS_FILE = "any_n_rows.json"  # every scored run of a workdir (candidate, seed, key, row)


def step_counts(k: int) -> dict:
  """Label -> N for the evaluated step counts."""
  return {"K/2": k // 2, "K": k, "2K": 2 * k, "4K": 4 * k, "8K": 8 * k}


def worst_ratio(row: dict) -> float:
  """max(ppl(2K), ppl(4K)) / ppl(K), for a row label -> perplexity."""
  return max(row["2K"], row["4K"]) / row["K"]


def make_config(args, candidate: str, seed: int, cache_dir: str):
  """The run of `candidate` and `seed`: configs/default.py, the preset's shape, the
  shape flags, then the candidate's model fields."""
  c = default.get_config()
  c.seed = seed
  c.num_train_steps = args.steps
  c.log_every_steps = max(1, args.steps // 5)
  c.eval_every_steps = 0  # evaluated below, at every N
  c.checkpoint_every_steps = max(1, args.steps // 5)  # long runs resume
  c.data.cache_dir = cache_dir  # one tokenizer for every run
  if args.preset == "bench-small":
    shape = common.PRESETS["bench-small"]
    for key, value in shape["model"].items():
      if key != "num_layers":  # the ODE's depth is solver_steps
        setattr(c.model, key, value)
    c.data.vocab_size = shape["model"]["vocab_size"]
    c.seq_len, c.global_batch_size = shape["seq_len"], shape["batch"]
  # Only what a flag sets differs from the preset (0 = keep it).
  for node, key, value in (
    (c.model, "solver_steps", args.solver_steps),
    (c.model, "num_layers", args.solver_steps),  # kept equal: the unused depth
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
  for key, value in {**BASE, **CANDIDATES[candidate]}.items():
    setattr(c.model, key, value)
  c.eval_batch_size = c.global_batch_size
  c.data.eval_max_batches = args.eval_batches
  return c


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("enum", "preset", "default", "model and run size", enum_values=list(PRESETS))
  define(
    "string",
    "candidates",
    ",".join(CANDIDATES),
    f"comma-separated candidates to train ({', '.join(CANDIDATES)}); {DEFAULT!r} is "
    "always among them",
  )
  define(
    "integer",
    "seeds",
    3,
    "number of seeds, every candidate each (0 with --rows: tabulate their rows only)",
  )
  define(
    "integer",
    "first_seed",
    0,
    "seeds first_seed … first_seed + seeds - 1 (split runs over processes)",
  )
  define(
    "enum",
    "step_time",
    "",
    "model.step_time of every run ('' = the config's)",
    enum_values=["", *STEP_TIMES],
  )
  define("integer", "steps", 0, "train steps (0 = the preset's: 500, bench-small 600)")
  define("integer", "solver_steps", 0, "K, even (0 = the preset's)")
  define("integer", "d_model", 0, "0 = the preset's (mlp = 4·d)")
  define("integer", "num_heads", 0, "0 = the preset's")
  define("integer", "time_embed_dim", 0, "d_t (0 = the preset's)")
  define("integer", "time_sinusoids", 0, "S (0 = the preset's)")
  define("integer", "seq_len", 0, "0 = the preset's")
  define("integer", "batch", 0, "0 = the preset's")
  define("integer", "vocab", 0, "0 = the preset's")
  define("integer", "tokenizer_sample_bytes", 0, "0 = the config's")
  define("integer", "eval_batches", 16, "evaluation batches per N (0 = the whole eval split)")
  define("integer", "rounds", 20, "interleaved timing rounds (0 = no timing)")
  define("string", "workdir", "", "default: a fresh temporary directory")
  define(
    "string",
    "rows",
    "",
    "comma-separated any_n_rows.json files of other workdirs (this code and these flags, "
    "other seeds or candidates): their rows join the table; their runs are not trained "
    "again",
  )
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
  args.rows = [r for r in args.rows.split(",") if r]
  if args.rows and args.runs:
    raise UserError("--rows applies to trained candidates, not --runs; pass one of the two")
  names = [c for c in args.candidates.split(",") if c]
  unknown = [c for c in names if c not in CANDIDATES]
  if unknown:
    raise UserError(f"--candidates: {unknown} unknown; choose from {', '.join(CANDIDATES)}")
  args.candidates = [DEFAULT] + [c for c in dict.fromkeys(names) if c != DEFAULT]
  if args.seeds < (0 if args.rows else 1):
    raise UserError(
      f"--seeds={args.seeds} must be at least 1 (0 only with --rows); pass --seeds=1 or more"
    )
  if args.rounds < 0 or args.first_seed < 0:
    raise UserError(
      f"--rounds={args.rounds} and --first_seed={args.first_seed} must be >= 0; pass "
      "non-negative values"
    )
  args.steps = args.steps or (600 if args.preset == "bench-small" else 0)
  args.steps = args.steps or default.get_config().num_train_steps
  k = args.solver_steps or (
    common.PRESETS["bench-small"]["model"]["solver_steps"]
    if args.preset == "bench-small"
    else default.get_config().model.solver_steps
  )
  if k < 2 or k % 2:
    raise UserError(
      f"--solver_steps={k}: K must be even and >= 2 (K/2 is evaluated); pass an even --solver_steps"
    )
  return args


def step_seconds(config, rounds: int, candidates: list) -> dict:
  """Candidate -> seconds per train step of the product's train step on the model of
  `config` with the candidate's fields (BASE and its own, whichever candidate `config`
  was made for), all timed in turn (median of `rounds`)."""
  cfg = config_lib.model_config(config, config.data.vocab_size)
  trainers = {
    c: common.Trainer(common.replace(cfg, **{**BASE, **CANDIDATES[c]}), seed=0) for c in candidates
  }
  batch = trainers[DEFAULT].batch(config.global_batch_size, config.seq_len)
  return common.time_alternating(
    {c: (lambda t=t: t.step(batch)) for c, t in trainers.items()}, rounds
  )


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
  return row, (
    f"{source} | ppl {_cells(row, config.model.solver_steps)} | max ratio {worst_ratio(row):.3f} | "
    f"eval tokens {stored['tokens']:,} | {trained:.0f}s"
  )


def _cells(row: dict, k: int) -> str:
  """'N=n ppl | …' of a row (label -> perplexity) of a model trained at K = k."""
  return " | ".join(f"N={n} {row[label]:.2f}" for label, n in step_counts(k).items())


def row_key(config) -> dict:
  """What a row's perplexities depend on: `common.run_key` (code version and config)
  without the tokenizer cache's path, which differs between workdirs and machines."""
  key = common.run_key(config)
  key["config"]["data"].pop("cache_dir", None)
  return key


def _first_difference(a, b, path: str = "") -> str:
  """The first path at which the JSON values `a` and `b` differ, with both values."""
  if isinstance(a, dict) and isinstance(b, dict):
    for name in sorted(set(a) | set(b)):
      if a.get(name) != b.get(name):
        return _first_difference(a.get(name), b.get(name), f"{path}.{name}" if path else name)
  return f"{path or 'value'} {a!r} (file) != {b!r} (this command)"


def read_rows(args, cache_dir: str) -> dict:
  """(candidate, seed) -> row entry of the `--rows` files, each checked against the run
  this command would make of it: same code version and config (`row_key`). A row of a
  candidate not in --candidates is left out; one found twice must agree."""
  rows = {}
  for path in args.rows:
    stored = common.read_json(path)
    if not isinstance(stored, dict) or not isinstance(stored.get("rows"), list):
      raise UserError(
        f"--rows: {path} is not an any_n rows file (missing or unreadable); pass the "
        f"{ROWS_FILE} of an any_n workdir"
      )
    for entry in stored["rows"]:
      c, seed = entry["candidate"], int(entry["seed"])
      if c not in args.candidates:
        continue
      want = row_key(make_config(args, c, seed, cache_dir))
      if entry["key"] != want:
        raise UserError(
          f"--rows: {path}'s {c} seed {seed} was made under another run: "
          f"{_first_difference(entry['key'], want)}; run this command from the code (and "
          "with the flags) that made it, or train the seed here"
        )
      if (c, seed) in rows and rows[c, seed]["perplexity"] != entry["perplexity"]:
        raise UserError(
          f"--rows: {c} seed {seed} is in two files with other perplexities ({path}); "
          "pass one of them"
        )
      rows[c, seed] = entry
  return rows


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
    + "   max(ppl(2K), ppl(4K)) / ppl(K)"
  )
  for name, row, worst in rows:
    print(f"{name:40s} " + " ".join(f"{v:9.2f}" for v in row.values()) + f"   {worst:.3f}")
  for name, _, worst in rows:
    print(f"any-N ({name}): max(ppl(2K), ppl(4K)) / ppl(K) = {worst:.3f}")


def summarise(ppl: dict, seconds: dict | None) -> dict:
  """Candidate -> {mean, std (label -> value), ratios, targets met} from the per-seed rows."""
  out = {}
  fixed_k = statistics.fmean(row["K"] for row in ppl[DEFAULT])
  for c, rows in ppl.items():
    mean = {label: statistics.fmean(r[label] for r in rows) for label in rows[0]}
    std = {
      label: (statistics.stdev(r[label] for r in rows) if len(rows) > 1 else 0.0)
      for label in rows[0]
    }
    ratios = {
      "finer": worst_ratio(mean),
      "half": mean["K/2"] / mean["K"],
      "k_cost": mean["K"] / fixed_k,
      "step_cost": seconds[c] / seconds[DEFAULT] if seconds else math.nan,
    }
    meets = (
      ratios["finer"] <= MAX_FINER_RATIO
      and ratios["half"] <= MAX_HALF_RATIO
      and ratios["k_cost"] <= MAX_K_COST
      and (not seconds or ratios["step_cost"] <= MAX_STEP_COST)
    )
    out[c] = {"mean": mean, "std": std, "ratios": ratios, "meets": meets}
  return out


def choose(summary: dict) -> str:
  """The candidate meeting every target with the lowest ppl(K); 'fixed' when none (other
  than it) does."""
  ok = [c for c, s in summary.items() if s["meets"] and c != DEFAULT]
  return min(ok, key=lambda c: summary[c]["mean"]["K"]) if ok else DEFAULT


def write_plot(path: str, summary: dict, counts: dict, title: str) -> None:
  """Perplexity against N (log-log), one curve per candidate with ± std bars."""
  from matplotlib.figure import Figure  # lazy: matplotlib only for the plot

  fig = Figure(figsize=(7, 4.5))
  ax = fig.add_subplot()
  ns = list(counts.values())
  for c, s in summary.items():
    ax.errorbar(
      ns,
      [s["mean"][lb] for lb in counts],
      yerr=[s["std"][lb] for lb in counts],
      marker="o",
      capsize=3,
      label=c,
    )
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(ns, [f"{n}\n({lb})" for lb, n in counts.items()])
  ax.set_xlabel("solver steps N")
  ax.set_ylabel("eval perplexity")
  ax.set_title(title)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  args = parse_args(argv)
  logging.set_verbosity(logging.WARNING)
  quiet_tool_logs()
  if args.runs:
    score_runs(args.runs, args.data, args.eval_batches)
    return
  root = args.workdir or tempfile.mkdtemp(prefix="odet_any_n_")
  print(f"workdir {root}", flush=True)
  os.makedirs(root, exist_ok=True)
  cache = os.path.join(root, "cache")
  rows = read_rows(args, cache)  # (candidate, seed) -> entry
  for path in args.rows:
    print(f"rows read from {path}", flush=True)
  rows_path = os.path.join(root, ROWS_FILE)
  config = make_config(args, DEFAULT, args.first_seed, cache)  # the timing's, without runs
  for seed in range(args.first_seed, args.first_seed + args.seeds):
    for c in args.candidates:
      config = make_config(args, c, seed, cache)
      if (c, seed) in rows:
        print(
          f"seed {seed} {c:20s} read from --rows: ppl "
          f"{_cells(rows[c, seed]['perplexity'], config.model.solver_steps)}",
          flush=True,
        )
        continue
      row, line = train_and_score(config, os.path.join(root, f"{c}_seed{seed}"), args.eval_batches)
      rows[c, seed] = {"candidate": c, "seed": seed, "key": row_key(config), "perplexity": row}
      common.write_json(rows_path, {"rows": list(rows.values())})
      print(f"seed {seed} {c:20s} {line}", flush=True)
  common.write_json(rows_path, {"rows": list(rows.values())})
  seeds = sorted({seed for _, seed in rows})
  missing = [f"{c} seed {s}" for s in seeds for c in args.candidates if (c, s) not in rows]
  if missing:
    raise UserError(
      f"no row for {', '.join(missing)}: every candidate needs every seed of the table; "
      "train them (--first_seed, --seeds) or pass the --rows files that hold them"
    )
  ppl = {c: [rows[c, s]["perplexity"] for s in seeds] for c in args.candidates}

  k = config.model.solver_steps
  counts = step_counts(k)
  seconds = step_seconds(config, args.rounds, args.candidates) if args.rounds else None
  summary = summarise(ppl, seconds)
  print(
    f"\nperplexity, mean ± std of seed(s) {', '.join(map(str, seeds))}; {args.preset}, "
    f"{args.steps} steps, K = {k}, {args.eval_batches} eval batches:"
  )
  print(
    "| candidate | "
    + " | ".join(f"N = {n} ({lb})" for lb, n in counts.items())
    + " | max(2K, 4K)/K | K/2 / K | K / fixed's K | step / fixed's | targets |"
  )
  print("|---|" + "---|" * (len(counts) + 5))
  for c, s in summary.items():
    r = s["ratios"]
    cells = " | ".join(f"{s['mean'][lb]:.2f} ± {s['std'][lb]:.2f}" for lb in counts)
    step = f"{r['step_cost']:.3f}" if seconds else "not timed"
    print(
      f"| {c} | {cells} | {r['finer']:.3f} | {r['half']:.3f} | {r['k_cost']:.4f} | {step} | "
      f"{'met' if s['meets'] else 'not met'} |"
    )
  if seconds:
    print(
      "train step seconds (median of "
      f"{args.rounds} interleaved rounds): "
      + ", ".join(f"{c} {sec * 1e3:.1f} ms" for c, sec in seconds.items())
    )
  plot = os.path.join(root, "any_n.png")
  write_plot(plot, summary, counts, f"any N: {args.preset}, K = {k}, {len(seeds)} seed(s)")
  common.write_json(os.path.join(root, "any_n_summary.json"), summary)
  print(f"plot written to {plot}")
  chosen = choose(summary)
  print(
    f"any-N: chosen {chosen}: max(ppl(2K), ppl(4K)) / ppl(K) = "
    f"{summary[chosen]['ratios']['finer']:.3f}"
  )


if __name__ == "__main__":
  errors.run_cli(main)
