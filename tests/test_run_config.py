"""The typed run config: read once from the ml_collections config, equal to it key by
key, defaults for keys a recorded run lacks, one warning, one reader of config keys."""

import importlib
import logging
import pathlib
import re

import ml_collections
import pytest

from configs import default
from odetransformer.errors import ConfigError
from odetransformer.train import run_config as rc
from odetransformer.train import setup

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if not p.stem.startswith("_"))


def _leaves(node, prefix=""):
  for key, value in node.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _typed_value(run: rc.RunConfig, key: str):
  """Where `key` of the ml_collections config lives in the typed one."""
  if key in rc._TOP_LEVEL:
    section, field = rc._TOP_LEVEL[key]
    return getattr(getattr(run, section), field)
  section, field = key.split(".", 1)
  if section == "mesh" and field.startswith("rules."):
    return dict(run.mesh.rules)[field.split(".", 1)[1]]
  return getattr(getattr(run, section), field)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_key_of_every_config_reads_into_its_section(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  run = rc.RunConfig.from_config(config, warn=False)  # strict: an unknown key would raise
  migrated = rc.migrate_config(config, warn=False)
  for key, value in _leaves(migrated):
    if key.startswith("mesh.rules.") or value is None:
      continue  # rules are parsed (tuples), compared below; None keeps the default
    if (key.startswith("finetune.") or key == "init_from") and run.finetune is None:
      assert not migrated.get("init_from")  # no init_from: not a fine-tuning run
      continue
    typed = _typed_value(run, key)
    if isinstance(typed, tuple) and key != "mesh.shape":
      typed = ",".join(typed)
    assert typed == (tuple(value) if key == "mesh.shape" else value), key
  rules = dict(run.mesh.rules)
  for name_, target in dict(migrated.mesh.rules).items():
    expected = tuple(t for t in str(target).split(",") if t) if target else None
    expected = expected[0] if expected and len(expected) == 1 else expected
    assert rules[name_] == expected, name_


def test_a_recorded_run_without_newer_keys_gets_their_defaults():
  record = default.get_config().to_dict()
  for key in ("workdir_lock_stale_s", "checkpoint_allow_unverified", "profile_steps"):
    del record[key]
  del record["optim"]["skip_nonfinite_steps"], record["data"]["input_shards"]
  record["a_key_since_removed"] = 1
  run = rc.RunConfig.from_config(record, recorded=True)
  assert run.checkpoint.lock_stale_s == rc.CheckpointConfig.lock_stale_s == 600.0
  assert run.checkpoint.allow_unverified is False and run.schedule.profile_steps == ""
  assert run.optim.skip_nonfinite_steps == 0 and run.data.input_shards == 0
  with pytest.raises(ConfigError, match="a_key_since_removed"):
    rc.RunConfig.from_config(record)  # a user's config: an unknown key is a mistake


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("num_train_steps", 0, "num_train_steps=0 must be positive"),
    ("eval_every_steps", -1, "eval_every_steps=-1 must be >= 0"),
    ("checkpoint_max_to_keep", 0, "checkpoint_max_to_keep=0 would keep no checkpoint"),
    ("optim.grad_accum_steps", 0, "optim.grad_accum_steps=0 must be >= 1"),
    ("optim.learning_rate", float("nan"), "optim.learning_rate=nan must be a finite number"),
    ("profile_steps", "5,2", "profile_steps='5,2' must be 'a,b'"),
    ("mesh.rules.embed", "pipeline", "names unknown mesh axes"),
    ("data.vocab_size", 0, "data.vocab_size=0 must be positive"),
    ("model.num_heads", 3, "num_heads"),
  ],
)
def test_a_bad_value_is_one_line_naming_its_key(key, value, message):
  config = default.get_config()
  node, _, leaf = key.rpartition(".")
  target = config
  for part in filter(None, node.split(".")):
    target = target[part]
  with target.ignore_type():
    target[leaf] = value
  with pytest.raises(ConfigError, match=re.escape(message)) as e:
    rc.RunConfig.from_config(config)
  assert "\n" not in str(e.value)


