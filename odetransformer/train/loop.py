"""The training loop: `train_and_evaluate(config, workdir)`.

One run: the checked setup (`odetransformer/train/setup.py`: the config read once into
typed sections, the mesh, the optimizer and schedule, the resume decision; nothing
written) → the workdir lock → datasets (process-local batches) → the run's files →
`Trainer`: the TrainState (model and AdamW state, `odetransformer/train/steps.py`)
created already sharded, resumed from the newest checkpoint in `workdir`, or started
from `init_from` (a fine-tuning run, `odetransformer/train/finetune.py`) or from scratch
→ a loop of the jitted, donated train step with periodic logging, evaluation and async
checkpoints → a final evaluation and save. Non-finite values stop the run without
touching its good checkpoints (`odetransformer/train/health.py`); SIGTERM and Ctrl-C
save and stop (`odetransformer/train/checkpoint/`).
"""

import time

from absl import logging
from clu import parameter_overview
from flax import nnx
import jax
import ml_collections
import numpy as np

import input_pipeline
from input_pipeline.config import DataConfig
from odetransformer.model.param_count import flops_per_token
from odetransformer.runtime import fileio
from odetransformer.runtime.workdir_lock import WorkdirLock
from odetransformer.train import finetune, setup
from odetransformer.train import health as health_lib
from odetransformer.train import metrics as metrics_lib
from odetransformer.train import sharding as sharding_lib
from odetransformer.train import steps as steps_lib
from odetransformer.train.checkpoint.manager import Checkpointer
from odetransformer.train.run_config import BatchConfig, EvalConfig, RunConfig


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str, stop_at_step: int = 0
) -> dict:
  """Trains (resuming from `workdir` when it holds checkpoints) and evaluates.

  `stop_at_step` (0 = none) ends the call at that step, below `num_train_steps`, with a
  checkpoint there and no end-of-run evaluation; the schedule stays `num_train_steps`'
  and a later call (with a later stop, or none) continues from that checkpoint.

  Returns:
    {'start_step': step resumed from (0 if fresh), 'step': final step, 'train': last
    logged train scalars, 'eval': last eval scalars, 'loss_history': [(step, train
    loss)] at each log line, 'num_params': parameter count, 'data_state': the training
    iterator's state at 'step', 'preempted': True when SIGTERM or Ctrl-C stopped the run
    early, after saving a checkpoint}.
  """
  run = setup.check_run(config, workdir)  # every check that needs no data; no writes
  settings = run.config
  # The first write of a run: one process per workdir (process 0 of a multi-host run).
  lock = WorkdirLock(
    run.workdir, enabled=jax.process_index() == 0, stale_s=settings.checkpoint.lock_stale_s
  ).acquire()
  failed = True  # until it returns: a start that fails leaves nothing it created
  try:
    metrics_lib.log(
      f"mesh {dict(run.mesh.shape)} on {jax.device_count()} "
      f"{jax.devices()[0].platform} devices, {jax.process_count()} process(es)"
    )
    ds = _datasets(settings.data, settings.batch, settings.eval, run.workdir)
    record = setup.record_run(run, ds)  # tokenizer and data vs checkpoints; first files
    writer = metrics_lib.MetricWriter(fileio.join(run.workdir, "tensorboard"))
    ckpt = Checkpointer(
      run.workdir,
      max_to_keep=settings.checkpoint.max_to_keep,
      async_save=settings.checkpoint.async_save,
      fingerprint=record.fingerprint,
      lock=lock,
    )
    ckpt.allow_unverified = settings.checkpoint.allow_unverified
    ckpt.install_sigterm_handler()  # SIGTERM and Ctrl-C: save at the current step, stop
    try:
      with jax.set_mesh(run.mesh), nnx.logical_axis_rules(settings.mesh.rules):
        result = Trainer(run, record.config, ds, writer, ckpt).train(stop_at_step)
    finally:
      ckpt.close()  # waits for a pending async save, restores the SIGTERM handler
      writer.close()
    failed = False
    return result
  finally:
    # A failure before the first train step removes what the run added to the workdir
    # (its files, the lock, the workdir itself if the run made it); after it, nothing.
    lock.release(failed_start=failed)


