"""Checkpoint integrity: every committed checkpoint carries its
integrity record (written as part of the save), a hard kill never leaves a committed
checkpoint that restores unchecked (checked on the run that test_reliability's SIGKILL
test kills: test_sigkill_then_same_command_resumes_bit_exact), a checkpoint without its
record is refused unless the user says otherwise, a resume on other data, batch shape or
seed is refused, and a reader whose step is rotated away moves to the newest one."""

import gc
import json
import shutil

from absl import flags
from absl import logging as absl_logging
import jax
import numpy as np
import pytest
from test_reliability import CHECKPOINT_ITEMS, STEPS, config, snapshot
from test_train import fast_compiles  # noqa: F401  (fast_compiles: autouse fixture, the rbg PRNG)

import input_pipeline
from odetransformer import errors
from odetransformer.tools import generate
from odetransformer.train import loading, loop
from odetransformer.train.checkpoint import restore
from odetransformer.train.checkpoint.fingerprint import stored_fingerprint
from odetransformer.train.checkpoint.integrity import INTEGRITY_FILE, UnverifiedCheckpointError
from odetransformer.train.checkpoint.paths import CheckpointError, finalized_steps

pytestmark = [pytest.mark.xdist_group("test_integrity"), pytest.mark.slow]


@pytest.fixture(scope="module")
def cache(shared_data_cache):
  """The tokenizer/data cache of every run of this module: the session's (conftest)."""
  return shared_data_cache


@pytest.fixture(scope="module")
def trained(cache, tmp_path_factory):
  """A run stopped at step 6: checkpoints 2, 4 and 6 (to be copied by tests, which resume
  it to STEPS). Its schedule is the STEPS-step one of those runs (and test_reliability's):
  one compiled train step for all of them."""
  wd = tmp_path_factory.mktemp("trained")
  loop.train_and_evaluate(config(cache, STEPS, checkpoint_every_steps=2), str(wd), stop_at_step=6)
  assert finalized_steps(str(wd)) == [2, 4, 6]
  return wd


@pytest.fixture
def run_copy(trained, tmp_path):
  wd = tmp_path / "run"
  shutil.copytree(trained, wd)
  return wd


