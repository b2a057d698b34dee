"""Sharded training and evaluation: `train_and_evaluate(config, workdir)`.

One run: mesh + logical-axis rules from `config.mesh` → datasets (process-local
batches) → model and AdamW state created already sharded inside one jit (no full
replica on any host) → resume from the latest checkpoint in `workdir` if there is one →
a loop of one jitted, donated train step with periodic logging, evaluation and async
checkpoints → a final evaluation and save. A config with `init_from` is a fine-tuning
run (`odetransformer/finetune.py`): its model comes from that run, transformed by
`finetune.*`, and is evaluated once before the first step.

The train step is a pure function of (state, batch, rng): the state is
`nnx.state((model, optimizer))`, merged back into modules inside the jit. Its output
state is constrained to the shardings it was created with, so they never drift (unannotated
params would otherwise get whatever the compiler picks).
"""
import dataclasses
import functools
import math
import os
import shutil
import time
from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from clu import parameter_overview
from flax import nnx

from odetransformer import axes as axes_lib
from odetransformer import checkpointing
from odetransformer.errors import UserError
from odetransformer.workdir_lock import WorkdirLock
from odetransformer import metrics as metrics_lib
from odetransformer import optimizer as optimizer_lib
from odetransformer import sharding as sharding_lib
from odetransformer import time_grid as time_grid_lib
from odetransformer.config import ModelConfig
from odetransformer.losses import token_cross_entropy
from odetransformer.model import create_model


class ConfigError(UserError, ValueError):
  """A config value that cannot work (reported in one line: `errors.run_cli`)."""


class DivergenceError(UserError, RuntimeError):
  """The loss became NaN or infinite (the settings are at fault: one line, exit 2)."""


BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


# --------------------------------------------------------------------------------------
# Config resolution
# --------------------------------------------------------------------------------------
def model_config(config: ml_collections.ConfigDict, vocab_size: Optional[int] = None) -> ModelConfig:
  """The typed model config; `model.vocab_size` comes from the tokenizer (here only)."""
  model = ml_collections.ConfigDict(config.model.to_dict())
  if vocab_size is not None:
    model.vocab_size = int(vocab_size)
  try:
    return ModelConfig.from_config(model)
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e


def _check_config(config, mesh, rules):
  """Fails early, in one line, on settings that cannot work together."""
  for key in ("num_train_steps", "global_batch_size", "seq_len"):
    if int(config[key]) <= 0:
      raise ConfigError(f"{key}={config[key]} must be positive")
  for key in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
    if int(config[key]) < 0:
      raise ConfigError(f"{key}={config[key]} must be >= 0 (0 = only at the end)")
  shards = sharding_lib.num_batch_shards(mesh, rules)
  accum = int(config.optim.grad_accum_steps)
  if accum <= 0:
    raise ConfigError(f"optim.grad_accum_steps={accum} must be >= 1")
  if config.global_batch_size % (shards * accum):
    raise ConfigError(
        f"global_batch_size={config.global_batch_size} must be a multiple of the batch "
        f"shards ({shards}) × optim.grad_accum_steps ({accum})")
  if shards % jax.process_count():
    raise ConfigError(f"the batch is split {shards} ways (mesh data × fsdp) but there are "
                      f"{jax.process_count()} processes; make data × fsdp a multiple of the "
                      "process count (keep 'tensor' within a host)")
  if config.global_batch_size % jax.process_count():
    raise ConfigError(f"global_batch_size={config.global_batch_size} must be a multiple of "
                      f"the {jax.process_count()} processes")
  if config.eval_batch_size % shards or config.eval_batch_size % jax.process_count():
    raise ConfigError(f"eval_batch_size={config.eval_batch_size} must be a multiple of the "
                      f"batch shards ({shards}) and processes ({jax.process_count()})")
  if int(config.optim.get("skip_nonfinite_steps", 0)) < 0:
    raise ConfigError(f"optim.skip_nonfinite_steps={config.optim.skip_nonfinite_steps} must "
                      "be >= 0 (0 = stop at the first non-finite step)")
  if config.model.flavour == "gpt" and config.seq_len > config.model.max_len:
    raise ConfigError(f"seq_len={config.seq_len} exceeds model.max_len={config.model.max_len}")


