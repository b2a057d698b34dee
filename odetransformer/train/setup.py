"""A run's setup, top to bottom: `check_run(config, workdir)` makes every check that
needs no data and writes nothing; `record_run(run, ds)` makes the one check that needs
the data (the tokenizer and the data's content against the checkpoints') and then writes
the run's first files. `loop.train_and_evaluate` takes the workdir lock between the two.

Each check raises a one-line `UserError` (main.py: `error:` line, exit 2), in the order
`check_run`'s docstring lists them: when several settings are wrong, the first listed
is the one reported. `check_config` (the settings that must fit together and with the
mesh) is here too; `tools/memory.py` calls it through `loop.check_config`.
"""

from collections.abc import Callable
import dataclasses
import os
from typing import Any

import jax
import ml_collections
import optax

from odetransformer.errors import ConfigError
from odetransformer.model.config import ModelConfig, migrate_config, model_config
from odetransformer.runtime import fileio
from odetransformer.train import finetune
from odetransformer.train import metrics as metrics_lib
from odetransformer.train import optimizer as optimizer_lib
from odetransformer.train import sharding as sharding_lib
from odetransformer.train.checkpoint.fingerprint import (
  check_resumable,
  check_tokenizer,
  save_config,
  save_tokenizer,
)
from odetransformer.train.checkpoint.manager import validate_options


def check_config(config, mesh, rules):
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
      f"shards ({shards}) × optim.grad_accum_steps ({accum})"
    )
  if shards % jax.process_count():
    raise ConfigError(
      f"the batch is split {shards} ways (mesh data × fsdp) but there are "
      f"{jax.process_count()} processes; make data × fsdp a multiple of the "
      "process count (keep 'tensor' within a host)"
    )
  if config.global_batch_size % jax.process_count():
    raise ConfigError(
      f"global_batch_size={config.global_batch_size} must be a multiple of "
      f"the {jax.process_count()} processes"
    )
  if config.eval_batch_size % shards or config.eval_batch_size % jax.process_count():
    raise ConfigError(
      f"eval_batch_size={config.eval_batch_size} must be a multiple of the "
      f"batch shards ({shards}) and processes ({jax.process_count()})"
    )
  if int(config.optim.get("skip_nonfinite_steps", 0)) < 0:
    raise ConfigError(
      f"optim.skip_nonfinite_steps={config.optim.skip_nonfinite_steps} must "
      "be >= 0 (0 = stop at the first non-finite step)"
    )
  if config.model.family == "gpt2" and config.seq_len > config.model.max_len:
    raise ConfigError(f"seq_len={config.seq_len} exceeds model.max_len={config.model.max_len}")
  metrics_lib.ProfileWindow.parse(config.get("profile_steps", ""))


@dataclasses.dataclass(frozen=True)
class Run:
  """A checked run: what training needs before it opens the data.

  Attributes:
    config: The run's config: old names migrated; a fine-tuning run's model fields and
      tokenizer filled in from its `init_from` run.
    workdir: The run's directory (a string; local or gs://).
    mesh: The device mesh (`config.mesh`).
    rules: The logical-axis rules that map parameter and activation axes onto it.
    model: The model config, at `config.model.vocab_size` (`record_run` gives the one
      at the tokenizer's vocabulary size).
    tx: The optimizer (clip, AdamW with the schedule).
    schedule: Step -> learning rate (logged by the train step).
    resume_from: The fingerprint of the newest checkpoint in `workdir`, which this
      config may resume; None when `workdir` holds none: the run starts from
      `init_from`, or from scratch.
  """

  config: ml_collections.ConfigDict
  workdir: str
  mesh: jax.sharding.Mesh
  rules: tuple
  model: ModelConfig
  tx: optax.GradientTransformation
  schedule: Callable[[Any], Any]
  resume_from: dict | None


