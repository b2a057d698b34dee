"""Every bad tool argument is one stderr line and exit status 2, found before any work.

Each case runs the real command in a subprocess on a workdir that holds only a run's
config.json: a flag checked after loading would fail on the missing checkpoint instead
("holds no complete checkpoint"), so each expected message also proves the order.
Plus main.py: `optim.learning_rate=nan` is refused by the optimizer's validation, and a
diverged run's hint follows its clipping setting.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from odetransformer import checkpointing, health
from tiny import config_flags, cpu_env, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
ABSL_INFO = re.compile(r"I\d{4} ")   # absl's INFO lines (main.py logs the JAX topology)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A run's config.json alone (gpt flavour, model.max_len=32), no checkpoint."""
  wd = tmp_path_factory.mktemp("config_only")
  checkpointing.save_config(tiny_config(wd / "cache"), str(wd))
  return wd


def run(args, timeout=120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=cpu_env(), capture_output=True,
                        timeout=timeout)


def error_line(proc) -> str:
  """The one stderr line (absl INFO lines aside) of a command that exited 2."""
  lines = [l for l in proc.stderr.decode("utf-8", "replace").splitlines()
           if not ABSL_INFO.match(l)]
  assert proc.returncode == 2, proc.stderr.decode()[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


@pytest.mark.parametrize("flag, needle", [
    ("--max_new_tokens=0", "--max_new_tokens=0 must be a positive number"),
    ("--max_new_tokens=-5", "--max_new_tokens=-5 must be a positive number"),
    ("--num_samples=0", "--num_samples=0 must be >= 1"),
    ("--seed=99999999999999999999", "--seed=99999999999999999999 is out of range"),
    (b"--prompt=caf\xe9 \xff", "--prompt is not valid UTF-8 text"),
    ("--temperature=-1", "--temperature=-1.0 must be a finite number >= 0"),
    ("--temperature=nan", "--temperature=nan must be a finite number >= 0"),
])
def test_generate_refuses(workdir, flag, needle):
  proc = run(["-m", "odetransformer.generate", f"--workdir={workdir}", flag])
  assert needle in error_line(proc)


@pytest.mark.parametrize("flag, needle", [
    ("--seq_len=4096", "--seq_len=4096 exceeds the model's 32 learned positions"),
    ("--plot=/sys/odet_ppl.png", "--plot=/sys/odet_ppl.png cannot be written"),
    ("--mesh_shape=2,x", "--mesh_shape='2,x': expected 3 comma-separated sizes"),
])
def test_evaluate_refuses(workdir, flag, needle):
  proc = run(["-m", "odetransformer.evaluate", f"--workdir={workdir}", flag])
  assert needle in error_line(proc)


def test_evaluate_plot_refuses_a_directory(workdir):
  proc = run(["-m", "odetransformer.evaluate", f"--workdir={workdir}", f"--plot={workdir}"])
  assert f"--plot={workdir} is a directory" in error_line(proc)
  assert sorted(os.listdir(workdir)) == ["config.json"]   # no probe file left


def test_main_refuses_a_nan_learning_rate(tmp_path):
  c = tiny_config(tmp_path / "cache")
  proc = run(["main.py", "--config=configs/default.py", f"--workdir={tmp_path / 'wd'}",
              *config_flags(c), "--config.optim.learning_rate=nan"])
  assert "optim.learning_rate=nan must be a finite number > 0" in error_line(proc)
  assert not (tmp_path / "wd").exists()


def test_divergence_hint_reads_the_clipping_setting(tmp_path):
  """A run with clipping on (the default, 1.0) that diverges is not told to set it."""
  c = tiny_config(tmp_path / "cache", num_train_steps=2)
  c.optim.learning_rate, c.optim.warmup_frac = 1e30, 0.0
  proc = run(["main.py", "--config=configs/default.py", f"--workdir={tmp_path / 'wd'}",
              *config_flags(c)], timeout=240)
  line = error_line(proc)
  assert "non-finite training values at step 1" in line
  assert line.endswith("lower optim.learning_rate (now 1e+30), lower "
                       "optim.grad_clip_norm (now 1), or skip rare non-finite steps with "
                       "optim.skip_nonfinite_steps (e.g. 3)"), line


def test_divergence_hints():
  import ml_collections  # pylint: disable=g-import-not-at-top
  optim = lambda **kw: ml_collections.ConfigDict(dict(learning_rate=1e-3, **kw))
  assert health.divergence_hint(optim(grad_clip_norm=0.0)) == (
      "lower optim.learning_rate (now 0.001) or turn on clipping with "
      "optim.grad_clip_norm (e.g. 1.0; now off)")
  assert health.divergence_hint(optim(grad_clip_norm=0.5, skip_nonfinite_steps=2)) == (
      "lower optim.learning_rate (now 0.001) or lower optim.grad_clip_norm (now 0.5)")


def test_run_mesh_follows_the_run_or_the_flag():
  """The run's mesh.shape when it fits these devices, else fsdp over all of them; a
  --mesh_shape value wins and a misfit one is a one-line error."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from odetransformer import errors, loading  # pylint: disable=g-import-not-at-top
  n = jax.device_count()
  run = lambda shape: ml_collections.ConfigDict({"mesh": {"shape": shape}})
  assert dict(loading.run_mesh(run((1, 1, -1))).shape) == {"data": 1, "fsdp": 1, "tensor": n}
  assert dict(loading.run_mesh(run((n + 1, 1, 1))).shape) == {"data": 1, "fsdp": n, "tensor": 1}
  assert dict(loading.run_mesh(run((1, 1, -1)), "(-1, 1, 1)").shape) == {
      "data": n, "fsdp": 1, "tensor": 1}
  with pytest.raises(errors.UserError, match=r"--mesh_shape=9,9,9: mesh.shape=\(9, 9, 9\) "
                     "needs 729 devices"):
    loading.run_mesh(run((1, -1, 1)), "9,9,9")


def test_lm_eval_drops_writing_options_on_other_processes():
  from odetransformer import lm_eval  # pylint: disable=g-import-not-at-top
  argv = ["lm_eval", "--model", "odetransformer", "--output_path", "out", "--log_samples",
          "--tasks", "t", "-o=out2", "-s", "--wandb_args", "project=p", "--limit", "3"]
  assert lm_eval.without_writing_options(argv) == [
      "lm_eval", "--model", "odetransformer", "--tasks", "t", "--limit", "3"]
