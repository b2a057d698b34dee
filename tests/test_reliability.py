"""Issue 5, "a run never loses work": SIGKILL + restart is bit-exact, SIGTERM saves and
exits 0, divergence stops with the last good checkpoint intact, checkpoints move
between 8 and 1 devices, corrupt checkpoints are skipped, and bad input is one line
with nothing written.

Issue 23, "no silent data loss, no hang, one line for every bad input" (section 7):
each misuse case runs the real command in a subprocess and checks its exit status,
its single `error:` line (no traceback) and that the workdir is exactly as it was."""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
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
from odetransformer.train.checkpoint.paths import OWNERS_DIR, CheckpointError, finalized_steps

from tiny import cpu_env

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = [pytest.mark.xdist_group("test_reliability"), pytest.mark.slow]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One tokenizer/data cache for every run of this module."""
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


def start_and_wait_for_checkpoint(cmd, workdir, min_step=1, timeout=240):
  """Starts `cmd`; returns it once `workdir` holds a finalised checkpoint >= min_step."""
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
  r = loop.train_and_evaluate(config(cache, 8, checkpoint_every_steps=1), str(wd))
  return dict(result=r, workdir=wd, params=_final_params(wd))


# --------------------------------------------------------------------------------------
# 1. SIGKILL at a random-ish step, restart with the same command: bit for bit
# --------------------------------------------------------------------------------------
def test_sigkill_then_same_command_resumes_bit_exact(reference, cache, tmp_path):
  wd = tmp_path / "wd"
  cmd = main_cmd(wd, cache, 8, "--config.checkpoint_every_steps=1")
  proc = start_and_wait_for_checkpoint(cmd, wd, min_step=2)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  latest = finalized_steps(str(wd))[-1]
  assert 2 <= latest < 8, latest
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
# 2. SIGTERM: a checkpoint at the signalled step, exit 0, bounded time
# --------------------------------------------------------------------------------------
def test_sigterm_saves_at_current_step_and_exits_zero(cache, tmp_path):
  wd = tmp_path / "wd"
  proc = start_and_wait_for_checkpoint(
    main_cmd(wd, cache, 200, "--config.checkpoint_every_steps=1"), wd
  )
  proc.send_signal(signal.SIGTERM)
  t = time.monotonic()
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err[-3000:]
  assert time.monotonic() - t < 30
  line = [l for l in err.splitlines() if "after preemption; checkpoint saved" in l]
  assert len(line) == 1, err[-3000:]
  step = int(line[0].split("stopping at step ")[1].split()[0])
  assert 1 <= step < 200
  assert finalized_steps(str(wd))[-1] == step


# --------------------------------------------------------------------------------------
# 3. Divergence: stop naming the step and the last good checkpoint, which still loads
# --------------------------------------------------------------------------------------
def test_nonfinite_stops_and_keeps_last_good_checkpoint(trained, cache, tmp_path):
  """Resumed from a good step-2 checkpoint with an absurd learning rate: the first
  update overflows, the run stops at step 3 naming checkpoint 2, which still loads. Its
  hint follows the clipping setting: on (the default, 1.0), it is not told to set it."""
  shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
  before = snapshot(tmp_path / "checkpoints")
  c = config(cache, 6, checkpoint_every_steps=1, log_every_steps=100)
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
  c = config(cache, 3, checkpoint_every_steps=1)
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
  TensorBoard) and the run ends at step 6 with finite parameters; with the default (0)
  the same batch stops the run at step 3."""
  _poison_train_batches(monkeypatch, {3})
  c = config(cache, 6, checkpoint_every_steps=2, log_every_steps=2)
  c.optim.skip_nonfinite_steps = 1
  out = loop.train_and_evaluate(c, str(tmp_path / "skip"))
  assert out["step"] == 6 and np.isfinite(out["train"]["loss"])
  skipped = metrics_lib.read_scalars(str(tmp_path / "skip" / "tensorboard"))["train/skipped_steps"]
  assert dict(skipped) == {1: 0.0, 2: 0.0, 4: 1.0, 6: 0.0}
  assert finalized_steps(str(tmp_path / "skip")) == [2, 4, 6]
  step, params = _final_params(tmp_path / "skip")
  assert step == 6 and all(np.isfinite(x).all() for x in jax.tree.leaves(params))

  _poison_train_batches(monkeypatch, {3})
  c.optim.skip_nonfinite_steps = 0
  with pytest.raises(health.DivergenceError, match=r"at step 3 \(loss nan, gradient norm nan"):
    loop.train_and_evaluate(c, str(tmp_path / "stop"))
  assert finalized_steps(str(tmp_path / "stop")) == [2]


def test_skip_nonfinite_steps_stops_after_too_many_in_a_row(cache, tmp_path, monkeypatch):
  """Three bad batches in a row with optim.skip_nonfinite_steps=2: stopped at the third,
  naming the run of skips; checkpoint 2 (before them) is intact and nothing later was
  written."""
  _poison_train_batches(monkeypatch, {3, 4, 5})
  c = config(cache, 8, checkpoint_every_steps=2, log_every_steps=100)
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
_EIGHT_DEVICES = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from test_reliability import config
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
    r = loop.train_and_evaluate(config(cache, 4, global_batch_size=8, eval_batch_size=8), wd8)
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


def test_checkpoint_moves_between_1_and_8_devices(cache, tmp_path):
  wd1, wd8 = tmp_path / "one", tmp_path / "eight"
  c = lambda n: config(cache, n, global_batch_size=8, eval_batch_size=8)
  loop.train_and_evaluate(c(2), str(wd1))
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
  r = loop.train_and_evaluate(c(6), str(wd8))
  assert (r["start_step"], r["step"]) == (4, 6)
  assert all(np.isfinite(loss) for _, loss in r["loss_history"])


