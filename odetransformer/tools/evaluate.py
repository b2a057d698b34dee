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
(perplexity against N, the training K marked) as a PNG.

The model is restored sharded on the run's mesh (`config.mesh.shape` over all devices)
or `--mesh_shape`; batches go in as global arrays split over its batch axes (padded
with weight-0 rows to a multiple of them). Launched on several hosts like main.py it
runs under `jax.distributed`, every process reading the same batches; process 0 prints
and writes the plot. Every flag is checked (the --plot path by a probe write) before
anything is loaded.
"""
import contextlib
import dataclasses
import functools
import logging as std_logging
import math
import os
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from odetransformer.errors import UserError
from odetransformer.model.config import model_config
from odetransformer.model.transformer import LanguageModel
from odetransformer.runtime import fileio, host
from odetransformer.runtime.logs import quiet_library_logs
from odetransformer.train import loading, sharding
from odetransformer.train.losses import token_scores

_LOCAL_PREFIX = "local:"


def quiet_orbax(cli: bool = False) -> None:
  """Hides orbax's non-error log lines (tools that only restore a model); for a
  command line (`cli`), also absl INFO lines of other libraries."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  if cli and absl_logging.get_verbosity() >= absl_logging.INFO:
    absl_logging.set_verbosity(absl_logging.WARNING)
  quiet_library_logs(std_logging.ERROR)


# --------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------
def _score_batch(graphdef, num_steps, rules, state, batch):
  """(sum of weighted target NLL, sum of weights, weighted correct argmax), float32."""
  model = nnx.merge(graphdef, state)
  logits = model(batch["inputs"], segment_ids_bl=batch.get("segment_ids"),
                 positions_bl=batch.get("positions"), num_steps=num_steps,
                 param_rules=rules)   # generated W(t) sharded as the parameters are
  scores = token_scores(logits, batch["targets"], batch["weights"])
  return tuple(jnp.sum(scores[k]) for k in ("nll", "weight", "correct"))


@dataclasses.dataclass
class Result:
  """Perplexity of one model at one step count."""
  num_steps: int
  num_tokens: int
  loss: float          # mean NLL per token (nats)
  perplexity: float
  accuracy: float      # next-token argmax accuracy
  seconds: float


def global_batch(batch: dict, mesh: jax.sharding.Mesh, rules) -> dict:
  """A batch every process holds in full (numpy [rows, ...]) as global arrays on `mesh`,
  rows split by the 'batch' rule; padded with weight-0 rows to a multiple of its shards
  (same scores: a padded row has no weight)."""
  shards = sharding.num_batch_shards(mesh, rules)
  rows = next(iter(batch.values())).shape[0]
  pad = -rows % shards
  out = {}
  for key, x in batch.items():
    x = np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x
    spec = sharding.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), rules)
    out[key] = loading.global_array(x, jax.sharding.NamedSharding(mesh, spec))
  return out


def evaluate_model(model: LanguageModel, batches: Iterable[dict],
                   num_steps: Optional[int] = None, rules=None) -> Result:
  """Token-weighted NLL over `batches` (dicts with inputs, targets, weights and
  optionally segment_ids, positions), summed in float64 on the host.

  A model on a mesh (`loading.load_model`) gets each batch as global arrays split by
  the 'batch' rule of `rules` (default: the default rules) and traces under the mesh
  and the rules, as the training eval step does; every process passes the same batches.
  """
  k = model.resolve_num_steps(num_steps)
  graphdef, state = nnx.split(model)
  mesh = loading.model_mesh(state)
  rules = sharding.logical_axis_rules(None) if rules is None else tuple(rules)
  score = jax.jit(functools.partial(_score_batch, graphdef, k, rules))
  nll, count, correct = 0.0, 0.0, 0.0
  t0 = time.perf_counter()
  for batch in batches:
    batch = {key: np.asarray(batch[key]) for key in
             ("inputs", "targets", "weights", "segment_ids", "positions") if key in batch}
    if mesh is not None:
      batch = global_batch(batch, mesh, rules)
    with mesh_context(mesh, rules) if mesh is not None else contextlib.nullcontext():
      s_nll, s_w, s_c = jax.device_get(score(state, batch))
    nll, count, correct = nll + float(s_nll), count + float(s_w), correct + float(s_c)
  if count == 0:
    raise UserError("the evaluation data holds no scored tokens; fix: evaluate on a split "
                    "with at least seq_len + 1 tokens of text")
  loss = nll / count
  return Result(num_steps=k, num_tokens=int(round(count)), loss=loss,
                perplexity=math.exp(min(loss, 700.0)), accuracy=correct / count,
                seconds=time.perf_counter() - t0)


