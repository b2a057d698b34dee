"""Config names: ModelConfig is the one source of defaults, and old names migrate.

Old -> new: model.kind 'gpt' -> 'transformer', model.flavour -> model.family ('gpt' ->
'gpt2'), model.num_steps -> model.solver_steps (ODE kinds) / model.num_layers (discrete
kinds), finetune.num_steps (0 = keep K) -> finetune.solver_steps (None = keep K), the
tools' --num_steps -> --solver_steps. Runs written before the rename (tests/fixtures/old34)
load, evaluate to the old code's number and resume.
"""

import dataclasses
import json
import logging
import pathlib
import re
import shutil

import ml_collections
import pytest

from odetransformer import cli_flags, errors
from odetransformer.model import config as config_lib
from odetransformer.tools import evaluate
from odetransformer.train import loading, loop, run_config
from odetransformer.train.checkpoint import fingerprint as fingerprint_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "old34"
FIELDS = [f.name for f in dataclasses.fields(config_lib.ModelConfig)]


def test_default_config_is_generated_from_model_config():
  c = config_lib.default_model_config()
  assert sorted(c) == sorted(FIELDS + list(config_lib.DEPRECATED_KEYS))
  for f in dataclasses.fields(config_lib.ModelConfig):
    want = ",".join(f.default) if isinstance(f.default, tuple) else f.default
    assert c[f.name] == want, f.name
    assert f.metadata["meaning"], f.name
  assert all(c[old] is None for old in config_lib.DEPRECATED_KEYS)  # unset: no migration


def test_configs_default_lists_every_model_field_with_a_comment():
  source = (ROOT / "configs" / "default.py").read_text()
  listed = re.findall(r"^  config\.model\.(\w+) = [^#\n]+#", source, flags=re.M)
  assert sorted(listed) == sorted(FIELDS)


def _model(**values):
  c = ml_collections.ConfigDict({"model": config_lib.default_model_config()})
  for key, value in values.items():
    c.model[key] = value
  return c


def test_old_names_migrate_with_one_warning_line_each(caplog):
  with caplog.at_level(logging.WARNING):
    cfg = config_lib.model_config(_model(kind="gpt", flavour="llama", num_steps=3))
  assert (cfg.kind, cfg.family, cfg.num_layers, cfg.solver_steps, cfg.depth) == (
    "transformer",
    "llama",
    3,
    None,
    3,
  )
  assert [r.getMessage() for r in caplog.records] == [
    "model.kind='gpt' is deprecated and will be removed in the next release: use "
    "model.kind='transformer'",
    "model.flavour='llama' is deprecated and will be removed in the next release: use "
    "model.family='llama'",
    "model.num_steps=3 is deprecated and will be removed in the next release: use "
    "model.num_layers=3 (kind='transformer')",
  ]
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    cfg = config_lib.model_config(_model(flavour="gpt", num_steps=5))  # an ODE kind
  assert (cfg.kind, cfg.family, cfg.solver_steps, cfg.num_layers) == (
    "diffeqformer",
    "gpt2",
    5,
    None,
  )
  assert len(caplog.records) == 2


def test_new_names_give_no_warning(caplog):
  with caplog.at_level(logging.WARNING):
    cfg = config_lib.model_config(_model(kind="transformer", family="llama", num_layers=3))
  assert (cfg.depth, caplog.records) == (3, [])


def test_the_depth_a_kind_does_not_use_is_an_error_alone():
  with pytest.raises(
    errors.ConfigError,
    match=r"^model.solver_steps=4 does not apply to "
    r"kind='transformer'; its depth is model.num_layers: set that instead$",
  ):
    config_lib.model_config(_model(kind="transformer", solver_steps=4))
  with pytest.raises(ValueError, match="model.num_layers=3 does not apply"):
    config_lib.ModelConfig(num_layers=3)
  # Beside the one it uses (a config's K under --config.model.kind=transformer with
  # --config.model.num_layers=L) it is not used; the warning only when they differ.
  assert (
    config_lib.model_config(_model(kind="transformer", solver_steps=4, num_layers=6)).depth == 6
  )
  assert config_lib.ModelConfig(kind="transformer").depth == config_lib.DEFAULT_DEPTH


def test_migrate_config_finetune_and_idempotent(caplog):
  old = ml_collections.ConfigDict(
    {"model": {"kind": "gpt", "num_steps": 4}, "finetune": {"method": "lora", "num_steps": 0}}
  )
  with caplog.at_level(logging.WARNING):
    new = run_config.migrate_config(old)
  assert new.finetune.solver_steps is None and "num_steps" not in new.finetune
  assert (new.model.kind, new.model.num_layers) == ("transformer", 4)
  assert "num_steps" not in new.model and "flavour" not in new.model
  assert any(
    "finetune.num_steps=0" in r.getMessage() and "finetune.solver_steps=None" in r.getMessage()
    for r in caplog.records
  )
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    again = run_config.migrate_config(new)
  assert again.to_dict() == new.to_dict() and caplog.records == []
  six = run_config.migrate_config(
    ml_collections.ConfigDict({"finetune": {"method": "full", "num_steps": 6}}), warn=False
  )
  assert six.finetune.solver_steps == 6


