r"""Perplexity of a trained model over a whole split, at one or several solver step counts.

  python -m odetransformer.evaluate --workdir=W [--solver_steps=6,9,12,18,24] \
      [--data=SOURCE | --data=local:GLOB] [--split=SPLIT] [--data_dir=DIR] \
      [--seq_len=L] [--batch_size=B] [--max_batches=0] [--step=S] [--plot=PATH.png] \
      [--mesh_shape=1,-1,1]

The data is the run's own `config.data` eval split unless `--data` names another
source (any `data.source` string: 'embedded', 'tfds:<name>', 'wikitext103', …, or
`local:<comma-separated globs>` for text files). It is read by the training
pipeline's eval pass (`input_pipeline.create_datasets(...).eval_batches()`): every token
of the split (each document and its eos) is a target exactly once, the last batch padded
and masked. Text is always tokenized with the run's own tokenizer.

ODE checkpoints are evaluated at each N of `--solver_steps` (default: the training K) by
the model's own N-step solve; discrete models only at their own depth. One compiled
scorer per N; every batch has the same shape. `--plot=PATH` also draws the table
(perplexity against N, the training K marked) as a PNG at PATH, a local path (relative
to the current directory: `--plot=W/ppl.png` keeps it beside the run) or a gs:// URL,
and prints the path it wrote (made absolute).

The model is restored sharded on the run's mesh (`config.mesh.shape` over all devices)
or `--mesh_shape`; batches go in as global arrays split over its batch axes (padded
with weight-0 rows to a multiple of them). Launched on several hosts like main.py it
runs under `jax.distributed`, every process reading the same batches; process 0 prints
and writes the plot. Every flag is checked (the --plot path by a probe write) before
anything is loaded.
"""

from collections.abc import Sequence
import os

from absl import flags
import jax

from odetransformer import cli_flags
from odetransformer.errors import UserError
from odetransformer.runtime import fileio, host
from odetransformer.runtime.logs import quiet_tool_logs
from odetransformer.train import loading

# The scorer and the data of every evaluation (train/evaluation.py), re-exported (hence
# the noqa); the command only parses flags and prints.
from odetransformer.train.evaluation import (  # noqa: F401
  LOCAL_DATA_PREFIX,
  EvalData,
  Result,
  eval_data,
  evaluate,
  evaluate_model,
)

LOCAL_DATA_FLAG = f"--data={LOCAL_DATA_PREFIX}"  # text files to score instead of the run's


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def parse_num_steps(text: str) -> list:
  """'6,9,12' -> [6, 9, 12]; '' -> [None] (the training K)."""
  if not text.strip():
    return [None]
  try:
    steps = [int(v) for v in text.split(",") if v.strip()]
  except ValueError as e:
    raise UserError(
      f"--solver_steps={text!r} is not a list of step counts; pass "
      "comma-separated integers, e.g. --solver_steps=6,12"
    ) from e
  if not steps or min(steps) <= 0:
    raise UserError(
      f"--solver_steps={text!r} holds a step count <= 0; pass positive "
      "integers, e.g. --solver_steps=6,12"
    )
  return steps


def check_writable(path: str, flag: str) -> None:
  """Fails now, in one line, if the file `path` could not be written at the end (a
  probe file is written beside it and removed)."""
  if fileio.isdir(path):
    raise UserError(f"--{flag}={path} is a directory; pass a file path")
  parent = os.fspath(fileio.path(path).parent)
  if fileio.is_local(parent) and not fileio.isdir(parent):  # object stores: no dirs
    raise UserError(
      f"--{flag}={path}: its directory does not exist; create it or pick another path"
    )
  probe = fileio.join(parent, f".{fileio.path(path).name}.probe-{os.getpid()}")
  try:
    fileio.write_bytes_atomic(probe, b"")
    fileio.remove(probe)
  except OSError as e:
    raise UserError(
      f"--{flag}={path} cannot be written ({e.strerror or e}); pick a writable path"
    ) from e


def check_flags(f) -> tuple:
  """Every flag of the command checked before any work: (step counts, run config)."""
  steps = parse_num_steps(f.solver_steps)
  for name in ("seq_len", "batch_size", "max_batches"):
    if getattr(f, name) < 0:
      raise UserError(
        f"--{name}={getattr(f, name)} is negative; pass a positive number, or "
        "0 (or nothing) for the run's own"
      )
  if f.step is not None and f.step < 0:
    raise UserError(
      f"--step={f.step} is not a checkpoint step; pass a step >= 0, or leave "
      "--step out for the latest"
    )
  loading.parse_mesh_shape(f.mesh_shape)
  if f.plot:
    check_writable(f.plot, "plot")
  if f.data.startswith(LOCAL_DATA_PREFIX):  # its files exist (named by this flag, not by
    from input_pipeline import sources  # the data.*_files it becomes); lazy: grain, TFDS

    sources.expand_globs(f.data[len(LOCAL_DATA_PREFIX) :], flag=LOCAL_DATA_FLAG)
  config = loading.load_run_config(f.workdir)
  cfg = config.model
  for n in steps:
    if n is not None and not cfg.is_ode and n != cfg.depth:
      raise UserError(
        f"--solver_steps={n}: this run is a discrete {cfg.kind!r} model of "
        f"{cfg.depth} layers, which runs only at that depth; leave "
        "--solver_steps out"
      )
  seq_len = f.seq_len or config.batch.seq_len
  if cfg.family == "gpt2" and seq_len > cfg.max_len:
    raise UserError(
      f"--seq_len={seq_len} exceeds the model's {cfg.max_len} learned "
      f"positions (model.max_len); pass --seq_len={cfg.max_len} or less"
    )
  return steps, config