# --------------------------------------------------------------------------------------
# State creation (sharded from birth)
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainState:
  """Static description of the (model, optimizer) state and its shardings."""
  graphdef: Any              # nnx.GraphDef of (model, optimizer)
  abstract: Any              # nnx.State of ShapeDtypeStructs with concrete shardings
  shardings: list            # flat NamedShardings, in jax.tree.leaves(state) order

  def constrain(self, state):
    """Pins every leaf of `state` to the sharding it was created with."""
    leaves, treedef = jax.tree.flatten(state)
    if len(leaves) != len(self.shardings):
      raise AssertionError(f"state has {len(leaves)} leaves, expected {len(self.shardings)}")
    leaves = [jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, self.shardings)]
    return jax.tree.unflatten(treedef, leaves)

  def split_abstract(self):
    """(abstract model state, abstract optimizer state)."""
    return self.abstract[0], self.abstract[1]


def _init_fn(cfg: ModelConfig, tx, seed: int):
  def init_fn():
    model = create_model(cfg, seed=seed)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
  return init_fn


def abstract_train_state(cfg: ModelConfig, tx, seed: int, mesh) -> TrainState:
  """The (model, optimizer) TrainState — shapes and shardings — allocating nothing.

  Must run under `nnx.logical_axis_rules(rules)`.
  """
  graphdef, abstract = nnx.get_abstract_model(_init_fn(cfg, tx, seed), mesh)
  return TrainState(graphdef=graphdef, abstract=abstract,
                    shardings=[a.sharding for a in jax.tree.leaves(abstract)])


def init_train_state(cfg: ModelConfig, tx, seed: int, mesh):
  """Creates (model, optimizer) state directly in its shardings.

  Must run under `nnx.logical_axis_rules(rules)`. Returns (TrainState, state).
  """
  ts = abstract_train_state(cfg, tx, seed, mesh)
  init_fn = _init_fn(cfg, tx, seed)

  @jax.jit
  def init():
    return ts.constrain(nnx.state(init_fn()))

  with jax.set_mesh(mesh):
    state = init()
  return ts, state


# --------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------
def _with_rules(rules, fn):
  """`fn` called under `nnx.logical_axis_rules(rules)` (which applies when it traces)."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with nnx.logical_axis_rules(rules):
      return fn(*args, **kwargs)
  return wrapped


_GRID_STREAM = 0x71D   # folded into a step's rng for its time grid (apart from dropout's)


def _forward_sums(model, batch, dropout_rng, time_grid=None):
  """(loss_sum, weight_sum, logits) for one (micro)batch; the loss in float32.
  `time_grid`: the solver's [K+1] grid (None: uniform)."""
  deterministic = dropout_rng is None
  logits = model(batch["inputs"], segment_ids_bl=batch.get("segment_ids"),
                 positions_bl=batch.get("positions"), deterministic=deterministic,
                 dropout_rng=dropout_rng, time_grid=time_grid)
  loss_sum, weight_sum = token_cross_entropy(logits.astype(jnp.float32), batch["targets"],
                                             batch["weights"])
  return loss_sum, weight_sum, logits