def test_an_old_fingerprint_matches_the_same_run_under_new_names():
  stored_config = ml_collections.ConfigDict(
    json.loads((FIXTURES / "llama" / "config.json").read_text())
  )
  stored = fingerprint_lib.fingerprint(stored_config)  # as the old code recorded it
  assert stored["model"]["kind"] == "gpt" and stored["model"]["num_steps"] == 2
  new = run_config.migrate_config(stored_config, warn=False)
  assert fingerprint_lib.fingerprint_diffs(stored, fingerprint_lib.fingerprint(new)) == []
  new.model.num_layers = 3
  assert fingerprint_lib.fingerprint_diffs(stored, fingerprint_lib.fingerprint(new)) == [
    "model.num_layers 2 -> 3"
  ]


def test_old_tool_flag_is_rewritten_with_a_warning(caplog):
  with caplog.at_level(logging.WARNING):
    argv = cli_flags.renamed_flags(
      ["prog", "--num_steps=2,3", "--num_steps", "4", "--step=1"], {"solver_steps", "step"}
    )
  assert argv == ["prog", "--solver_steps=2,3", "--solver_steps", "4", "--step=1"]
  assert "--num_steps is deprecated" in caplog.records[0].getMessage()
  # A command whose own flag is still called num_steps (e.g. analysis.clustering) keeps it.
  assert cli_flags.renamed_flags(["--num_steps=3"], {"num_steps"}) == ["--num_steps=3"]


# The old code's numbers for the fixtures, from the code at 3bd2d70 (tests/fixtures/old34
# was written by it: main.py of configs/default.py with --config.num_train_steps=2
# --config.checkpoint_every_steps=2 --config.seq_len=16 --config.global_batch_size=2
# --config.eval_batch_size=2 --config.model.d_model=16 --config.model.num_heads=2
# --config.model.mlp_dim=32 --config.model.num_steps=2 --config.model.max_len=16
# --config.model.time_embed_dim=4 --config.model.time_sinusoids=4
# --config.data.vocab_size=512 --config.data.tokenizer_sample_bytes=300000, the 'llama'
# one with --config.model.kind=gpt --config.model.flavour=llama), by
#   python -c "from odetransformer import evaluate; \
#              print(repr(evaluate.evaluate(W, [None], max_batches=2)[0].loss))"
OLD_LOSS = {"ode": 6.256077766418457, "llama": 6.258772373199463}
NEW_NAMES = {"ode": ("diffeqformer", "gpt2", 2, None), "llama": ("transformer", "llama", None, 2)}


@pytest.fixture(params=sorted(OLD_LOSS))
def old_run(request, tmp_path):
  workdir = tmp_path / request.param
  shutil.copytree(FIXTURES / request.param, workdir)
  return request.param, str(workdir)


def test_an_old_run_loads_and_evaluates_as_before(old_run):
  name, workdir = old_run
  config = loading.load_run_config(workdir)
  m = config.model
  assert (m.kind, m.family, m.solver_steps, m.num_layers) == NEW_NAMES[name]
  recorded = config.record["model"]  # what a save of this run would write: new names only
  assert "flavour" not in recorded and "num_steps" not in recorded
  # Fields added since take their ModelConfig defaults (the old code's behaviour), not
  # configs/default.py's: the local-error penalty stays off.
  assert (m.local_error_weight, m.train_time_grid) == (0.0, "fixed")
  result = evaluate.evaluate(workdir, [None], max_batches=2)[0]
  assert (result.num_steps, result.num_tokens) == (2, 64)
  assert result.loss == pytest.approx(OLD_LOSS[name], rel=1e-6)


def test_an_old_run_under_a_config_with_the_penalty_is_refused_naming_it(tmp_path):
  """Resuming the old ODE run with its own config plus configs/default.py's local-error
  penalty (a field its checkpoint predates) is a change of training, named in the refusal;
  its own config resumes (the fingerprints match)."""
  workdir = tmp_path / "ode"
  shutil.copytree(FIXTURES / "ode", workdir)
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  _, stored = fingerprint_lib.stored_fingerprint(str(workdir))
  assert fingerprint_lib.fingerprint_diffs(stored, fingerprint_lib.fingerprint(config)) == []
  config.model.local_error_weight = 3000.0
  diffs = fingerprint_lib.fingerprint_diffs(stored, fingerprint_lib.fingerprint(config))
  assert diffs == ["model.local_error_weight 0.0 -> 3000.0"]


@pytest.mark.slow
def test_an_old_run_resumes(tmp_path, tmp_path_factory):
  """The Llama baseline's old run (kind='gpt', flavour='llama', num_steps: every renamed
  model field) resumes under the new names. The ODE run's config loads and evaluates
  above, and its fingerprint matches under the new names
  (test_an_old_fingerprint_matches_the_same_run_under_new_names)."""
  workdir = str(tmp_path / "llama")
  shutil.copytree(FIXTURES / "llama", workdir)
  config = ml_collections.ConfigDict(
    json.loads((pathlib.Path(workdir) / "config.json").read_text())
  )  # the old names
  config.num_train_steps = 3
  config.eval_every_steps = 100
  config.data.tokenizer_path = str(pathlib.Path(workdir) / "tokenizer.model")
  config.data.cache_dir = str(tmp_path_factory.getbasetemp() / "old34_cache")  # prepared once
  result = loop.train_and_evaluate(config, workdir)
  assert (result["start_step"], result["step"]) == (2, 3)
  saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())["model"]
  assert "num_steps" not in saved and "flavour" not in saved and saved["kind"] != "gpt"
