"""A run never loses work: SIGKILL + restart is bit-exact, SIGTERM saves and exits 75
(stopped early, resumable), divergence stops with the last good checkpoint intact,
checkpoints move between 8 and 1 devices, corrupt checkpoints are skipped, and bad input
is one line with nothing written.

No silent data loss, no hang, one line for every bad input (section 7):
each misuse case runs the real command in a process of its own (main.py or a tool's
module, run as `python` runs it: CommandServer) and checks its exit status, its single
`error:` line (no traceback) and that the workdir is exactly as it was."""

import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from test_train import ROOT, TINY_FLAGS, _final_params, fast_compiles, tiny_config  # noqa: F401  (fast_compiles: autouse fixture, the rbg PRNG)

from input_pipeline import DataError, tokenizer
from odetransformer import errors
from odetransformer.model import hypernet
from odetransformer.runtime import workdir_lock
from odetransformer.train import health, loading, loop, steps
from odetransformer.train import metrics as metrics_lib
from odetransformer.train.checkpoint.integrity import INTEGRITY_FILE
from odetransformer.train.checkpoint.paths import OWNERS_DIR, CheckpointError, finalized_steps

from tiny import cpu_env

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = [pytest.mark.xdist_group("test_reliability"), pytest.mark.slow]

# Compiling a train step is most of a tiny run's time, and num_train_steps is a constant
# of its learning-rate schedule: the runs here (and test_integrity's) are STEPS long, and
# those that must end earlier stop there with `stop_at_step` (a checkpoint at that step,
# no final evaluation), so that one compiled program (the session's persistent cache,
# conftest) serves them all, in-process and in the programs they launch.
STEPS = 8
CHECKPOINT_ITEMS = ("model", "opt", "meta", "data")  # each with its integrity record
# Runs that must still be training when a test acts on them (a signal, a kill, a workdir
# taken away), here, in test_integrity and in test_workdir_lock: one length, one compile.
LONG_RUN_STEPS = 200


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One tokenizer/data cache for every run of this module (its own, not the session's
  shared_data_cache: section 7 checks that no command trains a tokenizer into it)."""
  return tmp_path_factory.mktemp("reliability_cache")


def config(cache_dir, num_train_steps=4, **overrides):
  c = tiny_config(cache_dir, num_train_steps)
  c.eval_every_steps = 0
  c.data.eval_max_batches = 1
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return c


def main_cmd(workdir, cache_dir, num_train_steps, *overrides):
  """main.py with the flags equivalent to `config(cache_dir, num_train_steps)`."""
  flags = [
    f
    for f in TINY_FLAGS
    if not f.startswith(("--config.num_train_steps=", "--config.data.eval_max_batches="))
  ]
  return [
    sys.executable,
    str(ROOT / "main.py"),
    "--config=configs/default.py",
    f"--workdir={workdir}",
    *flags,
    f"--config.num_train_steps={num_train_steps}",
    "--config.eval_every_steps=0",
    "--config.data.eval_max_batches=1",
    f"--config.data.cache_dir={cache_dir}",
    *overrides,
  ]


def subprocess_env():
  """CPU and the 'rbg' PRNG of the in-process runs (fast_compiles); the session's
  compile cache comes with the environment (conftest)."""
  return cpu_env(JAX_DEFAULT_PRNG_IMPL="rbg")


def start_and_wait_for_checkpoint(cmd, workdir, min_step=1, timeout=240, server=None):
  """Starts `cmd` (in a fresh interpreter; `server`: forked by that CommandServer, which
  skips the interpreter's start); returns it once `workdir` holds a finalised checkpoint
  >= min_step."""
  if server is not None:
    proc = server.start(cmd[1:])
  else:
    proc = subprocess.Popen(
      cmd,
      cwd=ROOT,
      env=subprocess_env(),
      text=True,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
    )
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    steps = finalized_steps(str(workdir))
    if steps and steps[-1] >= min_step:
      return proc
    if proc.poll() is not None:
      pytest.fail(
        f"run ended (rc {proc.returncode}) before a checkpoint: {proc.stderr.read()[-3000:]}"
      )
    time.sleep(0.01)
  proc.kill()
  pytest.fail("no checkpoint within the timeout")


def snapshot(path):
  """{relative path: (size, mtime)} of everything under `path` (None: absent)."""
  path = pathlib.Path(path)
  if not path.exists():
    return None
  return {
    str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
    for p in sorted(path.rglob("*"))
  }


def params_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def reference(cache, tmp_path_factory):
  """An uninterrupted 8-step run (checkpoint every step; in-process)."""
  wd = tmp_path_factory.mktemp("reference")
  r = loop.train_and_evaluate(config(cache, STEPS, checkpoint_every_steps=1), str(wd))
  return dict(result=r, workdir=wd, params=_final_params(wd))


# --------------------------------------------------------------------------------------
# 1. SIGKILL at a random-ish step, restart with the same command: bit for bit
# --------------------------------------------------------------------------------------
def test_sigkill_then_same_command_resumes_bit_exact(reference, cache, tmp_path, run_command):
  """Killed right after a commit, then started again with the same command: it resumes
  from the newest checkpoint, bit for bit. The killed run's checkpoints are also
  test_integrity's: every committed one carries its integrity record
  (the old checksums.json was written only at the next save), and a byte flipped in the
  newest one's weights is refused and the read falls back to the previous (on a copy)."""
  wd = tmp_path / "wd"
  cmd = main_cmd(wd, cache, STEPS, "--config.checkpoint_every_steps=1")
  proc = start_and_wait_for_checkpoint(cmd, wd, min_step=2, server=run_command)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  committed = finalized_steps(str(wd))
  latest = committed[-1]
  assert 2 <= latest < 8, latest
  assert len(committed) >= 2, committed
  for step in committed:
    for item in CHECKPOINT_ITEMS:
      assert (wd / "checkpoints" / str(step) / item / INTEGRITY_FILE).is_file(), (step, item)
  flipped = tmp_path / "flipped"
  shutil.copytree(wd, flipped)
  _flip_a_bit(flipped / "checkpoints" / str(latest))
  with pytest.raises(CheckpointError, match="crc32c differs"):
    loading.load_model(str(flipped), step=latest)
  assert loading.load_model(str(flipped)).step == committed[-2]  # the newest that verifies
  # What a kill in the middle of the next save leaves: orbax's temporary directory, and
  # the record naming the killed run as its writer (written before each save).
  tmp = wd / "checkpoints" / f"{latest + 1}.orbax-checkpoint-tmp-1700000000"
  (tmp / "model").mkdir(parents=True, exist_ok=True)
  (tmp / "model" / "garbage").write_bytes(b"\0" * 100)
  owners = wd / OWNERS_DIR
  shutil.copy(owners / f"{latest}.json", owners / f"{latest + 1}.json")
  tb = wd / "tensorboard"
  old_events = set(tb.iterdir())

  proc = subprocess.run(
    cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"resumed from checkpoint at step {latest} " in proc.stderr
  assert not [p for p in (wd / "checkpoints").iterdir() if "orbax-checkpoint-tmp" in p.name]

  step, params = _final_params(wd)
  assert step == 8
  params_equal(params, reference["params"][1])
  # The restarted run's own TensorBoard file: its losses equal the uninterrupted run's.
  new_tb = tmp_path / "new_tb"
  new_tb.mkdir()
  for f in set(tb.iterdir()) - old_events:
    shutil.copy(f, new_tb)
  resumed = dict(metrics_lib.read_scalars(str(new_tb))["train/loss"])
  ref = dict(reference["result"]["loss_history"])
  assert sorted(resumed) == list(range(latest + 1, 9))
  for s, loss in resumed.items():
    assert np.float32(loss) == np.float32(ref[s]), (s, loss, ref[s])


# --------------------------------------------------------------------------------------
# 2. SIGTERM: a checkpoint at the signalled step, exit 75 (stopped early), bounded time
# --------------------------------------------------------------------------------------
def test_sigterm_saves_at_current_step_and_exits_stopped_early(cache, tmp_path, run_command):
  """Saved at the signalled step, the run ends with status 75 (errors.EXIT_STOPPED_EARLY:
  resumable), not the 0 of a finished run, so that a scheduler can tell them apart."""
  wd = tmp_path / "wd"
  proc = start_and_wait_for_checkpoint(
    main_cmd(wd, cache, LONG_RUN_STEPS, "--config.checkpoint_every_steps=1"), wd, server=run_command
  )
  proc.send_signal(signal.SIGTERM)
  t = time.monotonic()
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == errors.EXIT_STOPPED_EARLY == 75, err[-3000:]
  assert time.monotonic() - t < 30
  line = [l for l in err.splitlines() if "after preemption; checkpoint saved" in l]
  assert len(line) == 1, err[-3000:]
  step = int(line[0].split("stopping at step ")[1].split()[0])
  assert 1 <= step < LONG_RUN_STEPS
  assert finalized_steps(str(wd))[-1] == step


# --------------------------------------------------------------------------------------
# 3. Divergence: stop naming the step and the last good checkpoint, which still loads
# --------------------------------------------------------------------------------------
# The two divergence tests' runs: the same length and learning rate, one compiled program.
DIVERGING_STEPS = 6


def test_nonfinite_stops_and_keeps_last_good_checkpoint(trained, cache, tmp_path):
  """Resumed from a good step-2 checkpoint with an absurd learning rate: the first
  update overflows, the run stops at step 3 naming checkpoint 2, which still loads. Its
  hint follows the clipping setting: on (the default, 1.0), it is not told to set it."""
  shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
  before = snapshot(tmp_path / "checkpoints")
  c = config(cache, DIVERGING_STEPS, checkpoint_every_steps=1, log_every_steps=100)
  c.optim.learning_rate = 1e30
  with pytest.raises(health.DivergenceError) as err:
    loop.train_and_evaluate(c, str(tmp_path))
  msg = str(err.value)
  assert msg.startswith("non-finite training values at step 3 (") and "\n" not in msg
  assert f"last good checkpoint: step 2 in {tmp_path / 'checkpoints'}" in msg
  assert msg.endswith(
    "lower optim.learning_rate (now 1e+30), lower optim.grad_clip_norm "
    "(now 1), or skip rare non-finite steps with "
    "optim.skip_nonfinite_steps (e.g. 3)"
  ), msg
  assert snapshot(tmp_path / "checkpoints") == before
  step, params = _final_params(tmp_path)
  assert step == 2
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_nonfinite_before_any_checkpoint(cache, tmp_path):
  # (Either warm-up fraction gives a 1-step warm-up in a run this short: the schedule is
  # the one above's.)
  c = config(cache, DIVERGING_STEPS, checkpoint_every_steps=1)
  c.optim.learning_rate = 1e30
  c.optim.warmup_frac = 0.0
  with pytest.raises(health.DivergenceError, match=r"at step 1 .*no checkpoint was written yet"):
    loop.train_and_evaluate(c, str(tmp_path))
  assert finalized_steps(str(tmp_path)) == []


def _poison_train_batches(monkeypatch, bad_steps):
  """The train batches of `bad_steps` (1-based) carry one NaN target weight: a stand-in
  for a batch whose loss overflows."""
  original, calls = steps.local_batch, [0]

  def local_batch(batch, local_batch_size=None):
    out = original(batch, local_batch_size)
    if local_batch_size is None:  # a train batch (eval batches pass their size)
      calls[0] += 1
      if calls[0] in bad_steps:
        out["weights"] = out["weights"].astype(np.float32)
        out["weights"][0, 0] = np.nan
    return out

  monkeypatch.setattr(steps, "local_batch", local_batch)


def test_skip_nonfinite_steps_skips_a_bad_batch_and_finishes(cache, tmp_path, monkeypatch):
  """optim.skip_nonfinite_steps=1: the bad step 3 is skipped (logged, counted in
  TensorBoard) and the run ends at step 6 (`stop_at_step`: STEPS's schedule) with finite
  parameters; with the default (0) the same batch stops the run at step 3."""
  _poison_train_batches(monkeypatch, {3})
  c = config(cache, STEPS, checkpoint_every_steps=2, log_every_steps=2)
  c.optim.skip_nonfinite_steps = 1
  out = loop.train_and_evaluate(c, str(tmp_path / "skip"), stop_at_step=6)
  assert out["step"] == 6 and np.isfinite(out["train"]["loss"])
  skipped = metrics_lib.read_scalars(str(tmp_path / "skip" / "tensorboard"))["train/skipped_steps"]
  assert dict(skipped) == {1: 0.0, 2: 0.0, 4: 1.0, 6: 0.0}
  assert finalized_steps(str(tmp_path / "skip")) == [2, 4, 6]
  step, params = _final_params(tmp_path / "skip")
  assert step == 6 and all(np.isfinite(x).all() for x in jax.tree.leaves(params))

  _poison_train_batches(monkeypatch, {3})
  c.optim.skip_nonfinite_steps = 0
  with pytest.raises(health.DivergenceError, match=r"at step 3 \(loss nan, gradient norm nan"):
    loop.train_and_evaluate(c, str(tmp_path / "stop"), stop_at_step=6)
  assert finalized_steps(str(tmp_path / "stop")) == [2]


def test_skip_nonfinite_steps_stops_after_too_many_in_a_row(cache, tmp_path, monkeypatch):
  """Three bad batches in a row with optim.skip_nonfinite_steps=2: stopped at the third,
  naming the run of skips; checkpoint 2 (before them) is intact and nothing later was
  written."""
  _poison_train_batches(monkeypatch, {3, 4, 5})
  c = config(cache, STEPS, checkpoint_every_steps=2, log_every_steps=100)
  c.optim.skip_nonfinite_steps = 2
  with pytest.raises(health.DivergenceError) as err:
    loop.train_and_evaluate(c, str(tmp_path))
  msg = str(err.value)
  assert msg.startswith(
    "non-finite training values at step 5 (3 steps in a row skipped "
    "from step 3 on, more than optim.skip_nonfinite_steps=2)"
  ), msg
  assert f"last good checkpoint: step 4 in {tmp_path / 'checkpoints'}" in msg
  assert finalized_steps(str(tmp_path)) == [2, 4]


# --------------------------------------------------------------------------------------
# 4. Another topology: written on 1 device, continued on 8, restored again on 1
# --------------------------------------------------------------------------------------
# One STEPS-step schedule for the three runs, each ended by `stop_at_step` (at 2 on 1
# device, at 4 on 8, at 6 on 1 again): the 1-device train step is compiled once, and no
# run evaluates (no evaluation to compile, here or on 8 devices).
_EIGHT_DEVICES = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from test_reliability import STEPS, config
    from test_train import _final_params
    from odetransformer.train import loop
    assert jax.device_count() == 8, jax.devices()
    wd1, wd8, cache = sys.argv[2:5]
    step, params = _final_params(wd1)                  # 1-device checkpoint on 8 devices
    ref = np.load(wd1 + "/params.npz")
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    assert len(flat) == len(ref.files)
    for path, x in flat:
      np.testing.assert_array_equal(x, ref[jax.tree_util.keystr(path)])
    c = config(cache, STEPS, global_batch_size=8, eval_batch_size=8)
    r = loop.train_and_evaluate(c, wd8, stop_at_step=4)
    assert (r["start_step"], r["step"]) == (2, 4), r
    _, params = _final_params(wd8)
    np.savez(wd8 + "/params.npz", **{jax.tree_util.keystr(p): x
                                     for p, x in jax.tree_util.tree_flatten_with_path(params)[0]})
    print("OK")
""")


def _save_npz(path, params):
  np.savez(
    path, **{jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  )


# Its own xdist group (the module's fixtures are not needed here): the two workers share
# this module's time more evenly. It reads the session's data cache (conftest).
@pytest.mark.xdist_group("8_devices")
def test_checkpoint_moves_between_1_and_8_devices(shared_data_cache, tmp_path):
  wd1, wd8, cache = tmp_path / "one", tmp_path / "eight", shared_data_cache
  c = config(cache, STEPS, global_batch_size=8, eval_batch_size=8)
  loop.train_and_evaluate(c, str(wd1), stop_at_step=2)
  _, params1 = _final_params(wd1)
  _save_npz(wd1 / "params.npz", params1)
  shutil.copytree(wd1, wd8)
  script = tmp_path / "eight.py"
  script.write_text(_EIGHT_DEVICES)
  env = dict(subprocess_env(), XLA_FLAGS=cpu_env(8)["XLA_FLAGS"])
  proc = subprocess.run(
    [sys.executable, str(script), str(ROOT), str(wd1), str(wd8), str(cache)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
  # The 8-device step-4 checkpoint, restored on 1 device: identical values...
  step, params8 = _final_params(wd8)
  ref = np.load(wd8 / "params.npz")
  flat = jax.tree_util.tree_flatten_with_path(params8)[0]
  assert step == 4 and len(flat) == len(ref.files)
  for path, x in flat:
    np.testing.assert_array_equal(x, ref[jax.tree_util.keystr(path)])
  # ...and training continues on 1 device.
  r = loop.train_and_evaluate(c, str(wd8), stop_at_step=6)
  assert (r["start_step"], r["step"]) == (4, 6)
  assert all(np.isfinite(loss) for _, loss in r["loss_history"])


# --------------------------------------------------------------------------------------
# 5. Corrupt checkpoints: fall back to the previous good one; none good: stop, touch nothing
# --------------------------------------------------------------------------------------
def _corrupt(step_dir):
  for f in sorted(p for p in (step_dir / "model").rglob("*") if p.is_file()):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def test_corrupt_checkpoint_falls_back_or_stops(cache, tmp_path):
  c = config(cache, STEPS)  # stopped at 4, later at 6 (STEPS's schedule)
  loop.train_and_evaluate(c, str(tmp_path), stop_at_step=4)  # checkpoints 2 and 4
  ck = tmp_path / "checkpoints"
  assert finalized_steps(str(tmp_path)) == [2, 4]
  good2 = tmp_path / "good2"
  shutil.copytree(ck / "2", good2)
  _corrupt(ck / "2")
  _corrupt(ck / "4")
  before = snapshot(ck)
  with pytest.raises(CheckpointError, match=r"no checkpoint in .* restores"):
    loop.train_and_evaluate(c, str(tmp_path), stop_at_step=6)
  assert snapshot(ck) == before  # nothing moved or written

  shutil.rmtree(ck / "2")
  shutil.copytree(good2, ck / "2")
  r = loop.train_and_evaluate(c, str(tmp_path), stop_at_step=6)  # 4 corrupt, 2 good
  assert (r["start_step"], r["step"]) == (2, 6)
  assert [p.name.split("-")[0] for p in (tmp_path / "corrupt_checkpoints").iterdir()] == ["4"]
  assert finalized_steps(str(tmp_path)) == [2, 4, 6]


# --------------------------------------------------------------------------------------
# 6. Bad input: one line, non-zero exit, nothing written
# --------------------------------------------------------------------------------------
def test_checkpoint_of_another_array_layout_stops_with_what_to_do(
  trained, cache, tmp_path, monkeypatch
):
  """A checkpoint whose arrays the code lays out differently (P d_t-major, as before
  2026-11-22) under the same config: one error that says so, and nothing moved."""
  wd = tmp_path / "run"
  shutil.copytree(trained, wd)
  init = hypernet.WeightGenerator.__init__

  def d_t_major_init(self, spec, *args, **kwargs):
    init(self, spec, *args, **kwargs)
    self.proj = hypernet.Projection(
      jax.numpy.moveaxis(self.proj[...], -1, 0), out_sharding=("time_embed",) + spec.axes
    )

  monkeypatch.setattr(hypernet.WeightGenerator, "__init__", d_t_major_init)
  before = snapshot(wd / "checkpoints")
  with pytest.raises(CheckpointError) as raised:
    loop.train_and_evaluate(config(cache, 4), str(wd))
  message = str(raised.value)
  assert "\n" not in message and "[d_t, *weight axes]" in message, message
  assert "laid out differently" in message and "not compatible" in message, message
  assert snapshot(wd / "checkpoints") == before  # nothing moved or written
  # Evaluation, generation and fine-tuning load the model alone: the same error there.
  with pytest.raises(ValueError, match=r"laid out differently .*\[d_t, \*weight axes\]"):
    loading.load_model(str(wd))
  assert snapshot(wd / "checkpoints") == before


@pytest.fixture(scope="module")
def trained(cache, tmp_path_factory):
  """A run stopped at step 2 (checkpoint at 2; STEPS's schedule), to be copied by tests."""
  wd = tmp_path_factory.mktemp("trained")
  loop.train_and_evaluate(config(cache, STEPS), str(wd), stop_at_step=2)
  return wd


@pytest.mark.parametrize(
  "overrides,error,match",
  [
    ({"model.num_heads": 5}, errors.ConfigError, "does not divide"),
    ({"model.kind": "lstm"}, errors.ConfigError, "model.kind='lstm' is unknown"),
    ({"model.solver": "heun"}, errors.ConfigError, "model.solver='heun' is unknown"),
    ({"model.solver_steps": 0}, errors.ConfigError, "model.solver_steps=0 must be a positive"),
    ({"model.solver_steps": -2}, errors.ConfigError, "model.solver_steps=-2 must be a positive"),
    (
      {"model.kind": "transformer", "seq_len": 64},
      errors.ConfigError,
      "seq_len=64 exceeds model.max_len=32",
    ),
    ({"data.source": "local", "data.train_files": "/nonexistent/*.txt"}, DataError, "nonexistent"),
  ],
)
def test_bad_config_is_one_error_and_writes_nothing(cache, tmp_path, overrides, error, match):
  wd = tmp_path / "wd"
  with pytest.raises(error, match=match) as err:
    loop.train_and_evaluate(config(cache, 2, **overrides), str(wd))
  assert "\n" not in str(err.value)
  assert not wd.exists()


def test_incompatible_workdir_is_refused_untouched(trained, cache, tmp_path):
  wd = tmp_path / "wd"
  shutil.copytree(trained, wd)
  before = snapshot(wd)
  c = config(cache, 4)
  c.model.num_heads = 4
  c.model.mlp_dim = 128
  c.model.remat_policy = "full"  # allowed to differ: not reported
  with pytest.raises(errors.ConfigError) as err:
    loop.train_and_evaluate(c, str(wd))
  msg = str(err.value)
  assert "holds checkpoints (step 2) of a different model, data or tokenizer" in msg
  assert "model.mlp_dim 64 -> 128" in msg and "model.num_heads 2 -> 4" in msg
  assert "remat_policy" not in msg
  assert snapshot(wd) == before


def test_main_subprocess_one_line_exit_2_nothing_written(trained, cache, tmp_path, run_command):
  """The real command: exit status 2, one `error:` line, no traceback, workdir as it was.
  The first in a fresh interpreter (the commands of section 7 run in processes forked
  from one that has imported the libraries: CommandServer)."""
  wd = tmp_path / "wd"
  shutil.copytree(trained, wd)
  before = snapshot(wd)
  proc = subprocess.run(
    main_cmd(wd, cache, 4, "--config.model.solver_steps=3"),
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "model.solver_steps 2 -> 3" in errors[0]
  assert "Traceback" not in proc.stderr
  assert snapshot(wd) == before
  fresh = tmp_path / "fresh"
  proc, _ = run_command(main_cmd(fresh, cache, 4, "--config.model.solver_steps=0")[1:], timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert [l for l in proc.stderr.splitlines() if l.startswith("error:")] == [
    "error: model.solver_steps=0 must be a positive integer; change "
    "--config.model.solver_steps (or its line in the config file)"
  ]
  assert not fresh.exists()


# --------------------------------------------------------------------------------------
# 7. Every misuse ends in the right behaviour or one line, exit 2, nothing
#    written. Most cases stop before any compilation: well under a second each, once the
#    libraries are imported.
# --------------------------------------------------------------------------------------
_COMMAND_SERVER = textwrap.dedent("""
    # Runs `python <args>` commands, each in a process of its own forked from this one
    # once the libraries every command imports are imported: a fresh interpreter spends
    # seconds importing them before each command starts. One JSON request per stdin line
    # ({"args", "stdout", "stderr"}: the command line after `python`, the files its
    # streams go to); replies on stdout: {"pid"} at its start, {"returncode"} at its end.
    import atexit, json, os, runpy, sys, threading, time
    import jax, numpy  # noqa: F401  (no backend is started here: each command starts its own)
    import odetransformer.analysis.lyapunov, odetransformer.analysis.spectra  # noqa: F401
    import odetransformer.tools.generate, odetransformer.train.loop  # noqa: F401

    def command(args):
      # What the interpreter does for `python -m module ...` and `python script.py ...`
      # (run from the repository root, on PYTHONPATH: the modules import as there).
      if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
      else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")

    def child(request):
      os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
      for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
      try:
        command(request["args"])
        status = 0
      except SystemExit as e:  # as the interpreter ends on it
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, (int, type(None))):
          print(e.code, file=sys.stderr)
      except BaseException:  # uncaught: its traceback, status 1
        sys.excepthook(*sys.exc_info())
        status = 1
      try:  # the interpreter's exit: wait for non-daemon threads, run the atexit hooks
        threading._shutdown()
        atexit._run_exitfuncs()
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    for line in sys.stdin:
      request = json.loads(line)
      # Forking is safe while this process runs one thread (a child inherits no lock that
      # another thread holds); an import that starts one ends the server in one line.
      if threading.active_count() != 1:
        sys.exit(f"command server: {threading.enumerate()} running; fork needs one thread")
      sys.stdout.flush()
      sys.stderr.flush()
      start = time.monotonic()
      pid = os.fork()
      if pid == 0:
        try:
          child(request)
        finally:  # never back to this loop
          os._exit(70)
      print(json.dumps({"pid": pid}), flush=True)
      _, status = os.waitpid(pid, 0)
      print(json.dumps({
        "returncode": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - start
      }), flush=True)
""")


class CommandServer:
  """`python <args>` from the repo root (CPU), each command in a process of its own: its
  exit status, its stdout and stderr as they are, signals sent to it as to any process;
  forked from a server process that has imported the libraries (_COMMAND_SERVER) rather
  than started afresh (seconds of imports each). One command at a time.
  test_main_subprocess_one_line_exit_2_nothing_written and the restart of the SIGKILL test
  run main.py in a fresh interpreter."""

  def __init__(self, directory):
    self.directory = pathlib.Path(directory)
    script = self.directory / "command_server.py"
    script.write_text(_COMMAND_SERVER)
    self.proc = subprocess.Popen(
      [sys.executable, str(script)],
      cwd=ROOT,
      env=subprocess_env(),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=(self.directory / "server.stderr").open("w"),
      text=True,
    )
    self.replies = queue.Queue()
    threading.Thread(target=self._read_replies, daemon=True).start()
    self.count = 0
    self.running = None  # the command started last, until its end is read

  def _read_replies(self):
    for line in self.proc.stdout:
      self.replies.put(json.loads(line))
    self.replies.put(None)  # the server ended

  def _reply(self, timeout, args):
    try:
      reply = self.replies.get(timeout=timeout)
    except queue.Empty:
      raise subprocess.TimeoutExpired(args, timeout) from None
    if reply is None:
      raise RuntimeError(
        "the command server ended: " + (self.directory / "server.stderr").read_text()[-3000:]
      )
    return reply

  def start(self, args):
    """Starts `python <args>`: a ForkedCommand (what the tests use of subprocess.Popen)."""
    if self.running is not None:  # left running by a test that failed
      self.running.kill()
      self.running.wait(60)
    args = list(map(str, args))
    self.count += 1
    out, err = (self.directory / f"{self.count}.{name}" for name in ("stdout", "stderr"))
    self.proc.stdin.write(json.dumps(dict(args=args, stdout=str(out), stderr=str(err))) + "\n")
    self.proc.stdin.flush()
    self.running = ForkedCommand(self, self._reply(120, args)["pid"], [sys.executable, *args])
    self.running.stdout_path, self.running.stderr = out, _Lines(err, self.running)
    return self.running

  def __call__(self, args, timeout=120):
    """Runs `python <args>`; returns (CompletedProcess, seconds)."""
    proc = self.start(args)
    try:
      out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(60)
      raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.seconds

  def close(self):
    if self.running is not None:
      self.running.kill()
    self.proc.stdin.close()
    try:
      self.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


class ForkedCommand:
  """A command that a CommandServer runs, with subprocess.Popen's pid, args, returncode,
  poll, wait, communicate (text), send_signal, kill, and stderr (a file object's read
  and lines, as the command writes them)."""

  def __init__(self, server, pid, args):
    self.server, self.pid, self.args = server, pid, args
    self.returncode = self.seconds = None

  def _ended(self, reply):
    self.returncode, self.seconds = reply["returncode"], reply["seconds"]
    self.server.running = None
    return self.returncode

  def poll(self):
    if self.returncode is None and not self.server.replies.empty():
      self.wait(0)
    return self.returncode

  def wait(self, timeout=None):
    if self.returncode is None:
      self._ended(self.server._reply(timeout, self.args))
    return self.returncode

  def communicate(self, timeout=None):
    self.wait(timeout)
    return self.stdout_path.read_text(), self.stderr.read()

  def send_signal(self, sig):
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self):
    self.send_signal(signal.SIGKILL)


class _Lines:
  """A command's stderr file, read as the command writes it: line by line (until the
  command has ended and all is read), or all that is left."""

  def __init__(self, path, command):
    self.path, self.command, self.file, self.partial = path, command, None, ""

  def _open(self):
    if self.file is None:
      self.file = open(self.path)  # noqa: SIM115  (read while the command writes it)
    return self.file

  def __iter__(self):
    while True:
      self.partial += self._open().readline()
      if self.partial.endswith("\n"):
        line, self.partial = self.partial, ""
        yield line
      elif self.command.poll() is not None:  # ended: the rest, then no more
        yield from self.read().splitlines(keepends=True)
        return
      else:
        time.sleep(0.01)

  def read(self):
    text, self.partial = self.partial + self._open().read(), ""
    return text


@pytest.fixture(scope="module")
def run_command(tmp_path_factory):
  """A CommandServer for this module's commands: `run_command(args)` -> (proc, seconds)."""
  server = CommandServer(tmp_path_factory.mktemp("commands"))
  yield server
  server.close()


def assert_one_line_error(proc, *needles, status=2):
  """Exit `status`, exactly one stderr line `error: ...` holding every needle, in the one
  style (no exception class before the message), and no traceback."""
  assert proc.returncode == status, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert not re.match(r"error: \w+(Error|Exception): ", errors[0]), errors[0]
  for needle in needles:
    assert needle in errors[0], errors[0]
  return errors[0]


@pytest.fixture
def run_copy(trained, tmp_path):
  """A copy of the trained 2-step workdir (checkpoint 2, config.json, tokenizer)."""
  wd = tmp_path / "run"
  shutil.copytree(trained, wd)
  return wd


@pytest.mark.parametrize("keep", [0, -1])
def test_max_to_keep_that_keeps_nothing_is_refused(cache, tmp_path, keep, run_command):
  """0 used to train and then delete every checkpoint, the final one too."""
  wd = tmp_path / "wd"
  proc, _ = run_command(main_cmd(wd, cache, 2, f"--config.checkpoint_max_to_keep={keep}")[1:])
  assert_one_line_error(proc, f"checkpoint_max_to_keep={keep}", "positive count")
  assert not wd.exists()


def _flip_a_bit(step_dir):
  """Flips one bit in the middle of the largest file of the model's arrays."""
  files = [p for p in (step_dir / "model").rglob("*") if p.is_file()]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  data[len(data) // 2] ^= 0x10
  largest.write_bytes(bytes(data))
  return largest


@pytest.mark.parametrize(
  "case",
  [
    "unknown_key",
    "missing_config",
    "syntax_error",
    "workdir_is_file",
    "other_data",
    "other_seed",
    "no_config_json_other_model",
    "spectra_grid_0",
    "spectra_empty",
    "lyapunov_empty",
    "generate_all_corrupt",
    "binary_text",
    "latin1_text",
  ],
)
def test_misuse_is_one_line_and_changes_nothing(case, run_copy, cache, tmp_path, run_command):
  wd, empty = run_copy, tmp_path / "empty"
  empty.mkdir()
  main = lambda *flags: main_cmd(wd, cache, 4, *flags)[1:]
  needles = ()
  if case == "unknown_key":
    args, needles = main("--config.model.nosuch=1"), ("'nosuch'", "--config.model.nosuch=1")
  elif case == "missing_config":
    args = [a if not a.startswith("--config=") else "--config=configs/nosuch.py" for a in main()]
    needles = ("No such file", "configs/nosuch.py")
  elif case == "syntax_error":
    bad = tmp_path / "bad_config.py"
    bad.write_text("def get_config(:\n")
    args = [a if not a.startswith("--config=") else f"--config={bad}" for a in main()]
    needles = ("syntax error", str(bad))
  elif case == "workdir_is_file":
    wd = tmp_path / "a_file"
    wd.write_text("not a directory")
    args, needles = main_cmd(wd, cache, 4)[1:], ("is a file",)
  elif case == "other_data":
    # Used to retrain the tokenizer and overwrite tokenizer.model.
    args = main("--config.data.tokenizer_sample_bytes=200000")
    needles = ("data.tokenizer_sample_bytes 300000 -> 200000", "new --workdir")
  elif case == "other_seed":
    # Used to resume silently: no longer the run it continues.
    args = main("--config.seed=1")
    needles = ("resume.seed 0 -> 1", "--config.resume_with_changes=true")
  elif case == "no_config_json_other_model":
    # Used to rewrite config.json and then blame "a different code version".
    (wd / "config.json").unlink()
    args, needles = main("--config.model.solver_steps=3"), ("model.solver_steps 2 -> 3",)
  elif case == "spectra_grid_0":
    args = [
      "-m",
      "odetransformer.analysis.spectra",
      f"--workdir={wd}",
      f"--out={tmp_path / 'out'}",
      "--grid=0",
    ]
    needles = ("--grid=0", "--grid=2 or more")
  elif case in ("spectra_empty", "lyapunov_empty"):
    wd = empty
    args = [
      "-m",
      f"odetransformer.analysis.{case.split('_')[0]}",
      f"--workdir={wd}",
      f"--out={tmp_path / 'out'}",
      "--text=def f(x):",
    ]
    args = [a for a in args if case == "lyapunov_empty" or not a.startswith("--text")]
    needles = ("holds no training run",)
  elif case == "generate_all_corrupt":
    _flip_a_bit(wd / "checkpoints" / "2")
    args = ["-m", "odetransformer.tools.generate", f"--workdir={wd}", "--prompt=def"]
    needles = ("no checkpoint in", "corrupt", "crc32c")
  elif case in ("binary_text", "latin1_text"):
    wd = tmp_path / "fresh"
    rng = np.random.default_rng(0)
    if case == "binary_text":
      data = rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    else:
      words = "été café naïve garçon déjà élève très à ça the and of to in is".split()
      data = "\n".join(" ".join(rng.choice(words, 12)) for _ in range(3000)).encode("latin-1")
    (tmp_path / "train.txt").write_bytes(data)
    (tmp_path / "valid.txt").write_text("def f(x):\n  return x\n" * 200)
    args = main_cmd(
      wd,
      cache,
      4,
      "--config.data.source=local",
      f"--config.data.train_files={tmp_path / 'train.txt'}",
      f"--config.data.eval_files={tmp_path / 'valid.txt'}",
    )[1:]
    needles = ("not UTF-8 text", "convert the files to UTF-8")
  before = snapshot(wd)
  tokenizers = snapshot(pathlib.Path(cache) / "tokenizers")
  proc, seconds = run_command(args)
  assert_one_line_error(proc, *needles)
  assert snapshot(wd) == before  # nothing written, moved or created
  assert snapshot(pathlib.Path(cache) / "tokenizers") == tokenizers  # none retrained
  assert seconds < 90, seconds  # a loaded 2-core machine: jax import


def test_tools_read_the_config_from_the_checkpoint_without_config_json(run_copy):
  (run_copy / "config.json").unlink()
  loaded = loading.load_model(str(run_copy))
  assert loaded.step == 2 and loaded.model_config.d_model == 32
  assert not (run_copy / "config.json").exists()


def test_verbose_shows_the_traceback(cache, tmp_path, run_command):
  proc, _ = run_command(
    main_cmd(tmp_path / "wd", cache, 2, "--config.model.nosuch=1", "--verbose")[1:]
  )
  assert proc.returncode == 2 and "Traceback" in proc.stderr, proc.stderr[-3000:]
  assert [l for l in proc.stderr.splitlines() if l.startswith("error:")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_workdir_is_one_line(cache, tmp_path, run_command):
  wd = tmp_path / "ro"
  wd.mkdir()
  wd.chmod(0o555)
  try:
    proc, _ = run_command(main_cmd(wd, cache, 2)[1:])
    assert_one_line_error(proc, "not writable")
    assert list(wd.iterdir()) == []
  finally:
    wd.chmod(0o755)


def test_read_only_mount_is_one_line(cache, tmp_path, run_command):
  """The same as root, on a read-only tmpfs (skipped where mounting is not allowed)."""
  wd = tmp_path / "ro"
  wd.mkdir()
  if subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(wd)], capture_output=True
  ).returncode:
    pytest.skip("cannot mount a read-only tmpfs here")
  try:
    proc, _ = run_command(main_cmd(wd, cache, 2)[1:])
    assert_one_line_error(proc, "not writable", "Read-only file system")
  finally:
    subprocess.run(["umount", str(wd)], check=True)


def test_workdir_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, caplog):
  """flock semantics: a second open of the lock (here in this process) is refused
  naming the holder; once the holder is gone the next run takes over with a warning."""
  wd = tmp_path / "wd"
  first = workdir_lock.WorkdirLock(str(wd)).acquire()
  holder = (wd / ".lock").read_text()
  with pytest.raises(workdir_lock.WorkdirInUseError) as err:
    workdir_lock.WorkdirLock(str(wd)).acquire()
  assert f"is in use by PID {os.getpid()} on host " in str(err.value)
  assert (wd / ".lock").read_text() == holder  # the refused one wrote nothing
  # A holder that died: its flock went with it, its PID is still in the file.
  first._fd, fd = None, first._fd
  os.close(fd)
  (wd / ".lock").write_text('{"pid": 999999, "host": "gone", "started": 0}\n')
  with caplog.at_level("WARNING"):
    second = workdir_lock.WorkdirLock(str(wd)).acquire()
  assert "took over the workdir lock of PID 999999 on host gone" in caplog.text
  second.release()
  assert (wd / ".lock").read_text() == ""  # a clean end: no holder


def test_second_run_on_a_live_workdir_exits_at_once(run_copy, cache, run_command):
  """Used to hang forever at 0% CPU. The holder is a process that holds the lock as
  main.py does; the second is the real command."""
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys, time; "
      "from odetransformer.runtime.workdir_lock import WorkdirLock; "
      "WorkdirLock(sys.argv[2]).acquire(); print('locked', flush=True); time.sleep(600)",
      str(ROOT),
      str(run_copy),
    ],
    cwd=ROOT,
    env=subprocess_env(),
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "locked"
    before = snapshot(run_copy)
    proc, seconds = run_command(main_cmd(run_copy, cache, 4)[1:])
    assert_one_line_error(proc, f"PID {holder.pid} on host ", "another --workdir")
    assert snapshot(run_copy) == before
    assert seconds < 90, seconds
  finally:
    holder.kill()
    holder.wait()


def test_flipped_bits_are_reported_as_corruption_and_fall_back(reference, cache, tmp_path):
  """Used to restore without a word (orbax checks no data checksum) and diverge."""
  wd = tmp_path / "wd"
  shutil.copytree(reference["workdir"], wd)
  assert finalized_steps(str(wd)) == [6, 7, 8]
  _flip_a_bit(wd / "checkpoints" / "8")
  with pytest.raises(
    CheckpointError, match=r"checkpoints/8 is corrupt: an array chunk's crc32c differs"
  ):
    loading.load_model(str(wd), step=8)
  assert loading.load_model(str(wd)).step == 7  # tools: the previous one
  r = loop.train_and_evaluate(config(cache, STEPS, checkpoint_every_steps=1), str(wd))
  assert (r["start_step"], r["step"]) == (7, 8)
  assert [p.name.split("-")[0] for p in (wd / "corrupt_checkpoints").iterdir()] == ["8"]
  step, params = _final_params(wd)
  assert step == 8
  params_equal(params, reference["params"][1])  # bit-exact after the detour


_FALL_BACK_AND_COLLECT = """
import gc, sys
from odetransformer.train import loading
# Its newest checkpoint is corrupt: each load falls back. How many reads a failed restore
# abandons depends on timing (at times none): five loads abandon some.
for _ in range(5):
  model = loading.load_model(sys.argv[1])
print(model.step)
del model
gc.collect()  # closes the array reads that the failed restore abandoned
"""


def test_reads_abandoned_by_a_corrupt_checkpoint_print_nothing(reference, tmp_path, run_command):
  """A tool falling back from a corrupt checkpoint says so in its warning lines, and no
  more: when the garbage collector closed the failed restore's abandoned array reads,
  orbax turned each into an exception that Python printed, a long traceback ending in
  its TensorStore spec, at whatever later moment the collector ran."""
  wd = tmp_path / "wd"
  shutil.copytree(reference["workdir"], wd)
  _flip_a_bit(wd / "checkpoints" / "8")
  script = tmp_path / "fall_back.py"
  script.write_text(_FALL_BACK_AND_COLLECT)
  proc, _ = run_command([script, wd])
  assert proc.returncode == 0 and proc.stdout.split() == ["7"], proc.stderr[-3000:]
  assert "checkpoints/8 is corrupt" in proc.stderr and "using step 7" in proc.stderr
  assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_failed_save_is_one_line(run_copy, cache, run_command):
  """The checkpoint directory replaced by a file mid-run (as when a disk is gone): one
  line naming the step, exit 2; orbax's ~200 traceback lines are not printed."""
  proc = start_and_wait_for_checkpoint(
    main_cmd(run_copy, cache, LONG_RUN_STEPS, "--config.checkpoint_every_steps=1"),
    run_copy,
    min_step=3,
    server=run_command,
  )
  try:
    # A rename is atomic (an rmtree races with orbax writing into the directory).
    (run_copy / "checkpoints").rename(run_copy / "checkpoints_gone")
    (run_copy / "checkpoints").write_text("")
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert_one_line_error(
    subprocess.CompletedProcess([], proc.returncode, "", err),
    "saving the checkpoint of step",
    "failed",
  )


def test_ctrl_c_saves_like_sigterm_and_twice_exits_at_once(run_copy, cache, tmp_path, run_command):
  wd2 = tmp_path / "second"
  shutil.copytree(run_copy, wd2)
  proc = start_and_wait_for_checkpoint(
    main_cmd(run_copy, cache, LONG_RUN_STEPS, "--config.checkpoint_every_steps=1"),
    run_copy,
    min_step=3,
    server=run_command,
  )
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == errors.EXIT_STOPPED_EARLY, err[-3000:]
  line = [l for l in err.splitlines() if "after preemption; checkpoint saved" in l]
  assert len(line) == 1, err[-3000:]
  step = int(line[0].split("stopping at step ")[1].split()[0])
  assert finalized_steps(str(run_copy))[-1] == step
  assert "Traceback" not in err

  # Two signals sent together would merge into one: the second goes once the first
  # was seen. It finds the save under way (or just done): exit 130 at once either way.
  proc = start_and_wait_for_checkpoint(
    main_cmd(wd2, cache, LONG_RUN_STEPS, "--config.checkpoint_every_steps=1"),
    wd2,
    min_step=3,
    server=run_command,
  )
  proc.send_signal(signal.SIGINT)
  seen = []
  for line in proc.stderr:
    seen.append(line)
    if "SIGINT received" in line:
      break
  proc.send_signal(signal.SIGINT)
  t = time.monotonic()
  _, err = proc.communicate(timeout=60)
  err = "".join(seen) + err
  assert proc.returncode == 130, err[-3000:]
  assert time.monotonic() - t < 10
  assert "exiting now without saving" in err or "interrupted" in err, err[-3000:]


def test_tokenizer_vocabulary_too_small_says_raise():
  """More distinct characters than pieces: the fix is a larger vocab_size (it said
  "lower"); the opposite failure still says lower."""
  rng = np.random.default_rng(0)
  docs = [
    "".join(chr(c) for c in rng.integers(0x4E00, 0x4E00 + 3000, 60)) + "\n" for _ in range(1500)
  ]
  with pytest.raises(DataError) as err:
    tokenizer.train(docs, 300)
  msg = str(err.value)
  assert "smaller than required_chars" in msg and "raise data.vocab_size" in msg, msg
  assert "lower" not in msg and "\n" not in msg
  with pytest.raises(DataError, match="too high.*fix: lower data.vocab_size"):
    tokenizer.train(["def f(x):\n  return x\n"] * 50, 5000)