def _datasets(data: DataConfig, batch: BatchConfig, eval_: EvalConfig, workdir: str):
  """The run's `input_pipeline.Datasets`: this process's rows of each batch."""
  return input_pipeline.create_datasets(
    data,
    seq_len=batch.seq_len,
    global_batch_size=batch.global_batch_size,
    eval_batch_size=eval_.batch_size,
    seed=batch.seed,
    workdir=workdir,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
  )


def _every(step: int, every: int, last: int) -> bool:
  """The "every N steps or the last step" schedule (N = 0: last step only)."""
  return step == last or (every > 0 and step % every == 0)


class Trainer:
  """One run's state and the four things the loop does with it: `step`, `evaluate`,
  `log`, `save`; `train` runs them in order. Built under the run's mesh and rules.

  Attributes:
    config: The run's settings (the model at the tokenizer's vocabulary size).
    state: The TrainState ({'model', 'optimizer'} nnx states), sharded.
    rng: The run's base key (the step's is `fold_in(rng, step)`).
    start_step: The step resumed from (0: a fresh or fine-tuning start).
  """

  def __init__(self, run: setup.Run, config: RunConfig, ds, writer, ckpt: Checkpointer):
    self.config, self.ds, self.writer, self.ckpt = config, ds, writer, ckpt
    self.train_iter = iter(ds.train)
    layout, resumed = self._restore_or_init(run)
    self.num_params, fpt = self._describe_model()
    skip_limit = config.optim.skip_nonfinite_steps
    rules = config.mesh.rules
    self.train_step = steps_lib.make_train_step(
      layout,
      run.lr_schedule,
      rules,
      grad_accum_steps=config.optim.grad_accum_steps,
      use_dropout=config.model.dropout_rate > 0,
      skip_nonfinite=skip_limit > 0,
    )
    self.eval_step = steps_lib.make_eval_step(layout, rules)
    self.param_norm = steps_lib.make_param_norm(layout)
    self.batch_sharding = sharding_lib.batch_sharding(run.mesh, rules)
    self.progress = metrics_lib.Progress(
      config.schedule.num_train_steps,
      self.start_step,
      config.batch.global_batch_size * config.batch.seq_len,
      fpt,
      _peak_flops(config),
    )
    self.profile = metrics_lib.ProfileWindow.parse(
      config.schedule.profile_steps, fileio.join(ckpt.workdir, "tensorboard")
    )
    self.health = health_lib.HealthCheck(
      ckpt.directory, self.start_step if resumed else None, skip_limit, config.optim
    )
    self._metrics = None  # train metrics merged since the last log line

  def _restore_or_init(self, run: setup.Run) -> tuple:
    """(layout, resumed): sets state, rng and start_step from the newest checkpoint that
    restores (temporary ones never count), else `init_from`'s weights, else a fresh init.

    A resume restores straight into the layout's abstract (sharded) targets: the state
    exists once, never a created copy beside the restored one."""
    cfg, seed, ckpt = self.config.model, self.config.batch.seed, self.ckpt
    t0 = time.perf_counter()
    layout = steps_lib.state_layout(cfg, run.tx, seed, run.mesh)
    self.rng, self.start_step = jax.random.key(seed), 0
    restored = ckpt.restore_latest(layout.abstract["model"], layout.abstract["optimizer"])
    if restored is not None:
      step, model_state, opt_state, meta, data_state = restored
      self.state, self.start_step = layout.assemble(model_state, opt_state), int(step)
      if meta and "rng_key" in meta:
        self.rng = jax.random.wrap_key_data(np.asarray(meta["rng_key"], np.uint32))
      if data_state is not None:
        input_pipeline.restore_iterator_state(self.train_iter, data_state)
      took = time.perf_counter() - t0
      metrics_lib.log(f"resumed from checkpoint at step {step} in {ckpt.directory} ({took:.1f}s)")
      return layout, True
    t0 = time.perf_counter()
    self.state = steps_lib.create_train_state(layout, cfg, run.tx, seed, run.mesh)
    metrics_lib.log(f"created sharded model + optimizer in {time.perf_counter() - t0:.1f}s")
    ft = self.config.finetune
    if ft is not None:
      loaded, total = finetune.place_initial_weights(self.config, cfg, self.state["model"])
      metrics_lib.log(
        f"fine-tuning ({ft.method}, {cfg.depth} steps/layers) "
        f"from {ft.init_from}: loaded {loaded} of {total} model arrays"
      )
    else:
      metrics_lib.log(f"no checkpoint in {ckpt.directory}: starting from scratch")
    return layout, False

  def _describe_model(self) -> tuple:
    """Logs the model line (and the full parameter table with `parameter_table`);
    returns (trainable parameters, training FLOPs per token)."""
    cfg, batch, model_state = self.config.model, self.config.batch, self.state["model"]
    params = model_state.filter(nnx.Param)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    all_params = sum(x.size for x in jax.tree.leaves(model_state))
    groups = {}
    for path, x in nnx.to_flat_state(params):
      groups[str(path[0])] = groups.get(str(path[0]), 0) + x.size
    tokens = batch.global_batch_size * batch.seq_len
    fpt = flops_per_token(cfg, batch.seq_len, tokens_per_batch=tokens)
    frozen = f" trainable of {all_params:,}" if all_params != num_params else ""
    metrics_lib.log(
      f"model {cfg.kind}/{cfg.family}: {num_params:,}{frozen} params ("
      + ", ".join(f"{k} {v:,}" for k, v in groups.items())
      + f"), {fpt / 1e6:,.1f} MFLOPs/token (train), {tokens:,} tokens/step"
    )
    if self.config.metrics.parameter_table:
      _log_parameter_table(params, self.writer, self.start_step)
    if jax.process_index() == 0:
      text = ml_collections.ConfigDict(self.config.record).to_json_best_effort(indent=2)
      self.writer.write_text(self.start_step, "config", text)
    return num_params, fpt

  def step(self, step: int):
    """Runs the train step that makes it `step + 1`; returns its metrics."""
    batch = sharding_lib.global_batch_from_local(
      steps_lib.local_batch(next(self.train_iter)),
      self.batch_sharding,
      self.config.batch.global_batch_size,
    )
    self.profile.before(step)
    self.state, m = self.train_step(self.state, batch, jax.random.fold_in(self.rng, step))
    self.profile.after(step + 1, m)
    self.health.add(step + 1, m)
    self._metrics = m if self._metrics is None else self._metrics.merge(m)
    return m

  def log(self, step: int) -> dict:
    """The train scalars since the last log line (checked finite): a log line and
    TensorBoard scalars."""
    scalars = metrics_lib.summarize(self._metrics.compute())
    self._metrics = None
    scalars["param_norm"] = float(self.param_norm(self.state))
    self.health.check(lambda norm=scalars["param_norm"]: norm)
    scalars.update(self.progress.update(step))
    self.writer.write_scalars(step, scalars, prefix="train/")
    last = self.config.schedule.num_train_steps
    metrics_lib.log(metrics_lib.train_log_line(step, last, scalars))
    return scalars

  def evaluate(self, step: int) -> dict:
    """Eval scalars on the eval split (logged), or {} when it has no batches."""
    t = time.perf_counter()
    scalars = steps_lib.evaluate(
      self.eval_step,
      self.state,
      self.ds.eval_batches(),
      self.batch_sharding,
      self.config.eval.batch_size // jax.process_count(),
    )
    if scalars:
      self.writer.write_scalars(step, scalars, prefix="eval/")
      took = time.perf_counter() - t
      metrics_lib.log(metrics_lib.eval_log_line(step, scalars) + f" | {took:.1f}s")
    return scalars

  def save(self, step: int, force: bool = False):
    """A checkpoint at `step` (never of a diverged model; stops if another run took the
    workdir): model, optimizer, the rng key, the config record and the data state."""
    self.health.check(lambda: float(self.param_norm(self.state)))
    self.ckpt.claim_step(step)
    self.health.last_good = step
    meta = {
      "rng_key": np.asarray(jax.random.key_data(self.rng)).tolist(),
      "config": self.config.record,
    }
    state = self.state
    self.ckpt.save(
      step, state["model"], state["optimizer"], meta=meta, data_state=self.data_state(), force=force
    )

  def data_state(self):
    it = self.train_iter
    return it.get_state() if hasattr(it, "get_state") else None

  def train(self, stop_at_step: int = 0) -> dict:
    """The loop from `start_step` to `num_train_steps` (or `stop_at_step`); the result
    `train_and_evaluate` returns."""
    schedule, start = self.config.schedule, self.start_step
    last = schedule.num_train_steps
    stop = min(last, int(stop_at_step)) if stop_at_step else last
    train_scalars, eval_scalars, history = {}, {}, []
    step, preempted = start, False
    if start >= last:
      metrics_lib.log(f"already at step {start} >= num_train_steps={last}")
    elif start == 0 and self.config.finetune is not None:
      eval_scalars = self.evaluate(0)  # the starting point: the pre-trained model on this data
    while step < stop:
      t = time.perf_counter()
      m = self.step(step)
      step += 1
      if step == start + 1:
        jax.block_until_ready(m)
        metrics_lib.log(f"first train step (incl. compilation) took {time.perf_counter() - t:.1f}s")
        self.progress.mark(step)
        if self.ckpt.lock is not None:
          self.ckpt.lock.mark_started()  # a failure from here on keeps the run's files
      preempted = self.ckpt.reached_preemption(step)
      if _every(step, schedule.log_every_steps, last) or preempted or step in (start + 1, stop):
        train_scalars = self.log(step)
        history.append((step, train_scalars["loss"]))
      if _every(step, self.config.eval.every_steps, last):
        eval_scalars = self.evaluate(step)
        self.progress.mark(step)
      if _every(step, self.config.checkpoint.every_steps, last) or preempted or step == stop:
        self.save(step, force=preempted)
      if preempted:
        metrics_lib.log(f"stopping at step {step} after preemption; checkpoint saved")
        break
    if start >= last and not eval_scalars:
      eval_scalars = self.evaluate(step)
    self.ckpt.wait_until_finished()
    return {
      "start_step": start,
      "step": step,
      "train": train_scalars,
      "eval": eval_scalars,
      "loss_history": history,
      "num_params": self.num_params,
      "preempted": preempted,
      "data_state": self.data_state(),
    }


def _peak_flops(config: RunConfig) -> float:
  """The job's peak FLOP/s for MFU (logged with its source)."""
  peak, source = metrics_lib.device_peak_flops(
    override=config.metrics.peak_flops_per_device, dtype=config.model.dtype
  )
  metrics_lib.log(f"MFU against {peak / 1e9:,.1f} GFLOP/s per device ({source})")
  if jax.devices()[0].platform != "cpu":
    peak *= jax.device_count()  # XLA:CPU's devices share one host's cores
  return peak


def _log_parameter_table(params, writer, step: int) -> None:
  """Every parameter's shape and statistics: a log block and TensorBoard text."""

  def stringify(d):
    return {str(k): stringify(v) if isinstance(v, dict) else v for k, v in d.items()}

  # Statistics of global arrays: every process computes them.
  table = parameter_overview.get_parameter_overview(
    stringify(nnx.to_pure_dict(params)), include_stats="global"
  )
  if jax.process_index() == 0:
    logging.info("parameter overview:\n%s", table)
    writer.write_text(step, "parameters", table)
