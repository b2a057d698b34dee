"""The one evaluation path: a model's token scores on batches of text.

`score_rows` is the scorer every evaluation runs — the train loop's eval step
(`steps.make_eval_step`, pre-training and fine-tuning), `python -m
odetransformer.evaluate`, the lm-eval adapter and the benchmarks that score a run
(`benchmarks.any_n`): the model's deterministic forward pass at N solver steps, then
`losses.token_scores`. What differs between them is only where the rows come from:

- the train loop reads each process's own rows of the eval split
  (`steps.local_batch`, then `sharding.global_batch_from_local`), a bounded number of
  batches (`data.eval_max_batches`), summed on device into `metrics.EvalMetrics`;
- a tool reads the same whole batch on every process (`global_batch_from_full`) and,
  here, sums per batch in float64 on the host (`evaluate_model`) over the whole split
  (`eval_data`), at any N.
"""

from collections.abc import Callable, Iterable, Iterator, Sequence
import contextlib
import dataclasses
import functools
import math
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from odetransformer.errors import UserError
from odetransformer.model.transformer import LanguageModel
from odetransformer.train import loading, sharding
from odetransformer.train.losses import token_scores
from odetransformer.train.run_config import RunConfig

# The keys of a batch the model reads; `weights` defaults to ones.
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")
LOCAL_DATA_PREFIX = "local:"  # `eval_data(data=...)`: text files instead of a source


# --------------------------------------------------------------------------------------
# The scorer
# --------------------------------------------------------------------------------------
def score_rows(model: LanguageModel, batch: dict, rules=None, num_steps: int | None = None) -> dict:
  """`losses.token_scores` per row of `batch` under the model's deterministic forward
  pass at `num_steps` solver steps (None: the training K; discrete models: their depth).

  `rules`: the parameter logical-axis rules; on a mesh, weights generated in the call
  (DiffEqFormer's W(t)) are sharded as their parameters are, not held whole by every
  device. Trace it under the activation rules (`mesh_context`).
  """
  logits = model(
    batch["inputs"],
    segment_ids_bl=batch.get("segment_ids"),
    positions_bl=batch.get("positions"),
    num_steps=num_steps,
    param_rules=rules,
  )
  return token_scores(logits, batch["targets"], batch.get("weights"))


def score_sums(
  model: LanguageModel, batch: dict, rules=None, num_steps: int | None = None
) -> tuple:
  """(Σ weighted target NLL, Σ weights, Σ weighted argmax hits) of `score_rows`."""
  scores = score_rows(model, batch, rules, num_steps)
  return tuple(jnp.sum(scores[k]) for k in ("nll", "weight", "correct"))


# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------
def host_batch(batch, rows: int | None = None) -> dict:
  """The model's keys of `batch` as numpy (weights: ones where absent), padded to `rows`
  rows with weight-0 rows (a short last batch; a padded row scores nothing)."""
  out = {key: np.asarray(batch[key]) for key in BATCH_KEYS if key in batch}
  if "weights" not in out:  # before padding: the padded rows get weight 0
    out["weights"] = np.ones(out["targets"].shape, np.float32)
  have = out["targets"].shape[0]
  if rows is not None and have < rows:
    for key, x in out.items():
      out[key] = np.pad(x, [(0, rows - have)] + [(0, 0)] * (x.ndim - 1))
  return out


def global_batch_from_full(batch: dict, mesh: jax.sharding.Mesh, rules) -> dict:
  """A batch every process holds in full (numpy [rows, …]) as global arrays on `mesh`,
  rows split by the 'batch' rule of `rules`; padded with weight-0 rows to a multiple of
  the batch shards. (The train loop's batches are per process instead:
  `sharding.global_batch_from_local`.)"""
  shards = sharding.num_batch_shards(mesh, rules)
  rows = next(iter(batch.values())).shape[0]
  batch = host_batch(batch, rows + (-rows % shards))
  out = {}
  for key, x in batch.items():
    spec = sharding.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), rules)
    out[key] = loading.global_array(x, jax.sharding.NamedSharding(mesh, spec))
  return out