def _microbatches(batch, num: int, batch_spec):
  """[B, …] -> [num, B/num, …], microbatch j = rows j, j+num, … (balanced over shards)."""
  def split(x):
    y = x.reshape((x.shape[0] // num, num) + x.shape[1:]).swapaxes(0, 1)
    spec = jax.sharding.PartitionSpec(None, *batch_spec)
    return jax.lax.with_sharding_constraint(y, spec)
  return jax.tree.map(split, batch)


def make_train_step(ts: TrainState, schedule: Callable, rules, *, grad_accum_steps: int = 1,
                    use_dropout: bool = False, skip_nonfinite: bool = False) -> Callable:
  """The jitted step: (state, batch, rng) -> (state, TrainMetrics); state donated.

  `rules` are the (parameter) logical-axis rules; the step is traced under the
  derived activation rules (`sharding.activation_rules`). Call it under
  `jax.set_mesh(mesh)`.

  With `skip_nonfinite`, a step whose loss or gradient norm is NaN/inf returns the state
  it was given — parameters, Adam moments and every step counter (so the schedule does
  not advance either): the batch is consumed, nothing else happens. Its metrics report
  skipped=1 and leave the loss and gradient-norm means alone. The update sits in a
  `lax.cond` (~1% of a bench-small step on CPU; a `where` over the new and old state cost
  5% there: XLA kept both copies). Without it such a step is applied like any other and
  the loop stops at the next check (`_HealthCheck`).
  """
  batch_spec = sharding_lib.logical_to_spec(("batch", None), rules)

  def loss_fn(params, rest, graphdef, batch, rng, denominator):
    """Σ token losses / denominator (the whole batch's target count) and Σ losses.

    Dividing the scalar loss, not the gradients, keeps the mean out of the per-parameter
    passes (a divide over every gradient would be one more read and write of each).
    """
    model = nnx.merge(graphdef, params, rest)
    # model.train_time_grid: this batch's solver grid (None = uniform), its own stream.
    grid = time_grid_lib.train_time_grid(model.config, jax.random.fold_in(rng, _GRID_STREAM))
    loss_sum, _, _ = _forward_sums(model, batch, rng if use_dropout else None, grid)
    return loss_sum / denominator, loss_sum

  def apply_update(state, grads):
    model, optimizer = nnx.merge(ts.graphdef, state)
    optimizer.update(model, grads)   # clips by the global norm first (create_optimizer)
    return nnx.state((model, optimizer))

  def step(state, batch, rng):
    model, optimizer = nnx.merge(ts.graphdef, state)
    lr = schedule(optimizer.step[...])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    # The gradient is of the mean over all target tokens of the global batch (exact
    # under accumulation: every microbatch divides by the whole batch's count).
    weight_sum = jnp.sum(batch["weights"].astype(jnp.float32))
    denominator = jnp.maximum(weight_sum, 1.0)
    if grad_accum_steps == 1:
      (_, loss_sum), grads = grad_fn(params, rest, graphdef, batch, rng, denominator)
    else:
      micro = _microbatches(batch, grad_accum_steps, batch_spec)

      def body(carry, xs):
        g_acc, l_acc = carry
        mb, j = xs
        (_, l), g = grad_fn(params, rest, graphdef, mb, jax.random.fold_in(rng, j),
                            denominator)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + l), None

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
      (grads, loss_sum), _ = jax.lax.scan(
          body, (zeros, jnp.float32(0)), (micro, jnp.arange(grad_accum_steps)))
    # The norm of the whole (accumulated) gradient: the one the optimizer's clipping
    # takes too. Neither the updates nor the new parameters are reduced to norms here:
    # each would be one more pass over every parameter per step (the updates would also
    # stay in memory beside the new parameters). `make_param_norm` measures the
    # parameters when a log line or a checkpoint needs them; a non-finite update shows
    # there, and in the next step's loss.
    grad_norm = optax.global_norm(grads)
    applied = jnp.float32(1.0)
    if skip_nonfinite:
      ok = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
      new_state = jax.lax.cond(ok, apply_update, lambda state, _: state, state, grads)
      loss_sum, weight_sum, grad_norm = (jnp.where(ok, x, 0.0)
                                         for x in (loss_sum, weight_sum, grad_norm))
      applied = ok.astype(jnp.float32)
    else:
      new_state = apply_update(state, grads)
    out = metrics_lib.TrainMetrics.single_from_model_output(
        loss_sum=loss_sum, weight_sum=weight_sum, grad_norm=grad_norm, learning_rate=lr,
        applied=applied)
    return ts.constrain(new_state), out

  def traced_step(state, batch, rng):
    # Generated weights (DiffEqFormer's W(t)) are sharded as parameters, by `rules`;
    # set here, in the traced function, so that it holds however the step is lowered.
    with axes_lib.weight_rules(rules):
      return step(state, batch, rng)

  return _with_rules(sharding_lib.activation_rules(rules),
                    jax.jit(traced_step, donate_argnums=(0,)))


def make_param_norm(ts: TrainState) -> Callable:
  """The jitted global L2 norm of the model's parameters in a (model, optimizer) state."""
  @jax.jit
  def param_norm(state):
    model, _ = nnx.merge(ts.graphdef, state)
    return optax.global_norm(nnx.state(model, nnx.Param))
  return param_norm


def make_eval_step(ts: TrainState, rules) -> Callable:
  """The jitted eval step: (state, batch) -> EvalMetrics (deterministic forward)."""

  def step(state, batch):
    model, _ = nnx.merge(ts.graphdef, state)
    loss_sum, weight_sum, logits = _forward_sums(model, batch, None)
    correct = jnp.sum((jnp.argmax(logits, -1) == batch["targets"]) * batch["weights"])
    return metrics_lib.EvalMetrics.single_from_model_output(
        loss_sum=loss_sum, weight_sum=weight_sum, correct_sum=correct.astype(jnp.float32))

  return _with_rules(sharding_lib.activation_rules(rules), jax.jit(step))


# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------
def _local_batch(batch, local_batch_size: Optional[int] = None) -> dict:
  """The model's keys as numpy; pads a short (last eval) batch with weight-0 rows."""
  out = {}
  for key in BATCH_KEYS:
    if key not in batch:
      continue
    x = np.asarray(batch[key])
    if local_batch_size is not None and x.shape[0] < local_batch_size:
      pad = [(0, local_batch_size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
      x = np.pad(x, pad)
    out[key] = x
  if "weights" not in out:
    out["weights"] = np.ones(out["targets"].shape, np.float32)
  return out


def evaluate(eval_step, state, batches: Iterable, batch_sharding, local_batch_size: int,
             num_eval_steps: int = -1) -> dict:
  """Token-weighted loss, perplexity and accuracy over `batches` (at most num_eval_steps)."""
  merged = None
  for i, batch in enumerate(batches):
    if 0 <= num_eval_steps <= i:
      break
    gbatch = sharding_lib.global_batch_from_local(
        _local_batch(batch, local_batch_size), batch_sharding,
        local_batch_size * jax.process_count())
    m = eval_step(state, gbatch)
    merged = m if merged is None else merged.merge(m)
  if merged is None:
    return {}
  out = metrics_lib.summarize(merged.compute())
  out["num_tokens"] = float(merged.loss.count)
  return out


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------
def _every(step: int, every: int, last: int) -> bool:
  """The "every N steps or the last step" schedule (N = 0: last step only)."""
  return step == last or (every > 0 and step % every == 0)


def _overview(model_state) -> str:
  def stringify(d):
    return {str(k): stringify(v) if isinstance(v, dict) else v for k, v in d.items()}
  params = stringify(nnx.to_pure_dict(model_state.filter(nnx.Param)))
  return parameter_overview.get_parameter_overview(params, include_stats="global")


def _import_input_pipeline():
  import input_pipeline  # pylint: disable=g-import-not-at-top
  return input_pipeline


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (resuming from `workdir` when it holds checkpoints) and evaluates.

  Returns:
    {'start_step': step resumed from (0 if fresh), 'step': final step, 'train': last
    logged train scalars, 'eval': last eval scalars, 'loss_history': [(step, train
    loss)] at each log line, 'num_params': parameter count}.
  """
  input_pipeline = _import_input_pipeline()
  workdir = os.fspath(workdir)
  process_index, process_count = jax.process_index(), jax.process_count()
  if config.get("init_from"):
    config = _prepare_finetuning(config)

  # Validation first: a config error leaves the workdir untouched (nothing created).
  try:
    mesh = sharding_lib.make_mesh(config.mesh)
    rules = sharding_lib.logical_axis_rules(config.mesh)
  except sharding_lib.MeshError as e:
    raise ConfigError(str(e)) from e
  _check_config(config, mesh, rules)
  ode = model_config(config).is_ode  # fail on a bad model config before the data is prepared
  try:
    tx = optimizer_lib.create_optimizer(config.optim, config.num_train_steps, ode=ode)
    schedule = optimizer_lib.learning_rate_schedule(config.optim, config.num_train_steps)
  except optimizer_lib.OptimConfigError as e:
    raise ConfigError(str(e)) from e
  checkpointing.validate_options(config)
  stored = _check_resumable(config, workdir)
  # The first write of a run: one process per workdir (process 0 of a multi-host run).
  lock = WorkdirLock(workdir, enabled=process_index == 0).acquire()
  try:
    return _prepare_and_run(config, workdir, mesh, rules, tx, schedule, stored,
                            input_pipeline)
  finally:
    lock.release()


def _prepare_and_run(config, workdir, mesh, rules, tx, schedule, stored, input_pipeline):
  """`train_and_evaluate` from the data on, the workdir locked; `stored` is the
  fingerprint of the checkpoints there (None: none)."""
  process_index, process_count = jax.process_index(), jax.process_count()
  metrics_lib.log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} "
                  f"devices, {process_count} process(es)")

  # Data (process-local batches).
  ds = input_pipeline.create_datasets(
      config.data, seq_len=config.seq_len, global_batch_size=config.global_batch_size,
      eval_batch_size=config.eval_batch_size, seed=config.seed, workdir=workdir,
      process_index=process_index, process_count=process_count)

  fingerprint = _check_tokenizer(config, ds, workdir, stored)
  os.makedirs(workdir, exist_ok=True)
  _save_tokenizer(ds, workdir)

  # Model config (vocab from the tokenizer) and optimizer.
  cfg = model_config(config, ds.vocab_size)
  if cfg.vocab_size != config.model.vocab_size:
    metrics_lib.log(f"model.vocab_size set to {cfg.vocab_size} from the tokenizer")
  saved_config = ml_collections.ConfigDict(config.to_dict())
  saved_config.model.vocab_size = cfg.vocab_size
  if not saved_config.data.get("tokenizer_path") and getattr(ds, "tokenizer_path", ""):
    saved_config.data.tokenizer_path = ds.tokenizer_path   # for tools, beside tokenizer.model
  checkpointing.save_config(saved_config, workdir)

  writer = metrics_lib.MetricWriter(os.path.join(workdir, "tensorboard"))
  ckpt = checkpointing.Checkpointer(workdir, max_to_keep=config.checkpoint_max_to_keep,
                                    async_save=config.checkpoint_async,
                                    fingerprint=fingerprint)
  ckpt.install_sigterm_handler()   # SIGTERM and Ctrl-C: save at the current step, stop
  try:
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
      return _run(config, mesh, rules, ds, cfg, tx, schedule, saved_config, writer, ckpt,
                  input_pipeline)
  finally:
    ckpt.close()          # waits for a pending async save, restores the SIGTERM handler
    writer.close()


def _tokenizer_sha256(path: str) -> Optional[str]:
  return checkpointing.file_sha256(path) if path and os.path.isfile(path) else None


def _check_resumable(config, workdir: str) -> Optional[dict]:
  """ConfigError when `workdir` holds checkpoints of another model, data or tokenizer.

  Compares this config with the fingerprint the newest checkpoint records
  (`checkpointing.fingerprint`): model fields, data source and split, and — when
  `data.tokenizer_path` names a file — its hash; otherwise the settings that would train
  the tokenizer. Runs before anything is written (no tokenizer trained, no config.json
  rewritten), so a refused workdir stays exactly as it was.

  Returns:
    The stored fingerprint (None: no checkpoint).
  """
  found = checkpointing.stored_fingerprint(workdir)
  if found is None:
    return None
  step, stored = found
  new = checkpointing.fingerprint(config, _tokenizer_sha256(config.data.get("tokenizer_path")))
  _refuse_if_different(workdir, step, stored, new)
  return stored


def _refuse_if_different(workdir: str, step: int, stored: dict, new: dict):
  diffs = checkpointing.fingerprint_diffs(stored, new)
  if diffs:
    raise ConfigError(
        f"{workdir} holds checkpoints (step {step}) of a different model, data or "
        f"tokenizer ({'; '.join(diffs)}); resume with the same settings, start a new "
        "--workdir, or fine-tune from this run with --config.init_from")


def _check_tokenizer(config, ds, workdir: str, stored: Optional[dict]) -> dict:
  """The run's fingerprint, with its tokenizer's hash; ConfigError when a resumed run's
  tokenizer file differs from the checkpoints' (before it is copied into the workdir)."""
  new = checkpointing.fingerprint(config, _tokenizer_sha256(getattr(ds, "tokenizer_path", "")))
  if stored is not None:
    _refuse_if_different(workdir, checkpointing.finalized_steps(workdir)[-1], stored, new)
  return new


def _prepare_finetuning(config):
  """A fine-tuning run (`init_from` set): model fields and tokenizer from that run."""
  from odetransformer import finetune  # pylint: disable=g-import-not-at-top
  try:
    return finetune.prepare_config(ml_collections.ConfigDict(config.to_dict()))
  except finetune.FinetuneError as e:
    raise ConfigError(str(e)) from e


def _initial_weights(config, cfg, model_state):
  """Fills `model_state` in place with the `init_from` run's (transformed) weights.

  Every loaded leaf must exist in this model with the same shape; leaves the source
  lacks (LoRA factors) keep their fresh initialisation. Values are placed straight
  into this run's shardings (each process holds the full source on its host).
  """
  from odetransformer import finetune  # pylint: disable=g-import-not-at-top
  source = nnx.to_pure_dict(finetune.initial_model_state(config, cfg))
  target = nnx.to_pure_dict(model_state)
  counts = [0, 0]

  def place(dst, src, path):
    for key, value in src.items():
      where = f"{path}/{key}"
      if key not in dst:
        raise ConfigError(f"init_from weight {where} has no place in this model")
      if isinstance(value, dict):
        place(dst[key], value, where)
        continue
      old = dst[key]
      host = np.asarray(value).astype(old.dtype)
      if host.shape != old.shape:
        raise ConfigError(f"init_from weight {where} has shape {host.shape}, "
                          f"this model {old.shape}")
      dst[key] = jax.make_array_from_callback(host.shape, old.sharding, lambda i, h=host: h[i])
      counts[0] += 1
  place(target, source, "")
  counts[1] = len(jax.tree.leaves(target))
  nnx.replace_by_pure_dict(model_state, target)
  return counts


def _save_tokenizer(ds, workdir: str):
  """Copies the tokenizer to `<workdir>/tokenizer.model` (what the tools load)."""
  from odetransformer.loading import TOKENIZER_FILE  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, TOKENIZER_FILE)
  src = getattr(ds, "tokenizer_path", "")
  if jax.process_index() != 0 or not src or os.path.abspath(src) == os.path.abspath(path):
    return
  if os.path.isfile(path) and _tokenizer_sha256(path) == _tokenizer_sha256(src):
    return                 # a resumed run's own tokenizer: left as it is
  shutil.copyfile(src, path + ".tmp")
  os.replace(path + ".tmp", path)


_HEALTH = (("loss", "loss"), ("gradient norm", "grad_norm"))


class _HealthCheck:
  """Stops the run (DivergenceError, one line) when training values go non-finite.

  `add` collects each step's TrainMetrics (device values); `check` fetches those since the
  last check in one transfer (no per-step host sync) and raises at the first step with a
  non-finite loss or gradient norm, or when `param_norm()` (of the parameters after the
  last pending step) is not finite. Every save checks first, with the norm of the
  parameters it would write, so `last_good` (the newest step saved) holds finite
  parameters; it is named in the message and left as it is.

  With `skip_limit` > 0 (optim.skip_nonfinite_steps) the train step skips non-finite steps
  itself; they are logged here, and more than `skip_limit` of them in a row stop the run.
  """

  def __init__(self, directory: str, last_good: Optional[int], skip_limit: int = 0):
    self.directory, self.last_good, self.skip_limit = directory, last_good, skip_limit
    self.pending = []             # (step, TrainMetrics) not yet checked
    self.skipped_from, self.skipped_in_a_row = None, 0   # the run of skips up to now

  def add(self, step: int, metrics):
    self.pending.append((step, metrics))

  def check(self, param_norm: Optional[Callable[[], float]] = None):
    """Nothing pending (already checked at this step): nothing is measured."""
    if not self.pending:
      return
    values = jax.device_get([([getattr(m, attr).total for _, attr in _HEALTH],
                              m.skipped_steps.total) for _, m in self.pending])
    for i, ((step, _), (row, skipped)) in enumerate(zip(self.pending, values)):
      bad = [(name, float(np.sum(v))) for (name, _), v in zip(_HEALTH, row)
             if not math.isfinite(float(np.sum(v)))]
      if i == len(self.pending) - 1 and param_norm is not None:   # the parameters after it
        norm = param_norm()
        if not math.isfinite(norm):
          bad.append(("parameter norm", norm))
      if skipped:
        if not self.skipped_in_a_row:         # a new run of skips starts here
          self.skipped_from = step
        self.skipped_in_a_row += 1
        if jax.process_index() == 0:
          logging.warning("step %d skipped: non-finite loss or gradient (state unchanged)",
                          step)
      else:
        self.skipped_in_a_row = 0
      if self.skipped_in_a_row > self.skip_limit:
        bad.append((f"{self.skipped_in_a_row} steps in a row skipped from step "
                    f"{self.skipped_from} on, more than optim.skip_nonfinite_steps="
                    f"{self.skip_limit}", None))
      if bad:
        raise self._error(step, bad)
    self.pending.clear()

  def _error(self, step: int, bad: list) -> DivergenceError:
    kept = (f"last good checkpoint: step {self.last_good} in {self.directory} (left intact)"
            if self.last_good is not None else "no checkpoint was written yet")
    what = ", ".join(name if value is None else f"{name} {value}" for name, value in bad)
    return DivergenceError(
        f"non-finite training values at step {step} ({what}); stopped; {kept}; "
        "lower optim.learning_rate or set optim.grad_clip_norm")


def _run(config, mesh, rules, ds, cfg, tx, schedule, saved_config, writer, ckpt,
         input_pipeline) -> dict:
  """Creates or restores the state and runs the loop (under the mesh and rules)."""
  process_index, process_count = jax.process_index(), jax.process_count()
  local_eval_batch_size = config.eval_batch_size // process_count
  batch_sharding = sharding_lib.batch_sharding(mesh, rules)
  t0 = time.perf_counter()
  ts, state = init_train_state(cfg, tx, config.seed, mesh)
  metrics_lib.log(f"created sharded model + optimizer in {time.perf_counter() - t0:.1f}s")
  rng = jax.random.key(config.seed)
  train_iter = iter(ds.train)

  # Resume (from the newest checkpoint that restores; temporary ones never count).
  start_step = 0
  t0 = time.perf_counter()
  restored = ckpt.restore_latest(*ts.split_abstract())
  if restored is not None:
    latest, model_state, opt_state, meta, data_state = restored
    state = jax.tree.unflatten(jax.tree.structure(state),
                               jax.tree.leaves(model_state) + jax.tree.leaves(opt_state))
    if meta and "rng_key" in meta:
      rng = jax.random.wrap_key_data(np.asarray(meta["rng_key"], np.uint32))
    if data_state is not None:
      input_pipeline.restore_iterator_state(train_iter, data_state)
    start_step = int(latest)
    metrics_lib.log(f"resumed from checkpoint at step {start_step} in {ckpt.directory} "
                    f"({time.perf_counter() - t0:.1f}s)")
  elif config.get("init_from"):
    loaded, total = _initial_weights(config, cfg, state[0])
    metrics_lib.log(f"fine-tuning ({config.finetune.method}, {cfg.num_steps} steps/layers) "
                    f"from {config.init_from}: loaded {loaded} of {total} model arrays")
  else:
    metrics_lib.log(f"no checkpoint in {ckpt.directory}: starting from scratch")

  num_params = sum(x.size for x in jax.tree.leaves(state[0].filter(nnx.Param)))
  all_params = sum(x.size for x in jax.tree.leaves(state[0]))
  overview = _overview(state[0])   # collective (stats of global arrays): every process
  if process_index == 0:
    logging.info("parameter overview:\n%s", overview)
    writer.write_text(start_step, "parameters", overview)
    writer.write_text(start_step, "config", config.to_json_best_effort(indent=2))
  from odetransformer.param_count import flops_per_token  # pylint: disable=g-import-not-at-top
  tokens_per_step = config.global_batch_size * config.seq_len
  fpt = flops_per_token(cfg, config.seq_len, tokens_per_batch=tokens_per_step)
  peak = metrics_lib.peak_flops_per_device(override=config.peak_flops_per_device)
  peak_total = peak * jax.device_count() if jax.devices()[0].platform != "cpu" else peak
  frozen = f" trainable of {all_params:,}" if all_params != num_params else ""
  metrics_lib.log(f"model {cfg.kind}/{cfg.flavour}: {num_params:,}{frozen} params, "
                  f"{fpt / 1e6:,.1f} MFLOPs/token (train), {tokens_per_step:,} tokens/step")

  skip_limit = int(config.optim.get("skip_nonfinite_steps", 0))
  train_step = make_train_step(ts, schedule, rules,
                               grad_accum_steps=int(config.optim.grad_accum_steps),
                               use_dropout=cfg.dropout_rate > 0,
                               skip_nonfinite=skip_limit > 0)
  eval_step = make_eval_step(ts, rules)
  param_norm = make_param_norm(ts)
  progress = metrics_lib.Progress(config.num_train_steps, start_step, tokens_per_step,
                                  fpt, peak_total)
  last = int(config.num_train_steps)

  def run_eval(step):
    t = time.perf_counter()
    scalars = evaluate(eval_step, state, ds.eval_batches(), batch_sharding,
                       local_eval_batch_size)
    if scalars:
      writer.write_scalars(step, scalars, prefix="eval/")
      metrics_lib.log(metrics_lib.eval_log_line(step, scalars) +
                      f" | {time.perf_counter() - t:.1f}s")
    return scalars

  health = _HealthCheck(ckpt.directory, start_step if restored is not None else None,
                        skip_limit)

  def save(step, force=False):
    health.check(lambda: float(param_norm(state)))   # never checkpoint a diverged model
    health.last_good = step
    meta = {"rng_key": np.asarray(jax.random.key_data(rng)).tolist(),
            "config": saved_config.to_dict()}
    try:
      data_state = train_iter.get_state()
    except AttributeError:
      data_state = None
    ckpt.save(step, state[0], state[1], meta=meta, data_state=data_state, force=force)

  train_scalars, eval_scalars, history = {}, {}, []
  train_metrics = None
  step = start_step
  if start_step >= last:
    metrics_lib.log(f"already at step {start_step} >= num_train_steps={last}")
  elif start_step == 0 and config.get("init_from"):
    eval_scalars = run_eval(0)     # the starting point: the pre-trained model on this data
  while step < last:
    batch = sharding_lib.global_batch_from_local(
        _local_batch(next(train_iter)), batch_sharding, config.global_batch_size)
    first = step == start_step
    t = time.perf_counter()
    state, m = train_step(state, batch, jax.random.fold_in(rng, step))
    step += 1
    health.add(step, m)
    train_metrics = m if train_metrics is None else train_metrics.merge(m)
    if first:
      jax.block_until_ready(m)
      metrics_lib.log(f"first train step (incl. compilation) took {time.perf_counter() - t:.1f}s")
      progress.mark(step)

    preempted = ckpt.reached_preemption(step)
    if _every(step, config.log_every_steps, last) or preempted or first:
      train_scalars = metrics_lib.summarize(train_metrics.compute())
      train_metrics = None
      train_scalars["param_norm"] = float(param_norm(state))
      health.check(lambda: train_scalars["param_norm"])
      train_scalars.update(progress.update(step))
      writer.write_scalars(step, train_scalars, prefix="train/")
      metrics_lib.log(metrics_lib.train_log_line(step, last, train_scalars))
      history.append((step, train_scalars["loss"]))
    if _every(step, config.eval_every_steps, last):
      eval_scalars = run_eval(step)
      progress.mark(step)
    if _every(step, config.checkpoint_every_steps, last) or preempted:
      save(step, force=preempted)
    if preempted:
      metrics_lib.log(f"stopping at step {step} after preemption; checkpoint saved")
      break

  if start_step >= last and not eval_scalars:
    eval_scalars = run_eval(step)

  ckpt.wait_until_finished()
  return {"start_step": start_step, "step": step, "train": train_scalars,
          "eval": eval_scalars, "loss_history": history, "num_params": num_params}