# --------------------------------------------------------------------------------------
# 5. Corrupt checkpoints: fall back to the previous good one; none good: stop, touch nothing
# --------------------------------------------------------------------------------------
def _corrupt(step_dir):
  for f in sorted(p for p in (step_dir / "model").rglob("*") if p.is_file()):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def test_corrupt_checkpoint_falls_back_or_stops(cache, tmp_path):
  loop.train_and_evaluate(config(cache, 4), str(tmp_path))  # checkpoints 2 and 4
  ck = tmp_path / "checkpoints"
  assert finalized_steps(str(tmp_path)) == [2, 4]
  good2 = tmp_path / "good2"
  shutil.copytree(ck / "2", good2)
  _corrupt(ck / "2")
  _corrupt(ck / "4")
  before = snapshot(ck)
  with pytest.raises(CheckpointError, match=r"no checkpoint in .* restores"):
    loop.train_and_evaluate(config(cache, 6), str(tmp_path))
  assert snapshot(ck) == before  # nothing moved or written

  shutil.rmtree(ck / "2")
  shutil.copytree(good2, ck / "2")
  r = loop.train_and_evaluate(config(cache, 6), str(tmp_path))  # 4 corrupt, 2 good
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
  """A 2-step run's workdir (checkpoint at 2), to be copied by tests."""
  wd = tmp_path_factory.mktemp("trained")
  loop.train_and_evaluate(config(cache, 2), str(wd))
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


def test_main_subprocess_one_line_exit_2_nothing_written(trained, cache, tmp_path):
  """The real command: exit status 2, one `error:` line, no traceback, workdir as it was."""
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
  proc = subprocess.run(
    main_cmd(fresh, cache, 4, "--config.model.solver_steps=0"),
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert [l for l in proc.stderr.splitlines() if l.startswith("error:")] == [
    "error: model.solver_steps=0 must be a positive integer; change "
    "--config.model.solver_steps (or its line in the config file)"
  ]
  assert not fresh.exists()


# --------------------------------------------------------------------------------------
# 7. Issue 23: every misuse ends in the right behaviour or one line, exit 2, nothing
#    written. Most cases stop before any compilation: a few seconds each.
# --------------------------------------------------------------------------------------
def run_command(args, timeout=120):
  """`python <args>` from the repo root (CPU); returns (CompletedProcess, seconds)."""
  t = time.monotonic()
  proc = subprocess.run(
    [sys.executable, *map(str, args)],
    cwd=ROOT,
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return proc, time.monotonic() - t


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
def test_max_to_keep_that_keeps_nothing_is_refused(cache, tmp_path, keep):
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
def test_misuse_is_one_line_and_changes_nothing(case, run_copy, cache, tmp_path):
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


def test_verbose_shows_the_traceback(cache, tmp_path):
  proc, _ = run_command(
    main_cmd(tmp_path / "wd", cache, 2, "--config.model.nosuch=1", "--verbose")[1:]
  )
  assert proc.returncode == 2 and "Traceback" in proc.stderr, proc.stderr[-3000:]
  assert [l for l in proc.stderr.splitlines() if l.startswith("error:")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_workdir_is_one_line(cache, tmp_path):
  wd = tmp_path / "ro"
  wd.mkdir()
  wd.chmod(0o555)
  try:
    proc, _ = run_command(main_cmd(wd, cache, 2)[1:])
    assert_one_line_error(proc, "not writable")
    assert list(wd.iterdir()) == []
  finally:
    wd.chmod(0o755)


def test_read_only_mount_is_one_line(cache, tmp_path):
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


def test_second_run_on_a_live_workdir_exits_at_once(run_copy, cache):
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
  r = loop.train_and_evaluate(config(cache, 8, checkpoint_every_steps=1), str(wd))
  assert (r["start_step"], r["step"]) == (7, 8)
  assert [p.name.split("-")[0] for p in (wd / "corrupt_checkpoints").iterdir()] == ["8"]
  step, params = _final_params(wd)
  assert step == 8
  params_equal(params, reference["params"][1])  # bit-exact after the detour


def test_failed_save_is_one_line(run_copy, cache):
  """The checkpoint directory replaced by a file mid-run (as when a disk is gone): one
  line naming the step, exit 2; orbax's ~200 traceback lines are not printed."""
  proc = start_and_wait_for_checkpoint(
    main_cmd(run_copy, cache, 400, "--config.checkpoint_every_steps=1"), run_copy, min_step=3
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


def test_ctrl_c_saves_like_sigterm_and_twice_exits_at_once(run_copy, cache, tmp_path):
  wd2 = tmp_path / "second"
  shutil.copytree(run_copy, wd2)
  proc = start_and_wait_for_checkpoint(
    main_cmd(run_copy, cache, 400, "--config.checkpoint_every_steps=1"), run_copy, min_step=3
  )
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err[-3000:]
  line = [l for l in err.splitlines() if "after preemption; checkpoint saved" in l]
  assert len(line) == 1, err[-3000:]
  step = int(line[0].split("stopping at step ")[1].split()[0])
  assert finalized_steps(str(run_copy))[-1] == step
  assert "Traceback" not in err

  # Two signals sent together would merge into one: the second goes once the first
  # was seen. It finds the save under way (or just done): exit 130 at once either way.
  proc = start_and_wait_for_checkpoint(
    main_cmd(wd2, cache, 400, "--config.checkpoint_every_steps=1"), wd2, min_step=3
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
