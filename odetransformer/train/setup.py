"""A run's setup, top to bottom: `check_run(config, workdir)` makes every check that
needs no data and writes nothing; `record_run(run, ds)` makes the one check that needs
the data (the tokenizer and the data's content against the checkpoints') and then writes
the run's first files. `loop.train_and_evaluate` takes the workdir lock between the two.

The ml_collections config is read once, in `check_run`, into the typed sections of
`run_config.RunConfig`; everything after takes those. Each check raises a one-line
`UserError` (main.py: `error:` line, exit 2), in the order `check_run`'s docstring lists
them: when several settings are wrong, the first listed is the one reported.
`check_config` (the settings that must fit together and with the mesh) is here too;
`tools/memory.py` calls it.
"""

from collections.abc import Callable
import dataclasses
import os
from typing import Any

from absl import logging
import jax
import ml_collections
import optax

from odetransformer.errors import ConfigError
from odetransformer.runtime import fileio
from odetransformer.train import finetune
from odetransformer.train import optimizer as optimizer_lib
from odetransformer.train import sharding as sharding_lib
from odetransformer.train.checkpoint.fingerprint import (
  check_resumable,
  check_tokenizer,
  save_config,
  save_tokenizer,
)
from odetransformer.train.run_config import RunConfig


def check_config(config: RunConfig, mesh) -> None:
  """Fails early, in one line, on settings that cannot work together or with the mesh
  (each section's own values were checked when it was built)."""
  batch, accum = config.batch.global_batch_size, config.optim.grad_accum_steps
  shards = sharding_lib.num_batch_shards(mesh, config.mesh.rules)
  processes = jax.process_count()
  if batch % (shards * accum):
    raise ConfigError(
      f"global_batch_size={batch} must be a multiple of the batch "
      f"shards ({shards}) × optim.grad_accum_steps ({accum})"
    )
  stride, rows = config.model.local_error_stride, batch // (shards * accum)
  if config.model.local_error_penalty and rows % stride:  # a cost, not a fault: debug
    logging.debug(
      "model.local_error_stride=%d does not divide the %d rows each batch shard trains per "
      "microbatch: the local error takes rows %d apart instead (more of its cost, and "
      "another estimate than where it divides them); set it to a divisor of %d to keep "
      "its rows",
      stride,
      rows,
      config.model.local_error_rows_apart(rows),
      rows,
    )
  if shards % processes:
    raise ConfigError(
      f"the batch is split {shards} ways (mesh data × fsdp) but there are "
      f"{processes} processes; make data × fsdp a multiple of the "
      "process count (keep 'tensor' within a host)"
    )
  if batch % processes:
    raise ConfigError(f"global_batch_size={batch} must be a multiple of the {processes} processes")
  eval_batch = config.eval.batch_size
  if eval_batch % shards or eval_batch % processes:
    raise ConfigError(
      f"eval_batch_size={eval_batch} must be a multiple of the "
      f"batch shards ({shards}) and processes ({processes})"
    )
  split = sharding_lib.mesh_axis_size(mesh, dict(config.mesh.rules).get("heads"))
  if config.model.kv_heads % split:
    raise ConfigError(
      f"model.num_kv_heads={config.model.kv_heads} key/value heads cannot be split over the "
      f"{split} devices of mesh.rules['heads']; use a tensor axis that divides it"
    )
  if config.model.family == "gpt2" and config.batch.seq_len > config.model.max_len:
    raise ConfigError(
      f"seq_len={config.batch.seq_len} exceeds model.max_len={config.model.max_len}"
    )


@dataclasses.dataclass(frozen=True)
class Run:
  """A checked run: what training needs before it opens the data.

  Attributes:
    config: The run's settings, typed (`run_config.RunConfig`): old names migrated; a
      fine-tuning run's model and tokenizer filled in from its `init_from` run; the model
      at `model.vocab_size` (`record_run` gives the one at the tokenizer's).
    workdir: The run's directory (a string; local or gs://).
    mesh: The device mesh (`config.mesh.shape`); `config.mesh.rules` map parameter and
      activation axes onto it.
    tx: The optimizer (clip, AdamW with the schedule).
    lr_schedule: Step -> learning rate (logged by the train step).
    resume_from: The fingerprint of the newest checkpoint in `workdir`, which this
      config may resume; None when `workdir` holds none: the run starts from
      `init_from`, or from scratch.
  """

  config: RunConfig
  workdir: str
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  lr_schedule: Callable[[Any], Any]
  resume_from: dict | None