def check_run(config: ml_collections.ConfigDict, workdir) -> Run:
  """The checked run of `config` in `workdir`; reads, never writes.

  The checks, in this order (the first that fails is the one-line UserError raised):

  1. every path a user gives (`--workdir`, `init_from`, `data.tokenizer_path`,
     `data.cache_dir`, `data.data_dir`) reaches the filesystem intact in this locale;
  2. a fine-tuning run (`init_from`): that is a training workdir, `finetune.*` fits the
     pre-trained model, no model field that must agree with it is overridden, and
     `data.vocab_size` is its;
  3. the mesh fits the devices and its axis rules parse (`config.mesh`);
  4. `check_config`: positive step counts and sizes, the batch splits over the mesh's
     batch shards, accumulation steps and processes, the eval batch over shards and
     processes, `skip_nonfinite_steps`, GPT-2's `max_len`, `profile_steps`;
  5. the model config (`model_config`: known kind, solver, divisible heads, ...);
  6. the optimizer and its schedule (`optim.*`);
  7. the checkpoint options keep at least one checkpoint;
  8. checkpoints already in `workdir` are of this model and tokenizer settings, and of
     this data source, batch shape and seed unless `resume_with_changes` accepts other
     ones (fingerprint.check_resumable).
  The data's own checks (files, splits, tokenizer) come after, in
  `input_pipeline.create_datasets`, and `record_run` compares its tokenizer and
  content with the checkpoints'.
  """
  config = migrate_config(config)  # old key names and values -> new, with a warning
  workdir = os.fspath(workdir)
  paths = {"--workdir": workdir, "--config.init_from": config.get("init_from")}
  for key in ("tokenizer_path", "cache_dir", "data_dir"):
    paths[f"--config.data.{key}"] = config.data.get(key)
  for flag, value in paths.items():
    if value:
      fileio.check_encodable(value, flag)
  if config.get("init_from"):
    config = finetune.prepare_config(ml_collections.ConfigDict(config.to_dict()))
  try:
    mesh = sharding_lib.make_mesh(config.mesh)
    rules = sharding_lib.logical_axis_rules(config.mesh)
  except sharding_lib.MeshError as e:
    raise ConfigError(str(e)) from e
  check_config(config, mesh, rules)
  model = model_config(config)  # before the data is prepared: a bad model fails fast
  try:
    tx = optimizer_lib.create_optimizer(config.optim, config.num_train_steps, ode=model.is_ode)
    schedule = optimizer_lib.learning_rate_schedule(config.optim, config.num_train_steps)
  except optimizer_lib.OptimConfigError as e:
    raise ConfigError(str(e)) from e
  validate_options(config)
  resume_from = check_resumable(config, workdir)
  return Run(
    config=config,
    workdir=workdir,
    mesh=mesh,
    rules=rules,
    model=model,
    tx=tx,
    schedule=schedule,
    resume_from=resume_from,
  )


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """What `record_run` found and wrote.

  Attributes:
    model: The model config at the tokenizer's vocabulary size (what is trained).
    saved_config: The config as `<workdir>/config.json` and every checkpoint's meta
      hold it: `model.vocab_size` the tokenizer's, `data.tokenizer_path` the file used.
    fingerprint: What this run's checkpoints record they depend on (fingerprint.py).
  """

  model: ModelConfig
  saved_config: ml_collections.ConfigDict
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
    config, tokenizer, workdir, run.resume_from, getattr(ds, "content_hash", None)
  )
  model = model_config(config, ds.vocab_size)  # vocab_size: the tokenizer's
  saved_config = ml_collections.ConfigDict(config.to_dict())
  saved_config.model.vocab_size = model.vocab_size
  if not saved_config.data.get("tokenizer_path") and tokenizer:
    saved_config.data.tokenizer_path = tokenizer  # for tools, beside tokenizer.model
  fileio.makedirs(workdir)
  save_tokenizer(tokenizer, workdir)
  save_config(saved_config, workdir)
  return RunRecord(model=model, saved_config=saved_config, fingerprint=fingerprint)
