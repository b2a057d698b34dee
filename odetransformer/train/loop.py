"""The training loop: `train_and_evaluate(config, workdir)`.

One run: the checked setup (`odetransformer/train/setup.py`: config, mesh and
logical-axis rules, model config, optimizer and schedule, resume decision; nothing
written) → the workdir lock → datasets (process-local batches) → the run's files → the
TrainState (model and AdamW state, `odetransformer/train/steps.py`) created already
sharded → resume from the newest checkpoint in `workdir`, or start from `init_from` (a
fine-tuning run, `odetransformer/train/finetune.py`), or from scratch → a loop of the
jitted, donated train step with periodic logging, evaluation and async checkpoints → a
final evaluation and save. Non-finite values stop the run without touching its good
checkpoints (`odetransformer/train/health.py`); SIGTERM and Ctrl-C save and stop
(`odetransformer/train/checkpoint/`).
"""

import time

from absl import logging
from clu import parameter_overview
from flax import nnx
import jax
import ml_collections
import numpy as np

import input_pipeline
from odetransformer.model.param_count import flops_per_token
from odetransformer.runtime import fileio
from odetransformer.runtime.workdir_lock import WorkdirLock
from odetransformer.train import finetune, setup
from odetransformer.train import health as health_lib
from odetransformer.train import metrics as metrics_lib
from odetransformer.train import sharding as sharding_lib
from odetransformer.train import steps as steps_lib
from odetransformer.train.checkpoint.manager import Checkpointer