@contextlib.contextmanager
def mesh_context(mesh, rules):
  """The mesh and the activation rules a sharded forward pass is traced (and run) under,
  as the training steps are."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.activation_rules(rules)):
    yield


# --------------------------------------------------------------------------------------
# A whole split, on the host
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
  """Perplexity of one model at one step count."""

  num_steps: int
  num_tokens: int
  loss: float  # mean NLL per token (nats)
  perplexity: float
  accuracy: float  # next-token argmax accuracy
  seconds: float


def _sums(graphdef, num_steps, rules, state, batch):
  return score_sums(nnx.merge(graphdef, state), batch, rules, num_steps)


# The jitted scorers made in this process: (graphdef, num_steps, rules, jitted), the
# newest last, a few models' worth. A model scored on several splits or files (the
# benchmarks' evaluation texts), or loaded again, is traced and lowered once, not per call.
_SCORERS: list = []
_MAX_SCORERS = 8


def _scorer(graphdef, num_steps: int, rules: tuple):
  """The jitted `_sums` of this model structure, step count and rules (GraphDefs compare
  by structure: equal ones merge with each other's states)."""
  for g, k, r, jitted in _SCORERS:
    if k == num_steps and r == rules and g == graphdef:
      return jitted
  jitted = jax.jit(functools.partial(_sums, graphdef, num_steps, rules))
  _SCORERS.append((graphdef, num_steps, rules, jitted))
  del _SCORERS[:-_MAX_SCORERS]
  return jitted


def evaluate_model(
  model: LanguageModel, batches: Iterable[dict], num_steps: int | None = None, rules=None
) -> Result:
  """Token-weighted NLL over `batches` (dicts with inputs, targets and optionally
  weights, segment_ids, positions), summed per batch in float64 on the host.

  A model on a mesh (`loading.load_model`) gets each batch as global arrays split by
  the 'batch' rule of `rules` (default: the default rules) and traces under the mesh
  and the rules, as the training eval step does; every process passes the same batches.
  """
  k = model.resolve_num_steps(num_steps)
  graphdef, state = nnx.split(model)
  mesh = loading.model_mesh(state)
  rules = sharding.logical_axis_rules(None) if rules is None else tuple(rules)
  score = _scorer(graphdef, k, rules)
  nll, count, correct = 0.0, 0.0, 0.0
  t0 = time.perf_counter()
  for batch in batches:
    batch = host_batch(batch)
    if mesh is not None:
      batch = global_batch_from_full(batch, mesh, rules)
    with mesh_context(mesh, rules) if mesh is not None else contextlib.nullcontext():
      s_nll, s_w, s_c = jax.device_get(score(state, batch))
    nll, count, correct = nll + float(s_nll), count + float(s_w), correct + float(s_c)
  if count == 0:
    raise UserError(
      "the evaluation data holds no scored tokens; evaluate on a split "
      "with at least seq_len + 1 tokens of text"
    )
  loss = nll / count
  return Result(
    num_steps=k,
    num_tokens=int(round(count)),
    loss=loss,
    perplexity=math.exp(min(loss, 700.0)),
    accuracy=correct / count,
    seconds=time.perf_counter() - t0,
  )


@dataclasses.dataclass
class EvalData:
  batches: Callable[[], Iterator[dict]]  # a fresh pass over the split per call
  description: str


def eval_data(
  workdir: str,
  config: RunConfig,
  *,
  data: str = "",
  split: str = "",
  data_dir: str = "",
  seq_len: int = 0,
  batch_size: int = 0,
  max_batches: int = 0,
  tokenizer_path: str = "",
) -> EvalData:
  """The eval pass of the run's data config (every token of the split a target once,
  the last batch padded and masked), with the given overrides.

  Args:
    workdir: the run (its data cache is reused).
    config: the run's settings (`loading.load_run_config`).
    data: '' (the run's source), a `data.source` string, or 'local:<globs>'.
    split: eval split for TFDS-style sources ('' = the run's, or the source's default).
    data_dir: TFDS data_dir ('' = the run's).
    seq_len, batch_size: rows of the eval batches (0 = the run's seq_len / eval_batch_size).
    max_batches: stop after this many batches (0 = the whole split).
    tokenizer_path: the run's tokenizer ('' = `loading.tokenizer_path`).
  """
  import input_pipeline  # lazy: grain and TFDS only where data is read (not lm_eval, generate)

  d = {"tokenizer_path": tokenizer_path or loading.tokenizer_path(workdir, config)}
  source = config.data.source
  if data.startswith(LOCAL_DATA_PREFIX):
    globs = data[len(LOCAL_DATA_PREFIX) :]
    source = d["source"] = "local"
    d["eval_files"] = d["train_files"] = globs  # train: unused, must exist
  elif data:
    source = d["source"] = data
  if split:
    if source in ("embedded", "local"):
      raise UserError(
        f"--split applies to TFDS-style sources, not {source!r}; "
        "evaluate other text with --data=local:<glob>"
      )
    d["eval_split"] = split
  if data_dir:
    d["data_dir"] = data_dir
  d["eval_max_batches"] = int(max_batches)
  d = dataclasses.replace(config.data, **d)
  seq_len = int(seq_len or config.batch.seq_len)
  batch_size = int(batch_size or config.eval.batch_size)
  ds = input_pipeline.create_datasets(
    d,
    seq_len=seq_len,
    global_batch_size=batch_size,
    eval_batch_size=batch_size,
    seed=config.batch.seed,
    workdir=workdir,
    process_index=0,
    process_count=1,
  )
  if d.source == "local":
    where = f"files {d.eval_files}"
  elif d.source == "embedded":
    where = "validation files"
  else:
    where = f"split {d.eval_split!r}" if d.eval_split else "validation/test split"
  return EvalData(
    batches=ds.eval_batches,
    description=f"{d.source} ({where}), rows of {seq_len} tokens, batches of {batch_size}",
  )


def evaluate(
  workdir: str,
  num_steps: Sequence[int | None] = (None,),
  *,
  step=None,
  mesh_shape: str = "",
  **data_kwargs,
) -> list:
  """Loads the checkpoint (on the run's mesh, or `mesh_shape`) and returns a `Result` per
  entry of `num_steps` over `eval_data(workdir, config, **data_kwargs)`."""
  loaded = loading.load_model(workdir, step=step, mesh_shape=mesh_shape)
  for n in num_steps:
    loaded.model.resolve_num_steps(n)  # fail before reading data
  data = eval_data(workdir, loaded.config, **data_kwargs)
  return [evaluate_model(loaded.model, data.batches(), n, loaded.rules) for n in num_steps]