def test_an_unused_depth_warns_once_per_run(tmp_path, caplog):
  """The README's `--config.model.solver_steps=8` on the default config (num_layers 4):
  the run's check reads the config once, so the warning is printed once."""
  config = default.get_config()
  config.model.solver_steps = 8
  with caplog.at_level(logging.WARNING):
    run = setup.check_run(config, tmp_path / "run")
  assert run.config.model.depth == 8
  said = [r for r in caplog.records if "is not used by kind" in r.getMessage()]
  assert len(said) == 1, [r.getMessage() for r in said]


def test_only_run_config_reads_config_keys_with_defaults():
  """No `config.get(key, default)` outside odetransformer/train/run_config.py: a second
  copy of a default drifts from the first."""
  pattern = re.compile(r"\b\w*(config|cfg)\w*(\.\w+)*\.get\(\s*['\"]\w+['\"]\s*,")
  found = [
    f"{path.relative_to(ROOT)}:{i}"
    for package in ("odetransformer", "input_pipeline")
    for path in sorted((ROOT / package).rglob("*.py"))
    if path.name != "run_config.py"
    for i, line in enumerate(path.read_text().splitlines(), 1)
    if pattern.search(line)
  ]
  assert found == []


@pytest.mark.slow
def test_the_config_walk_of_a_run_is_short():
  """Following the run's config through a default run (tests/config_walk.py): at most 4
  climbs back up the layers, no module re-entered more than twice, and the config read
  only by loop, setup and run_config (the code below takes sections)."""
  import config_walk

  walk = config_walk.default_walk()
  assert len(walk.climbs) <= 4, walk.climbs
  assert walk.max_entries <= 3, walk.entries
  assert set(walk.modules) <= {
    "odetransformer.train.loop",
    "odetransformer.train.setup",
    "odetransformer.train.run_config",
  }, walk.modules


def test_key_value_heads_must_split_over_the_heads_mesh_axis():
  """4 query heads with 2 key/value heads on a tensor axis of 4: the K, V weights' head
  axis cannot be split 4 ways; 2 ways it can. (`check_config` reads only the mesh's axis
  sizes, so a stand-in mesh of 4 tensor devices serves on this 1-device machine.)"""
  config = default.get_config()
  config.model.family, config.model.num_kv_heads = "llama", 2
  config.mesh.rules.heads = "tensor"
  run = rc.RunConfig.from_config(config, warn=False)
  mesh = type("Mesh", (), {"shape": {"data": 1, "fsdp": 1, "tensor": 4}})()
  with pytest.raises(
    ConfigError, match=r"num_kv_heads=2 key/value heads cannot be split over the 4"
  ):
    setup.check_config(run, mesh)
  mesh.shape = {"data": 1, "fsdp": 1, "tensor": 2}
  setup.check_config(run, mesh)


def test_local_error_stride_that_splits_a_shards_rows_is_said(caplog):
  """model.local_error_stride picks rows within each batch shard's microbatch: 16 rows
  over 2 shards and 2 accumulation steps leave 4 a shard, which a stride of 4 divides and
  8 does not (logged: the model takes rows gcd(8, 4) = 4 apart, an unbiased estimate
  still, at more cost; a debug line, not a warning: a pod's microbatches of one or two
  rows a device are common); without the penalty (or on a discrete kind, which ignores
  it) nothing is said."""
  caplog.set_level(logging.DEBUG, logger="absl")  # whatever verbosity absl was left at
  config = default.get_config()
  config.global_batch_size, config.optim.grad_accum_steps = 16, 2
  config.model.local_error_weight, config.model.local_error_stride = 3000.0, 8
  mesh = type("Mesh", (), {"shape": {"data": 2, "fsdp": 1, "tensor": 1}})()

  def said():
    return [r.getMessage() for r in caplog.records if "local_error_stride" in r.getMessage()]

  setup.check_config(rc.RunConfig.from_config(config, warn=False), mesh)
  assert said() and said()[0].startswith(
    "model.local_error_stride=8 does not divide the 4 rows each batch shard trains per "
    "microbatch: the local error takes rows 4 apart instead"
  )
  for weight, stride, kind in (
    (3000.0, 4, "diffeqformer"),
    (0.0, 8, "diffeqformer"),
    (3000.0, 8, "transformer"),
  ):
    caplog.clear()
    config.model.local_error_weight, config.model.local_error_stride = weight, stride
    config.model.kind = kind
    setup.check_config(rc.RunConfig.from_config(config, warn=False), mesh)
    assert said() == [], (weight, stride, kind)