# Re-exported: tools/memory.py checks a config with loop.check_config.
from odetransformer.train.setup import check_config  # noqa: F401


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
  config = run.config
  # The first write of a run: one process per workdir (process 0 of a multi-host run).
  lock = WorkdirLock(
    run.workdir, enabled=jax.process_index() == 0, stale_s=config.get("workdir_lock_stale_s", 600)
  ).acquire()
  try:
    metrics_lib.log(
      f"mesh {dict(run.mesh.shape)} on {jax.device_count()} "
      f"{jax.devices()[0].platform} devices, {jax.process_count()} process(es)"
    )
    ds = input_pipeline.create_datasets(
      config.data,
      seq_len=config.seq_len,
      global_batch_size=config.global_batch_size,
      eval_batch_size=config.eval_batch_size,
      seed=config.seed,
      workdir=run.workdir,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
    record = setup.record_run(run, ds)  # tokenizer and data vs checkpoints; first files
    writer = metrics_lib.MetricWriter(fileio.join(run.workdir, "tensorboard"))
    ckpt = Checkpointer(
      run.workdir,
      max_to_keep=config.checkpoint_max_to_keep,
      async_save=config.checkpoint_async,
      fingerprint=record.fingerprint,
      lock=lock,
    )
    ckpt.allow_unverified = bool(config.get("checkpoint_allow_unverified", False))
    ckpt.install_sigterm_handler()  # SIGTERM and Ctrl-C: save at the current step, stop
    try:
      with jax.set_mesh(run.mesh), nnx.logical_axis_rules(run.rules):
        return _train(run, record, ds, writer, ckpt, stop_at_step)
    finally:
      ckpt.close()  # waits for a pending async save, restores the SIGTERM handler
      writer.close()
  finally:
    lock.release()


def _restore_or_init(config, cfg, tx, mesh, ckpt, train_iter):
  """(layout, state, rng, start_step, restored): the newest checkpoint that restores
  (temporary ones never count), else `init_from`'s weights, else a fresh init.

  A resume restores straight into the layout's abstract (sharded) targets: the state
  exists once, never a created copy beside the restored one."""
  t0 = time.perf_counter()
  layout = steps_lib.state_layout(cfg, tx, config.seed, mesh)
  rng = jax.random.key(config.seed)
  restored = ckpt.restore_latest(layout.abstract["model"], layout.abstract["optimizer"])
  if restored is not None:
    step, model_state, opt_state, meta, data_state = restored
    state = layout.assemble(model_state, opt_state)
    if meta and "rng_key" in meta:
      rng = jax.random.wrap_key_data(np.asarray(meta["rng_key"], np.uint32))
    if data_state is not None:
      input_pipeline.restore_iterator_state(train_iter, data_state)
    metrics_lib.log(
      f"resumed from checkpoint at step {step} in {ckpt.directory} "
      f"({time.perf_counter() - t0:.1f}s)"
    )
    return layout, state, rng, int(step), True
  t0 = time.perf_counter()
  state = steps_lib.create_train_state(layout, cfg, tx, config.seed, mesh)
  metrics_lib.log(f"created sharded model + optimizer in {time.perf_counter() - t0:.1f}s")
  if config.get("init_from"):
    loaded, total = finetune.place_initial_weights(config, cfg, state["model"])
    metrics_lib.log(
      f"fine-tuning ({config.finetune.method}, {cfg.depth} steps/layers) "
      f"from {config.init_from}: loaded {loaded} of {total} model arrays"
    )
  else:
    metrics_lib.log(f"no checkpoint in {ckpt.directory}: starting from scratch")
  return layout, state, rng, 0, False


def _describe_model(config, cfg, model_state, writer, step: int) -> tuple:
  """Logs the model line (and the full parameter table with `parameter_table`);
  returns (trainable parameters, training FLOPs per token)."""
  params = model_state.filter(nnx.Param)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  all_params = sum(x.size for x in jax.tree.leaves(model_state))
  groups = {}
  for path, x in nnx.to_flat_state(params):
    groups[str(path[0])] = groups.get(str(path[0]), 0) + x.size
  fpt = flops_per_token(
    cfg, config.seq_len, tokens_per_batch=config.global_batch_size * config.seq_len
  )
  frozen = f" trainable of {all_params:,}" if all_params != num_params else ""
  metrics_lib.log(
    f"model {cfg.kind}/{cfg.family}: {num_params:,}{frozen} params ("
    + ", ".join(f"{k} {v:,}" for k, v in groups.items())
    + f"), {fpt / 1e6:,.1f} MFLOPs/token (train), "
    f"{config.global_batch_size * config.seq_len:,} tokens/step"
  )
  if config.get("parameter_table", False):

    def stringify(d):
      return {str(k): stringify(v) if isinstance(v, dict) else v for k, v in d.items()}

    # Statistics of global arrays: every process computes them.
    table = parameter_overview.get_parameter_overview(
      stringify(nnx.to_pure_dict(params)), include_stats="global"
    )
    if jax.process_index() == 0:
      logging.info("parameter overview:\n%s", table)
      writer.write_text(step, "parameters", table)
  if jax.process_index() == 0:
    writer.write_text(step, "config", config.to_json_best_effort(indent=2))
  return num_params, fpt


def _every(step: int, every: int, last: int) -> bool:
  """The "every N steps or the last step" schedule (N = 0: last step only)."""
  return step == last or (every > 0 and step % every == 0)


def _train(
  run: setup.Run, record: setup.RunRecord, ds, writer, ckpt, stop_at_step: int = 0
) -> dict:
  """Creates or restores the TrainState and runs the loop (under the mesh and rules)."""
  config, cfg, saved_config = run.config, record.model, record.saved_config
  mesh, rules, tx, schedule = run.mesh, run.rules, run.tx, run.schedule
  train_iter = iter(ds.train)
  layout, state, rng, start_step, resumed = _restore_or_init(
    config, cfg, tx, mesh, ckpt, train_iter
  )
  num_params, fpt = _describe_model(config, cfg, state["model"], writer, start_step)
  skip_limit = int(config.optim.get("skip_nonfinite_steps", 0))
  train_step = steps_lib.make_train_step(
    layout,
    schedule,
    rules,
    grad_accum_steps=int(config.optim.grad_accum_steps),
    use_dropout=cfg.dropout_rate > 0,
    skip_nonfinite=skip_limit > 0,
  )
  eval_step = steps_lib.make_eval_step(layout, rules)
  param_norm = steps_lib.make_param_norm(layout)
  batch_sharding = sharding_lib.batch_sharding(mesh, rules)
  tokens_per_step = config.global_batch_size * config.seq_len
  peak, source = metrics_lib.device_peak_flops(
    override=config.peak_flops_per_device, dtype=cfg.dtype
  )
  metrics_lib.log(f"MFU against {peak / 1e9:,.1f} GFLOP/s per device ({source})")
  if jax.devices()[0].platform != "cpu":
    peak *= jax.device_count()  # XLA:CPU's devices share one host's cores
  progress = metrics_lib.Progress(config.num_train_steps, start_step, tokens_per_step, fpt, peak)
  profile = metrics_lib.ProfileWindow.parse(
    config.get("profile_steps", ""), fileio.join(ckpt.workdir, "tensorboard")
  )
  health = health_lib.HealthCheck(
    ckpt.directory, start_step if resumed else None, skip_limit, optim_config=config.optim
  )
  last = int(config.num_train_steps)
  stop = min(last, int(stop_at_step)) if stop_at_step else last

  def run_eval(step):
    t = time.perf_counter()
    scalars = steps_lib.evaluate(
      eval_step,
      state,
      ds.eval_batches(),
      batch_sharding,
      config.eval_batch_size // jax.process_count(),
    )
    if scalars:
      writer.write_scalars(step, scalars, prefix="eval/")
      metrics_lib.log(
        metrics_lib.eval_log_line(step, scalars) + f" | {time.perf_counter() - t:.1f}s"
      )
    return scalars

  def save(step, force=False):
    health.check(lambda: float(param_norm(state)))  # never checkpoint a diverged model
    ckpt.claim_step(step)  # stops if another run took the workdir
    health.last_good = step
    meta = {
      "rng_key": np.asarray(jax.random.key_data(rng)).tolist(),
      "config": saved_config.to_dict(),
    }
    data_state = train_iter.get_state() if hasattr(train_iter, "get_state") else None
    ckpt.save(
      step, state["model"], state["optimizer"], meta=meta, data_state=data_state, force=force
    )

  train_scalars, eval_scalars, history, train_metrics = {}, {}, [], None
  step, preempted = start_step, False
  if start_step >= last:
    metrics_lib.log(f"already at step {start_step} >= num_train_steps={last}")
  elif start_step == 0 and config.get("init_from"):
    eval_scalars = run_eval(0)  # the starting point: the pre-trained model on this data
  while step < stop:
    batch = sharding_lib.global_batch_from_local(
      steps_lib.local_batch(next(train_iter)), batch_sharding, config.global_batch_size
    )
    first = step == start_step
    t = time.perf_counter()
    profile.before(step)
    state, m = train_step(state, batch, jax.random.fold_in(rng, step))
    step += 1
    profile.after(step, m)
    health.add(step, m)
    train_metrics = m if train_metrics is None else train_metrics.merge(m)
    if first:
      jax.block_until_ready(m)
      metrics_lib.log(f"first train step (incl. compilation) took {time.perf_counter() - t:.1f}s")
      progress.mark(step)

    preempted = ckpt.reached_preemption(step)
    if _every(step, config.log_every_steps, last) or preempted or first or step == stop:
      train_scalars = metrics_lib.summarize(train_metrics.compute())
      train_metrics = None
      train_scalars["param_norm"] = float(param_norm(state))
      health.check(lambda norm=train_scalars["param_norm"]: norm)
      train_scalars.update(progress.update(step))
      writer.write_scalars(step, train_scalars, prefix="train/")
      metrics_lib.log(metrics_lib.train_log_line(step, last, train_scalars))
      history.append((step, train_scalars["loss"]))
    if _every(step, config.eval_every_steps, last):
      eval_scalars = run_eval(step)
      progress.mark(step)
    if _every(step, config.checkpoint_every_steps, last) or preempted or step == stop:
      save(step, force=preempted)
    if preempted:
      metrics_lib.log(f"stopping at step {step} after preemption; checkpoint saved")
      break

  if start_step >= last and not eval_scalars:
    eval_scalars = run_eval(step)
  ckpt.wait_until_finished()
  return {
    "start_step": start_step,
    "step": step,
    "train": train_scalars,
    "eval": eval_scalars,
    "loss_history": history,
    "num_params": num_params,
    "preempted": preempted,
    "data_state": train_iter.get_state() if hasattr(train_iter, "get_state") else None,
  }
