"""A run's settings, typed: `RunConfig.from_config(config)` reads the ml_collections config
(what users write and override on the command line) once, into frozen sections, each
field with its meaning, its default and its check.

    run = RunConfig.from_config(config)      # one-line ConfigError on a bad value
    run.optim.learning_rate, run.schedule.num_train_steps, run.model.depth, ...

Sections and the keys they read:
  schedule    num_train_steps, log_every_steps, profile_steps    (ScheduleConfig)
  batch       seq_len, global_batch_size, seed                   (BatchConfig)
  eval        eval_every_steps, eval_batch_size                  (EvalConfig)
  checkpoint  checkpoint_*, workdir_lock_stale_s, resume_with_changes (CheckpointConfig)
  optim       optim.*                                            (OptimConfig)
  mesh        mesh.shape, mesh.rules                             (MeshConfig)
  data        data.*                                   (input_pipeline.config.DataConfig)
  model       model.*                               (odetransformer.model.config.ModelConfig)
  finetune    init_from, finetune.*                    (FinetuneConfig; None without init_from)
  metrics     peak_flops_per_device, parameter_table             (MetricsConfig)

A key a config lacks takes the default here: a run recorded before the key existed
restores with the meaning it had (`from_config(saved, recorded=True)`, which also drops
keys since removed); old key names are migrated as `migrate_config` says, with one
warning each. This is the one module that reads config keys; the code downstream takes
the section it needs.
"""

import copy
import dataclasses
import math
import typing

import ml_collections

from input_pipeline.config import DataConfig
from odetransformer.errors import ConfigError
from odetransformer.model.config import (
  DEPRECATED_KEYS,
  ModelConfig,
  default_model_config,
  migrate_model_fields,
  warn_renamed,
)
from odetransformer.runtime import fileio

# The optimizer's weight-decay groups (odetransformer/train/optimizer.py says which
# parameters each holds).
DECAY_GROUPS = ("auto", "embeddings", "matrices")
SCHEDULES = ("cosine", "constant")