def format_table(results: Sequence[Result], trained_k: int) -> str:
  lines = [f"{'N':>5} {'tokens':>10} {'loss':>8} {'perplexity':>12} {'accuracy':>9} {'time':>7}"]
  for r in results:
    mark = "  (training K)" if r.num_steps == trained_k else ""
    lines.append(
      f"{r.num_steps:>5} {r.num_tokens:>10,} {r.loss:>8.4f} {r.perplexity:>12.3f} "
      f"{r.accuracy:>9.4f} {r.seconds:>6.1f}s{mark}"
    )
  return "\n".join(lines)


def plot_table(results: Sequence[Result], trained_k: int, title: str = ""):
  """Perplexity against N (log-2 axis, the training K marked) as a matplotlib Figure,
  made without pyplot, so no global figure state or display backend is touched."""
  from matplotlib.figure import Figure  # lazy: matplotlib only for --plot

  fig = Figure(figsize=(6, 4), layout="constrained")
  ax = fig.add_subplot()
  ns = [r.num_steps for r in results]
  ax.plot(ns, [r.perplexity for r in results], "o-", label="perplexity")
  ax.axvline(trained_k, color="gray", linestyle="--", label=f"training K = {trained_k}")
  ax.set_xscale("log", base=2)
  ax.set_xticks(ns, [str(n) for n in ns])
  ax.set_xlabel("solver steps N")
  ax.set_ylabel("perplexity")
  ax.set_title(title, fontsize=9)
  ax.legend()
  return fig


def describe_solve(cfg) -> str:
  """How each N below is solved, and on what grid the model was trained."""
  if not cfg.is_ode:
    return f"solve: the {cfg.depth} layers (a discrete model has no other N)"
  where = "start, t_k" if cfg.step_time == "start" else "end, t_(k+1)"
  trained = f"{cfg.train_time_grid!r} grid"
  if cfg.train_time_grid != "fixed":
    if cfg.train_time_grid_fraction < 1.0:
      trained += f" on {cfg.train_time_grid_fraction:g} of the batches, else 'fixed'"
  return (
    f"solve: {cfg.solver}, N uniform steps t_k = k/N, the field of step k at its {where} "
    f"(step_time={cfg.step_time!r}); trained at K={cfg.depth} on the {trained}"
    + (f", time_scale {cfg.time_scale:g}" if cfg.time_scale != 1000.0 else "")
  )


def main(argv, flag_values=None):
  """The command line (flags: `define_flags`); `flag_values` defaults to absl's FLAGS.

  Runs on the job's devices (several processes: `jax.distributed`, as main.py); only
  process 0 prints and writes the plot."""
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  f = flags.FLAGS if flag_values is None else flag_values
  quiet_tool_logs(cli=True)
  # Every mistake in the flags is a UserError: one line and exit 2 (errors.run_cli).
  steps, _ = check_flags(f)
  host.initialize_distributed()
  loaded = loading.load_model(
    f.workdir, step=f.step, mesh_shape=f.mesh_shape, allow_unverified=f.checkpoint_allow_unverified
  )
  cfg = loaded.model_config
  data = eval_data(
    f.workdir,
    loaded.config,
    data=f.data,
    split=f.split,
    data_dir=f.data_dir,
    seq_len=f.seq_len,
    batch_size=f.batch_size,
    max_batches=f.max_batches,
  )
  say = print if jax.process_index() == 0 else lambda *_: None
  say(
    f"checkpoint step {loaded.step} of {f.workdir}: {cfg.kind}/{cfg.family}"
    + (f", {cfg.solver} solver" if cfg.is_ode else "")
    + f", trained at K={cfg.depth}"
  )
  say(describe_solve(cfg))
  say(
    f"data: {data.description}"
    + (f", first {f.max_batches} batches" if f.max_batches else ", whole split")
  )
  results = []
  for n in steps:
    results.append(evaluate_model(loaded.model, data.batches(), n, loaded.rules))
  say(format_table(results, cfg.depth))
  if f.plot and jax.process_index() == 0:
    fig = plot_table(results, cfg.depth, title=f"{f.workdir} (step {loaded.step})")
    fileio.write_figure(f.plot, fig, format="png", dpi=120)
    say(f"plot written to {fileio.absolute(f.plot)}")


def define_flags(flag_values=None):
  """Defines this command's flags in `flag_values` (default: absl's global FLAGS)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  define = cli_flags.definer(fv)
  define(
    "string",
    "solver_steps",
    "",
    "Comma-separated solver step counts N (ODE kinds); '' = the training K.",
  )
  define(
    "string",
    "data",
    "",
    "Data source ('' = the run's config.data.source), e.g. "
    "'tfds:lm1b', 'wikitext103', or 'local:<comma-separated globs>'.",
  )
  define("string", "split", "", "Eval split of TFDS-style sources ('' = the run's).")
  define("string", "data_dir", "", "TFDS data_dir ('' = the run's).")
  define("integer", "seq_len", 0, "Tokens per row (0 = the run's seq_len).")
  define("integer", "batch_size", 0, "Rows per batch (0 = the run's eval_batch_size).")
  define("integer", "max_batches", 0, "Stop after this many batches (0 = the whole split).")
  define(
    "string",
    "plot",
    "",
    "Also write perplexity against N as a PNG to this path (a relative one is relative to "
    "the current directory; e.g. <workdir>/ppl.png) or gs:// URL.",
  )
  loading.define_load_flags(define)
  return fv


if __name__ == "__main__":
  cli_flags.run_absl_tool(main, define_flags)