def check_run(config: ml_collections.ConfigDict, workdir) -> Run:
  """The checked run of `config` in `workdir`; reads, never writes.

  The checks, in this order (the first that fails is the one-line UserError raised):

  1. every path a user gives (`--workdir`, `init_from`, `data.tokenizer_path`,
     `data.cache_dir`, `data.data_dir`) reaches the filesystem intact in this locale;
  2. each section's own values (`RunConfig.from_config`: positive step counts and
     sizes, `profile_steps`, the checkpoint options keep a checkpoint, `optim.*`, the
     mesh's axis rules, `data.*`, the model config: known kind, solver, divisible heads);
  3. a fine-tuning run (`init_from`): that is a training workdir, `finetune.*` fits the
     pre-trained model, no model field that must agree with it is overridden, and
     `data.vocab_size` is its;
  4. the mesh fits the devices;
  5. `check_config`: the batch splits over the mesh's batch shards, accumulation steps
     and processes, the eval batch over shards and processes, the key/value heads over
     the 'heads' mesh axes, GPT-2's `max_len`;
  6. checkpoints already in `workdir` are of this model and tokenizer settings, and of
     this data source, batch shape and seed unless `resume_with_changes` accepts other
     ones (fingerprint.check_resumable).
  The data's own checks (files, splits, tokenizer) come after, in
  `input_pipeline.create_datasets`, and `record_run` compares its tokenizer and
  content with the checkpoints'.
  """
  workdir = os.fspath(workdir)
  fileio.check_encodable(workdir, "--workdir")
  settings = RunConfig.from_config(config)  # old key names -> new, with a warning
  if settings.finetune is not None:
    settings = finetune.prepare(settings)
  try:
    mesh = sharding_lib.make_mesh(settings.mesh)
  except sharding_lib.MeshError as e:
    raise ConfigError(str(e)) from e
  check_config(settings, mesh)
  tx = optimizer_lib.create_optimizer(
    settings.optim, settings.schedule.num_train_steps, ode=settings.model.is_ode
  )
  lr_schedule = optimizer_lib.learning_rate_schedule(
    settings.optim, settings.schedule.num_train_steps
  )
  resume_from = check_resumable(
    settings.record,
    settings.data.tokenizer_path,
    workdir,
    accept_changes=settings.checkpoint.resume_with_changes,
  )
  return Run(
    config=settings,
    workdir=workdir,
    mesh=mesh,
    tx=tx,
    lr_schedule=lr_schedule,
    resume_from=resume_from,
  )


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """What `record_run` found and wrote.

  Attributes:
    config: The run's settings with the model at the tokenizer's vocabulary size (what
      is trained) and `data.tokenizer_path` the file used; its `record` is what
      `<workdir>/config.json` and every checkpoint's meta hold.
    fingerprint: What this run's checkpoints record they depend on (fingerprint.py).
  """

  config: RunConfig
  fingerprint: dict


def record_run(run: Run, ds) -> RunRecord:
  """Checks `ds`'s tokenizer and content against the checkpoints the run resumes (a
  one-line ConfigError before anything is written), then writes the run's first files:
  `<workdir>/tokenizer.model` (what the tools load) and `<workdir>/config.json`.

  `ds`: the run's `input_pipeline.Datasets`.
  """
  config, workdir = run.config, run.workdir
  tokenizer = getattr(ds, "tokenizer_path", "")
  fingerprint = check_tokenizer(
    config.record,
    tokenizer,
    workdir,
    run.resume_from,
    getattr(ds, "content_hash", None),
    accept_changes=config.checkpoint.resume_with_changes,
  )
  model = dataclasses.replace(config.model, vocab_size=int(ds.vocab_size))  # the tokenizer's
  data = config.data
  if not data.tokenizer_path and tokenizer:
    data = dataclasses.replace(data, tokenizer_path=tokenizer)  # for tools, beside tokenizer.model
  config = config.replace(model=model, data=data)
  fileio.makedirs(workdir)
  save_tokenizer(tokenizer, workdir)
  save_config(config.record, workdir)
  return RunRecord(config=config, fingerprint=fingerprint)