def _fields(cls, values: dict, prefix: str, strict: bool) -> dict:
  """`values` typed as `cls`'s fields; keys it lacks keep the defaults; None keeps a
  default too (an unset placeholder). Unknown keys: ConfigError when `strict`."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - set(fields))
  if unknown and strict:
    raise ConfigError(f"unknown keys {[prefix + k for k in unknown]}; valid: {sorted(fields)}")
  hints = typing.get_type_hints(cls)
  out = {}
  for name, value in values.items():
    if name not in fields:
      continue
    kind = hints[name]
    if value is None:  # an unset placeholder: the default, unless None is a value
      if type(None) in typing.get_args(kind):
        out[name] = None
      continue
    try:
      if kind is bool:
        out[name] = bool(value)
      elif kind in (int, float, str):
        out[name] = kind(value)
      else:
        out[name] = value
    except (TypeError, ValueError) as e:
      raise ConfigError(f"{prefix}{name}={value!r} is not a {kind.__name__}") from e
  return out


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """How long the run is and how often it logs (all in optimizer steps).

  Attributes:
    num_train_steps: Optimizer steps of the run (the learning-rate schedule's length).
    log_every_steps: Train log line and TensorBoard scalars; 0 = only at the end.
    profile_steps: 'a,b': a jax.profiler trace of train steps a+1..b into
      <workdir>/tensorboard; '' = none.
  """

  num_train_steps: int = 500
  log_every_steps: int = 25
  profile_steps: str = ""

  def __post_init__(self):
    from odetransformer.train.metrics import ProfileWindow  # lazy: imports jax

    if self.num_train_steps <= 0:
      raise ConfigError(f"num_train_steps={self.num_train_steps} must be positive")
    if self.log_every_steps < 0:
      raise ConfigError(f"log_every_steps={self.log_every_steps} must be >= 0 (0 = at the end)")
    ProfileWindow.parse(self.profile_steps)


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  """The training batch and the seed: what makes a resume continue the run exactly.

  Attributes:
    seq_len: Tokens per training row (packed documents).
    global_batch_size: Rows per optimizer step, all devices together.
    seed: Parameter init, data order and dropout.
  """

  seq_len: int = 128
  global_batch_size: int = 16
  seed: int = 0

  def __post_init__(self):
    for name in ("seq_len", "global_batch_size"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"{name}={getattr(self, name)} must be positive")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Evaluation during training (on the data's eval split; `data.eval_max_batches` bounds it).

  Attributes:
    every_steps: `eval_every_steps`: evaluate every this many steps and at the end;
      0 = only at the end.
    batch_size: `eval_batch_size`: rows per evaluation batch, all devices together.
  """

  every_steps: int = 250
  batch_size: int = 16

  def __post_init__(self):
    if self.every_steps < 0:
      raise ConfigError(f"eval_every_steps={self.every_steps} must be >= 0 (0 = at the end)")
    if self.batch_size <= 0:
      raise ConfigError(f"eval_batch_size={self.batch_size} must be positive")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Checkpoints and the workdir they live in.

  Attributes:
    every_steps: `checkpoint_every_steps`: an async save every this many steps and at
      the end; 0 = only at the end.
    max_to_keep: `checkpoint_max_to_keep`: older checkpoints are deleted; None = keep all.
    async_save: `checkpoint_async`: save in the background while training goes on.
    allow_unverified: `checkpoint_allow_unverified`: restore checkpoints written
      without an integrity record.
    resume_with_changes: Resume despite other data, batch shape or seed.
    lock_stale_s: `workdir_lock_stale_s`: on gs://, a lock this long without a heartbeat
      is taken over.
  """

  every_steps: int = 250
  max_to_keep: int | None = 3
  async_save: bool = True
  allow_unverified: bool = False
  resume_with_changes: bool = False
  lock_stale_s: float = 600.0

  def __post_init__(self):
    if self.every_steps < 0:
      raise ConfigError(
        f"checkpoint_every_steps={self.every_steps} must be >= 0 (0 = only at the end)"
      )
    if self.max_to_keep is not None and self.max_to_keep < 1:
      raise ConfigError(
        f"checkpoint_max_to_keep={self.max_to_keep!r} would keep no checkpoint (not even "
        "the final one); use a positive count, e.g. 3"
      )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with a warm-up and cosine schedule (odetransformer/train/optimizer.py).

  Attributes:
    name: Only 'adamw'.
    learning_rate: The peak learning rate.
    schedule: 'cosine' (to min_lr_ratio × peak at num_train_steps) or 'constant',
      after the warm-up.
    warmup_frac: Warm-up steps = warmup_frac × num_train_steps (linear from 0).
    min_lr_ratio: The cosine's final learning rate, as a fraction of the peak.
    b1, b2, eps: AdamW's moments and epsilon.
    weight_decay: Decoupled weight decay (scaled by the learning rate).
    weight_decay_on: The decayed group: 'auto' (embeddings only for ODE kinds, as the
      authors' code; matrices for discrete ones), 'embeddings' or 'matrices'.
    grad_clip_norm: Global-norm clipping of the (accumulated) gradient; 0 = off.
    grad_accum_steps: Microbatches per optimizer step.
    skip_nonfinite_steps: Steps with a NaN/inf loss or gradient to skip in a row (state
      unchanged, batch consumed) before stopping; 0 = stop at the first, keeping the
      last good checkpoint.
  """

  name: str = "adamw"
  learning_rate: float = 1e-3
  schedule: str = "cosine"
  warmup_frac: float = 0.02
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  weight_decay_on: str = "auto"
  grad_clip_norm: float = 0.0
  grad_accum_steps: int = 1
  skip_nonfinite_steps: int = 0

  def __post_init__(self):
    if self.name != "adamw":
      raise ConfigError(f"optim.name={self.name!r} is unknown; only 'adamw'")
    for key in ("b1", "b2"):
      if not 0.0 <= getattr(self, key) < 1.0:  # also refuses nan
        raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")
    if not 0 < self.learning_rate < math.inf:
      raise ConfigError(
        f"optim.learning_rate={self.learning_rate} must be a finite number > 0, e.g. 3e-4"
      )
    for key in ("eps", "weight_decay", "grad_clip_norm", "warmup_frac", "min_lr_ratio"):
      if not 0 <= getattr(self, key) < math.inf:
        raise ConfigError(f"optim.{key}={getattr(self, key)} must be a finite number >= 0")
    if self.weight_decay_on not in DECAY_GROUPS:
      raise ConfigError(
        f"optim.weight_decay_on={self.weight_decay_on!r} is unknown; choose one of "
        f"{list(DECAY_GROUPS)}"
      )
    if self.schedule not in SCHEDULES:
      raise ConfigError(
        f"optim.schedule={self.schedule!r} is unknown; choose 'cosine' or 'constant'"
      )
    if self.grad_accum_steps <= 0:
      raise ConfigError(f"optim.grad_accum_steps={self.grad_accum_steps} must be >= 1")
    if self.skip_nonfinite_steps < 0:
      raise ConfigError(
        f"optim.skip_nonfinite_steps={self.skip_nonfinite_steps} must be >= 0 (0 = stop at "
        "the first non-finite step)"
      )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The device mesh (data, fsdp, tensor) and where each logical axis goes on it.

  Attributes:
    shape: Sizes of the ('data', 'fsdp', 'tensor') axes; -1 = the remaining devices.
    rules: The logical-axis rules, parsed: ((logical name, mesh axis, axes or None), ...)
      for `nnx.logical_axis_rules`, from `mesh.rules` over odetransformer/train/sharding.py's
      defaults.
  """

  shape: tuple = (1, -1, 1)
  rules: tuple = ()

  @classmethod
  def from_dict(cls, values: dict) -> "MeshConfig":
    from odetransformer.train import sharding  # lazy: imports jax

    values = dict(values or {})
    try:
      rules = sharding.logical_axis_rules(values.get("rules"))
    except sharding.MeshError as e:
      raise ConfigError(str(e)) from e
    return cls(shape=tuple(values.get("shape") or cls.shape), rules=rules)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
  """A fine-tuning run: start from the weights of another run (odetransformer/train/finetune.py).

  Attributes:
    init_from: The pre-training run's workdir.
    method: 'continuous' (train the hypernetworks at N steps), 'full' (N discrete
      layers, all weights trained) or 'lora' (N frozen layers with low-rank adapters).
    solver_steps: N; None = the pre-trained model's depth.
    lora_rank, lora_alpha: The adapters' rank and scale (alpha / rank).
    targets: The adapted layer weights, comma-separated.
    train_embeddings: LoRA: also train the embeddings, norms and head.
    lora_init: 'zero_b' (A ~ N(0, 1/in), B = 0) or 'small' (both 1e-6·N(0, 1)).
  """

  init_from: str = ""
  method: str = "continuous"
  solver_steps: int | None = None
  lora_rank: int = 8
  lora_alpha: float = 16.0
  targets: str = "wq,wk,wv,wo"
  train_embeddings: bool = False
  lora_init: str = "zero_b"


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  """What the run reports besides loss.

  Attributes:
    peak_flops_per_device: FLOP/s for MFU; 0 = the device's (a table; CPU: measured).
    parameter_table: Also log every parameter's shape and statistics.
  """

  peak_flops_per_device: float = 0.0
  parameter_table: bool = False


def migrate_config(
  config: ml_collections.ConfigDict, warn: bool = True
) -> ml_collections.ConfigDict:
  """A copy of a run's config with `model` (and `finetune`) under their new names, one
  warning line per old name (`warn`); configs with new names come back equal.

  `finetune.num_steps` (0 = keep the pre-trained K) became `finetune.solver_steps`
  (None = keep it).
  """
  config = ml_collections.ConfigDict(config.to_dict())
  if "model" in config:
    values = migrate_model_fields(config.model.to_dict(), warn)  # old keys popped
    model = default_model_config()
    for old in DEPRECATED_KEYS:
      del model[old]
    model.update(values)
    config.model = model
  finetune = config.get("finetune")
  if finetune is not None and "num_steps" in finetune:
    n = finetune.num_steps
    with finetune.unlocked():
      del finetune["num_steps"]
      if n is not None:
        new = int(n) or None
        if warn:
          warn_renamed(f"finetune.num_steps={n}", f"finetune.solver_steps={new}")
        finetune.solver_steps = new
  return config


# Top-level config keys -> (section, field).
_TOP_LEVEL = {
  "num_train_steps": ("schedule", "num_train_steps"),
  "log_every_steps": ("schedule", "log_every_steps"),
  "profile_steps": ("schedule", "profile_steps"),
  "seq_len": ("batch", "seq_len"),
  "global_batch_size": ("batch", "global_batch_size"),
  "seed": ("batch", "seed"),
  "eval_every_steps": ("eval", "every_steps"),
  "eval_batch_size": ("eval", "batch_size"),
  "checkpoint_every_steps": ("checkpoint", "every_steps"),
  "checkpoint_max_to_keep": ("checkpoint", "max_to_keep"),
  "checkpoint_async": ("checkpoint", "async_save"),
  "checkpoint_allow_unverified": ("checkpoint", "allow_unverified"),
  "resume_with_changes": ("checkpoint", "resume_with_changes"),
  "workdir_lock_stale_s": ("checkpoint", "lock_stale_s"),
  "init_from": ("finetune", "init_from"),
  "peak_flops_per_device": ("metrics", "peak_flops_per_device"),
  "parameter_table": ("metrics", "parameter_table"),
}
_SECTIONS = {
  "schedule": ScheduleConfig,
  "batch": BatchConfig,
  "eval": EvalConfig,
  "checkpoint": CheckpointConfig,
  "finetune": FinetuneConfig,
  "metrics": MetricsConfig,
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A run's settings, typed (the module docstring lists the sections).

  `record` is the config as the run records it (`<workdir>/config.json`, every
  checkpoint's meta): the migrated ml_collections config as plain JSON values.
  """

  schedule: ScheduleConfig
  batch: BatchConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  optim: OptimConfig
  mesh: MeshConfig
  data: DataConfig
  model: ModelConfig
  finetune: FinetuneConfig | None
  metrics: MetricsConfig
  record: dict = dataclasses.field(repr=False, compare=False, default_factory=dict)

  @classmethod
  def from_config(cls, config, recorded: bool = False, warn: bool = True) -> "RunConfig":
    """The typed settings of `config` (an ml_collections ConfigDict or a dict).

    `recorded`: a run's recorded config (config.json): keys since removed are dropped
    rather than refused, and no warning is given for old names (`warn` otherwise)."""
    if not isinstance(config, ml_collections.ConfigDict):
      config = ml_collections.ConfigDict(dict(config))
    config = migrate_config(config, warn=warn and not recorded)
    plain = config.to_dict()
    data = plain.get("data") or {}
    paths = {"init_from": plain.get("init_from")}
    paths.update({f"data.{k}": data.get(k) for k in ("tokenizer_path", "cache_dir", "data_dir")})
    for key, value in paths.items():
      if value and not recorded:  # reaches the filesystem intact in this locale
        fileio.check_encodable(value, f"--config.{key}")
    return cls._build(plain, strict=not recorded)

  @classmethod
  def _build(cls, plain: dict, strict: bool) -> "RunConfig":
    """The sections of `plain`, a config `migrate_config` has given the new names."""
    values = {name: {} for name in _SECTIONS}
    nested = ("model", "data", "optim", "mesh", "finetune")
    for key, value in plain.items():
      if key in _TOP_LEVEL:
        section, field = _TOP_LEVEL[key]
        values[section][field] = value
      elif key not in nested and strict:
        raise ConfigError(f"unknown config key {key!r}; valid: {sorted(_TOP_LEVEL)}")
    values["finetune"].update(plain.get("finetune") or {})
    sections = {
      name: section(**_fields(section, values[name], "", strict))
      for name, section in _SECTIONS.items()
    }
    if not sections["finetune"].init_from:
      sections["finetune"] = None
    try:
      data = DataConfig(**_fields(DataConfig, plain.get("data") or {}, "data.", strict))
    except ValueError as e:
      raise ConfigError(str(e)) from e
    optim = OptimConfig(**_fields(OptimConfig, plain.get("optim") or {}, "optim.", strict))
    model_values = plain.get("model") or {}
    if not strict:
      names = {f.name for f in dataclasses.fields(ModelConfig)}
      model_values = {k: v for k, v in model_values.items() if k in names}
    try:
      model = ModelConfig.from_config(model_values, warn=False)
    except (ValueError, TypeError) as e:
      raise ConfigError(str(e)) from e
    return cls(
      **sections,
      optim=optim,
      mesh=MeshConfig.from_dict(plain.get("mesh")),
      data=data,
      model=model,
      record=plain,
    )

  def replace(self, **changes) -> "RunConfig":
    """A copy with `changes` (sections), its record updated to match."""
    record = copy.deepcopy(self.record)
    if "model" in changes:
      model, before = changes["model"], record.get("model", {})
      section = {**before, **model_record(model)}
      # A discrete model materialised from an ODE has no K: the pre-trained K would stay
      # in the record as the depth field its kind does not use, differing from its
      # depth. Left out, it reads as unset (None); a key only one fingerprint has is not
      # compared, so a run recorded with it still resumes.
      unused = model.unused_depth_field
      if before.get("kind") != model.kind and section.get(unused) != model.depth:
        section.pop(unused, None)
      record["model"] = section
    if "data" in changes:
      record["data"] = {**record.get("data", {}), **dataclasses.asdict(changes["data"])}
    return dataclasses.replace(self, **changes, record=record)


def model_record(cfg: ModelConfig) -> dict:
  """A ModelConfig as `config.model` records it (tuples as comma-separated text)."""
  return {
    f.name: ",".join(v) if isinstance(v := getattr(cfg, f.name), tuple) else v
    for f in dataclasses.fields(cfg)
  }