@contextlib.contextmanager
def mesh_context(mesh, rules):
  """The mesh and the activation rules a sharded forward pass is traced (and run) under,
  as the training steps are."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.activation_rules(rules)):
    yield


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class EvalData:
  batches: Callable[[], Iterator[dict]]   # a fresh pass over the split per call
  description: str


def eval_data(workdir: str, config: ml_collections.ConfigDict, *, data: str = "",
              split: str = "", data_dir: str = "", seq_len: int = 0, batch_size: int = 0,
              max_batches: int = 0, tokenizer_path: str = "") -> EvalData:
  """The eval pass of the run's data config, with the given overrides.

  Args:
    workdir: the run (its data cache is reused).
    config: the run's ConfigDict.
    data: '' (the run's source), a `data.source` string, or 'local:<globs>'.
    split: eval split for TFDS-style sources ('' = the run's, or the source's default).
    data_dir: TFDS data_dir ('' = the run's).
    seq_len, batch_size: rows of the eval batches (0 = the run's seq_len / eval_batch_size).
    max_batches: stop after this many batches (0 = the whole split).
    tokenizer_path: the run's tokenizer ('' = `loading.tokenizer_path`).
  """
  import input_pipeline  # pylint: disable=g-import-not-at-top
  d = ml_collections.ConfigDict(config.data.to_dict())
  d.tokenizer_path = tokenizer_path or loading.tokenizer_path(workdir, config)
  if data.startswith(_LOCAL_PREFIX):
    globs = data[len(_LOCAL_PREFIX):]
    d.source, d.eval_files, d.train_files = "local", globs, globs  # train: unused, must exist
  elif data:
    d.source = data
  if split:
    if d.source in ("embedded", "local"):
      raise UserError(f"--split applies to TFDS-style sources, not {d.source!r}; "
                       "evaluate other text with --data=local:<glob>")
    d.eval_split = split
  if data_dir:
    d.data_dir = data_dir
  d.eval_max_batches = int(max_batches)
  seq_len = int(seq_len or config.seq_len)
  batch_size = int(batch_size or config.eval_batch_size)
  ds = input_pipeline.create_datasets(d, seq_len=seq_len, global_batch_size=batch_size,
                                      eval_batch_size=batch_size, seed=int(config.seed),
                                      workdir=workdir, process_index=0, process_count=1)
  if d.source == "local":
    where = f"files {d.eval_files}"
  elif d.source == "embedded":
    where = "validation files"
  else:
    where = f"split {d.eval_split!r}" if d.eval_split else "validation/test split"
  return EvalData(batches=ds.eval_batches,
                  description=f"{d.source} ({where}), rows of {seq_len} tokens, "
                              f"batches of {batch_size}")


def evaluate(workdir: str, num_steps: Sequence[Optional[int]] = (None,), *, step=None,
             mesh_shape: str = "", **data_kwargs) -> list:
  """Loads the checkpoint (on the run's mesh, or `mesh_shape`) and returns a `Result` per
  entry of `num_steps`."""
  from odetransformer.train.loading import load_model  # pylint: disable=g-import-not-at-top
  loaded = load_model(workdir, step=step, mesh_shape=mesh_shape)
  for n in num_steps:
    loaded.model.resolve_num_steps(n)  # fail before reading data
  data = eval_data(workdir, loaded.config, **data_kwargs)
  return [evaluate_model(loaded.model, data.batches(), n, loaded.rules) for n in num_steps]


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
    raise UserError(f"--solver_steps={text!r}: expected comma-separated integers") from e
  if not steps or min(steps) <= 0:
    raise UserError(f"--solver_steps={text!r}: step counts must be positive integers, e.g. "
                    "--solver_steps=6,12")
  return steps


def check_writable(path: str, flag: str) -> None:
  """Fails now, in one line, if the file `path` could not be written at the end (a
  probe file is written beside it and removed)."""
  if fileio.isdir(path):
    raise UserError(f"--{flag}={path} is a directory; pass a file path")
  parent = os.fspath(fileio.path(path).parent)
  if fileio.is_local(parent) and not fileio.isdir(parent):   # object stores: no dirs
    raise UserError(f"--{flag}={path}: its directory does not exist; create it or pick "
                    "another path")
  probe = fileio.join(parent, f".{fileio.path(path).name}.probe-{os.getpid()}")
  try:
    fileio.write_bytes_atomic(probe, b"")
    fileio.remove(probe)
  except OSError as e:
    raise UserError(f"--{flag}={path} cannot be written ({e.strerror or e}); pick a "
                    "writable path") from e


def check_flags(f) -> tuple:
  """Every flag of the command checked before any work: (step counts, run config)."""
  steps = parse_num_steps(f.solver_steps)
  for name in ("seq_len", "batch_size", "max_batches"):
    if getattr(f, name) < 0:
      raise UserError(f"--{name}={getattr(f, name)} must be >= 0 (0 = the run's)")
  if f.step is not None and f.step < 0:
    raise UserError(f"--step={f.step} must be a checkpoint step >= 0 (or left out)")
  loading.parse_mesh_shape(f.mesh_shape)
  if f.plot:
    check_writable(f.plot, "plot")
  config = loading.load_run_config(f.workdir)
  cfg = model_config(config, vocab_size=config.data.get("vocab_size"))
  seq_len = f.seq_len or int(config.seq_len)
  if cfg.family == "gpt2" and seq_len > cfg.max_len:
    raise UserError(f"--seq_len={seq_len} exceeds the model's {cfg.max_len} learned "
                    f"positions (model.max_len); pass --seq_len={cfg.max_len} or less")
  return steps, config


def format_table(results: Sequence[Result], trained_k: int) -> str:
  lines = [f"{'N':>5} {'tokens':>10} {'loss':>8} {'perplexity':>12} {'accuracy':>9} {'time':>7}"]
  for r in results:
    mark = "  (training K)" if r.num_steps == trained_k else ""
    lines.append(f"{r.num_steps:>5} {r.num_tokens:>10,} {r.loss:>8.4f} {r.perplexity:>12.3f} "
                 f"{r.accuracy:>9.4f} {r.seconds:>6.1f}s{mark}")
  return "\n".join(lines)


def plot_table(results: Sequence[Result], trained_k: int, title: str = ""):
  """Perplexity against N (log-2 axis, the training K marked) as a matplotlib Figure,
  made without pyplot, so no global figure state or display backend is touched."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
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


def main(argv, flag_values=None):
  """The command line (flags: `define_flags`); `flag_values` defaults to absl's FLAGS.

  Runs on the job's devices (several processes: `jax.distributed`, as main.py); only
  process 0 prints and writes the plot."""
  if len(argv) > 1:
    raise UserError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  from absl import flags  # pylint: disable=g-import-not-at-top

  from odetransformer.train.loading import load_model  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS if flag_values is None else flag_values
  quiet_orbax(cli=True)
  # Every mistake in the flags is a UserError: one line and exit 2 (errors.run_cli).
  steps, _ = check_flags(f)
  host.initialize_distributed()
  loaded = load_model(f.workdir, step=f.step, mesh_shape=f.mesh_shape,
                      allow_unverified=f.checkpoint_allow_unverified)
  cfg = loaded.model_config
  for n in steps:
    try:
      loaded.model.resolve_num_steps(n)
    except ValueError as e:
      raise UserError(f"--solver_steps={n}: {e}") from e
  data = eval_data(f.workdir, loaded.config, data=f.data, split=f.split,
                   data_dir=f.data_dir, seq_len=f.seq_len, batch_size=f.batch_size,
                   max_batches=f.max_batches)
  say = print if jax.process_index() == 0 else lambda *_: None
  say(f"checkpoint step {loaded.step} of {f.workdir}: {cfg.kind}/{cfg.family}"
      + (f", {cfg.solver} solver" if cfg.is_ode else "") + f", trained at K={cfg.depth}")
  say(f"data: {data.description}" + (f", first {f.max_batches} batches" if f.max_batches
                                    else ", whole split"))
  results = []
  for n in steps:
    results.append(evaluate_model(loaded.model, data.batches(), n, loaded.rules))
  say(format_table(results, cfg.depth))
  if f.plot and jax.process_index() == 0:
    fig = plot_table(results, cfg.depth, title=f"{f.workdir} (step {loaded.step})")
    fileio.write_figure(f.plot, fig, format="png", dpi=120)
    say(f"plot: {f.plot}")


def define_flags(flag_values=None):
  """Defines this command's flags in `flag_values` (default: absl's global FLAGS)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  fv = flags.FLAGS if flag_values is None else flag_values
  define = lambda kind, name, default, text: getattr(flags, f"DEFINE_{kind}")(
      name, default, text, flag_values=fv)
  define("string", "workdir", None, "Training run directory (config.json + checkpoints/).")
  define("string", "solver_steps", "",
         "Comma-separated solver step counts N (ODE kinds); '' = the training K.")
  define("integer", "step", None, "Checkpoint step (default: the latest).")
  define("string", "data", "", "Data source ('' = the run's config.data.source), e.g. "
         "'tfds:lm1b', 'wikitext103', or 'local:<comma-separated globs>'.")
  define("string", "split", "", "Eval split of TFDS-style sources ('' = the run's).")
  define("string", "data_dir", "", "TFDS data_dir ('' = the run's).")
  define("integer", "seq_len", 0, "Tokens per row (0 = the run's seq_len).")
  define("integer", "batch_size", 0, "Rows per batch (0 = the run's eval_batch_size).")
  define("integer", "max_batches", 0, "Stop after this many batches (0 = the whole split).")
  define("string", "plot", "", "Also write perplexity against N as a PNG to this path.")
  loading.define_load_flags(define, fv)
  return fv


if __name__ == "__main__":
  from odetransformer import errors  # pylint: disable=g-import-not-at-top
  errors.run_absl_tool(main, define_flags)