def _flip_byte(path, offset=None):
  data = bytearray(path.read_bytes())
  data[len(data) // 2 if offset is None else offset] ^= 0x10
  path.write_bytes(bytes(data))


def _largest_file(item_dir):
  return max((p for p in item_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _params(workdir, step=None):
  loaded = loading.load_model(str(workdir), step=step)
  return loaded.step, jax.tree.map(np.asarray, jax.tree.leaves(loaded.model))


# The reads that fail leave orbax coroutines holding their error, reported (as
# "Exception ignored in ...") whenever they are collected: here, not in a later test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_flipped_byte_in_any_file_never_restores_different_values(run_copy):
  """Each file of the model item, one byte flipped at a time: the read either fails or
  gives exactly the saved values (a file the read never opens); the array data files
  and everything the record lists fail."""
  _, reference = _params(run_copy, step=6)
  item = run_copy / "checkpoints" / "6" / "model"
  record = json.loads((item / INTEGRITY_FILE).read_text())
  files = sorted(p for p in item.rglob("*") if p.is_file())
  detected = set()
  for path in files:
    original = path.read_bytes()
    _flip_byte(path)
    try:
      _, values = _params(run_copy, step=6)
    except CheckpointError:
      detected.add(path.relative_to(item).as_posix())
    else:
      for a, b in zip(values, reference):
        np.testing.assert_array_equal(a, b)
    finally:
      path.write_bytes(original)
  assert set(record["sha256"]) <= detected | {"commit_success.txt"}, detected
  assert _largest_file(item).relative_to(item).as_posix() in detected
  gc.collect()


def test_checkpoint_without_its_record_is_refused_unless_allowed(run_copy, cache):
  """A committed checkpoint whose record is gone (or that an older version wrote) is
  not restored unchecked: one line naming the flag, nothing moved; the flag restores it."""
  for step in (2, 4, 6):
    (run_copy / "checkpoints" / str(step) / "model" / INTEGRITY_FILE).unlink()
  before = snapshot(run_copy / "checkpoints")
  with pytest.raises(UnverifiedCheckpointError) as err:
    loop.train_and_evaluate(config(cache, STEPS, checkpoint_every_steps=2), str(run_copy))
  msg = str(err.value)
  assert "step 6" in msg and "no integrity record (model" in msg and "\n" not in msg
  assert "--config.checkpoint_allow_unverified=true" in msg
  assert snapshot(run_copy / "checkpoints") == before
  with pytest.raises(UnverifiedCheckpointError):
    loading.load_model(str(run_copy))
  assert loading.load_model(str(run_copy), allow_unverified=True).step == 6
  fv = generate.define_flags(flags.FlagValues())  # the tool names its own flag
  fv(["generate", f"--workdir={run_copy}", "--prompt=def", "--max_new_tokens=2"])
  verbosity = absl_logging.get_verbosity()  # (the tool lowers it)
  try:
    with pytest.raises(UnverifiedCheckpointError) as err:
      generate.main([], fv)
  finally:
    absl_logging.set_verbosity(verbosity)
  msg = str(err.value)
  assert "no integrity record" in msg and "--checkpoint_allow_unverified" in msg
  assert "\n" not in msg
  r = loop.train_and_evaluate(
    config(cache, STEPS, checkpoint_every_steps=2, checkpoint_allow_unverified=True), str(run_copy)
  )
  assert (r["start_step"], r["step"]) == (6, STEPS)
  for item in CHECKPOINT_ITEMS:  # what this run saved has its record again
    assert (run_copy / "checkpoints" / str(STEPS) / item / INTEGRITY_FILE).is_file()


class _WithContentHash:
  """`create_datasets`'s result with a `content_hash` attribute."""

  def __init__(self, ds, content_hash):
    self._ds, self.content_hash = ds, content_hash

  def __getattr__(self, name):
    return getattr(self._ds, name)


@pytest.mark.parametrize(
  "change,needle",
  [
    ({"global_batch_size": 8}, "resume.global_batch_size 4 -> 8"),
    ({"seq_len": 16}, "resume.seq_len 32 -> 16"),
    ({"seed": 1}, "resume.seed 0 -> 1"),
  ],
)
def test_resume_with_another_batch_shape_or_seed_is_refused(change, needle, run_copy, cache):
  """Used to resume silently: no longer an exact continuation."""
  before = snapshot(run_copy / "checkpoints")
  with pytest.raises(errors.ConfigError) as err:
    loop.train_and_evaluate(config(cache, STEPS, checkpoint_every_steps=2, **change), str(run_copy))
  msg = str(err.value)
  assert needle in msg and "--config.resume_with_changes=true" in msg and "\n" not in msg
  assert snapshot(run_copy / "checkpoints") == before


def test_resume_on_other_data_is_refused_unless_accepted(run_copy, cache, monkeypatch):
  """Used to resume silently with `data.tokenizer_path` set (the fingerprint held the
  data glob, not its content): the iterator position then applied to another corpus."""
  trained_on = stored_fingerprint(str(run_copy))[1]["data_content_hash"]
  assert trained_on and trained_on != "corpus-B"
  create = input_pipeline.create_datasets
  monkeypatch.setattr(
    input_pipeline, "create_datasets", lambda *a, **k: _WithContentHash(create(*a, **k), "corpus-B")
  )
  before = snapshot(run_copy / "checkpoints")
  with pytest.raises(errors.ConfigError) as err:
    loop.train_and_evaluate(config(cache, STEPS, checkpoint_every_steps=2), str(run_copy))
  assert f"training data content {trained_on[:40]!r} -> 'corpus-B'" in str(err.value)
  assert "--config.resume_with_changes=true" in str(err.value)
  assert snapshot(run_copy / "checkpoints") == before
  r = loop.train_and_evaluate(
    config(cache, STEPS, checkpoint_every_steps=2, resume_with_changes=True), str(run_copy)
  )
  assert (r["start_step"], r["step"]) == (6, STEPS)
  meta = stored_fingerprint(str(run_copy))[1]
  assert meta["data_content_hash"] == "corpus-B"  # what the run now trains on


def test_a_model_change_is_not_accepted_by_resume_with_changes(run_copy, cache):
  c = config(cache, STEPS, checkpoint_every_steps=2, resume_with_changes=True)
  c.model.mlp_dim = 128
  with pytest.raises(errors.ConfigError, match="model.mlp_dim 64 -> 128"):
    loop.train_and_evaluate(c, str(run_copy))


def test_reader_whose_step_is_rotated_away_reads_the_newest(
  run_copy, tmp_path, monkeypatch, caplog
):
  """A tool lists steps [2, 4] and picks 4; before it reads, the trainer commits 6 and
  its max_to_keep deletes 4. Used to report the healthy run as corrupt."""
  ck = run_copy / "checkpoints"
  _, expected = _params(run_copy, step=6)
  shutil.move(ck / "6", tmp_path / "6")  # not committed yet when the tool lists
  read_step = restore._read_step
  seen = []

  def rotate_then_read(manager, directory, step, *args):
    seen.append(step)
    if step == 4 and not (ck / "6").exists():
      shutil.move(tmp_path / "6", ck / "6")  # the trainer commits 6 ...
      shutil.rmtree(ck / "4")  # ... and rotates 4 away
    return read_step(manager, directory, step, *args)

  monkeypatch.setattr(restore, "_read_step", rotate_then_read)
  step, values = _params(run_copy)
  assert (step, seen) == (6, [4, 6])
  for a, b in zip(values, expected):
    np.testing.assert_array_equal(a, b)
  logged = caplog.text.lower()
  assert "was deleted while being read" in logged
  assert "corrupt" not in logged and "does not restore" not in logged


def test_checkpoints_naming_the_handlers_module_before_the_split_restore(run_copy, cache):
  """Orbax records each item's handler by module path in the step's metadata: those
  written before train/checkpointing.py became the train/checkpoint/ package name the
  old module. They load and resume all the same, to the same values."""
  step, values = _params(run_copy)
  for path in (run_copy / "checkpoints").glob("*/_CHECKPOINT_METADATA"):
    text = path.read_text()
    assert "odetransformer.train.checkpoint.integrity._Integrity" in text, text
    path.write_text(
      text.replace(
        "odetransformer.train.checkpoint.integrity.", "odetransformer.train.checkpointing."
      )
    )
  old_step, old_values = _params(run_copy)
  assert old_step == step == 6
  assert all(np.array_equal(a, b) for a, b in zip(old_values, values))
  r = loop.train_and_evaluate(config(cache, STEPS, checkpoint_every_steps=2), str(run_copy))
  assert (r["start_step"], r["step"]) == (6, STEPS)
