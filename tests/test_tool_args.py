"""Every bad tool argument is one stderr line and exit status 2, found before any work.

Each case runs the command on a workdir that holds only a run's config.json: a flag
checked after loading would fail on the missing checkpoint instead ("holds no complete
checkpoint"), so each expected message also proves the order. One case per command runs
the real command in a subprocess (one stderr line, exit status 2: errors.run_cli prints
any UserError so); the others call its `main(argv, flag_values)` in this process and
check the UserError's one-line message.
Plus main.py: `optim.learning_rate=nan` is refused by the optimizer's validation (a
UserError: one stderr line, exit 2, as a DivergenceError is), and a diverged run's hint
follows its clipping setting.
"""

import os
import pathlib
import re
import subprocess
import sys

from absl import flags
from absl import logging as absl_logging
import jax
import pytest

from odetransformer import errors
from odetransformer.tools import evaluate, generate, lm_eval
from odetransformer.train import health, loading
from odetransformer.train.checkpoint.fingerprint import save_config
from odetransformer.train.run_config import OptimConfig, RunConfig

from tiny import config_flags, cpu_env, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
ABSL_INFO = re.compile(r"I\d{4} ")  # absl's INFO lines (main.py logs the JAX topology)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A run's config.json alone (gpt family, model.max_len=32), no checkpoint."""
  wd = tmp_path_factory.mktemp("config_only")
  save_config(tiny_config(wd / "cache"), str(wd))
  return wd


def run(args, timeout=120) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, *args], cwd=ROOT, env=cpu_env(), capture_output=True, timeout=timeout
  )


def error_line(proc) -> str:
  """The one stderr line (absl INFO lines aside) of a command that exited 2."""
  lines = [l for l in proc.stderr.decode("utf-8", "replace").splitlines() if not ABSL_INFO.match(l)]
  assert proc.returncode == 2, proc.stderr.decode()[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


def refusal(command, workdir, flag) -> str:
  """The one-line UserError of `command`'s main on `workdir` with `flag`, in-process
  (absl's verbosity, which the commands lower, restored)."""
  fv = command.define_flags(flags.FlagValues())
  fv([command.__name__, f"--workdir={workdir}", flag])
  verbosity = absl_logging.get_verbosity()
  try:
    with pytest.raises(errors.UserError) as err:
      command.main([], fv)
  finally:
    absl_logging.set_verbosity(verbosity)
  msg = errors.describe(err.value)
  assert "\n" not in msg, msg
  return msg


@pytest.mark.slow
def test_generate_refuses_in_one_stderr_line(workdir):
  proc = run(["-m", "odetransformer.tools.generate", f"--workdir={workdir}", "--max_new_tokens=0"])
  assert "--max_new_tokens=0 must be a positive number" in error_line(proc)


@pytest.mark.parametrize(
  "flag, needle",
  [
    ("--max_new_tokens=-5", "--max_new_tokens=-5 must be a positive number"),
    ("--num_samples=0", "--num_samples=0 must be >= 1"),
    ("--seed=99999999999999999999", "--seed=99999999999999999999 is out of range"),
    (os.fsdecode(b"--prompt=caf\xe9 \xff"), "--prompt is not valid UTF-8 text"),  # as argv
    ("--temperature=-1", "--temperature=-1.0 must be a finite number >= 0"),
    ("--temperature=nan", "--temperature=nan must be a finite number >= 0"),
  ],
)
def test_generate_refuses(workdir, flag, needle):
  assert needle in refusal(generate, workdir, flag)


@pytest.mark.parametrize(
  "flag, needle",
  [
    ("--seq_len=4096", "--seq_len=4096 exceeds the model's 32 learned positions"),
    ("--plot=/sys/odet_ppl.png", "--plot=/sys/odet_ppl.png cannot be written"),
    ("--mesh_shape=2,x", "--mesh_shape='2,x': expected 3 comma-separated sizes"),
  ],
)
def test_evaluate_refuses(workdir, flag, needle):
  assert needle in refusal(evaluate, workdir, flag)


def test_evaluate_names_its_data_flag_for_files_that_are_not_there(workdir, tmp_path):
  """--data=local:GLOB becomes the run's data.train_files and data.eval_files, but a glob
  that matches nothing is reported as the flag the user typed, before loading."""
  glob = str(tmp_path / "nowhere" / "*.txt")
  assert refusal(evaluate, workdir, f"--data=local:{glob}") == (
    f"--data=local:{glob}: no file matches {glob!r}; fix: check the path (globs are "
    "relative to the working directory)"
  )
  assert refusal(evaluate, workdir, "--data=local:") == (
    "--data=local: names no file; fix: pass --data=local:<glob of text files>"
  )


def test_solver_steps_on_a_discrete_run_is_refused_before_loading(tmp_path):
  c = tiny_config(tmp_path / "cache")
  c.model.kind = "transformer"
  save_config(c, str(tmp_path))
  for command in (evaluate, generate):
    assert refusal(command, tmp_path, "--solver_steps=3") == (
      "--solver_steps=3: this run is a discrete 'transformer' model of 2 layers, which "
      "runs only at that depth; leave --solver_steps out"
    )


@pytest.mark.slow
def test_evaluate_plot_refuses_a_directory(workdir):
  proc = run(["-m", "odetransformer.tools.evaluate", f"--workdir={workdir}", f"--plot={workdir}"])
  assert f"--plot={workdir} is a directory" in error_line(proc)
  assert sorted(os.listdir(workdir)) == ["config.json"]  # no probe file left


@pytest.mark.slow
def test_main_refuses_a_nan_learning_rate(tmp_path):
  c = tiny_config(tmp_path / "cache")
  proc = run(
    [
      "main.py",
      "--config=configs/default.py",
      f"--workdir={tmp_path / 'wd'}",
      *config_flags(c),
      "--config.optim.learning_rate=nan",
    ]
  )
  assert "optim.learning_rate=nan must be a finite number > 0" in error_line(proc)
  assert not (tmp_path / "wd").exists()


def test_divergence_hints():
  """With clipping on, a diverged run's hint (test_reliability's divergence test: the
  whole message) does not tell it to turn clipping on."""
  optim = lambda **kw: OptimConfig(learning_rate=1e-3, **kw)
  assert health.divergence_hint(optim(grad_clip_norm=0.0)) == (
    "lower optim.learning_rate (now 0.001) or turn on clipping with "
    "optim.grad_clip_norm (e.g. 1.0; now off)"
  )
  assert health.divergence_hint(optim(grad_clip_norm=0.5, skip_nonfinite_steps=2)) == (
    "lower optim.learning_rate (now 0.001) or lower optim.grad_clip_norm (now 0.5)"
  )


@pytest.mark.slow
def test_run_mesh_follows_the_run_or_the_flag():
  """The run's mesh.shape when it fits these devices, else fsdp over all of them; a
  --mesh_shape value wins and a misfit one is a one-line error."""
  n = jax.device_count()
  run = lambda shape: RunConfig.from_config({"mesh": {"shape": shape}}, recorded=True)
  assert dict(loading.run_mesh(run((1, 1, -1))).shape) == {"data": 1, "fsdp": 1, "tensor": n}
  assert dict(loading.run_mesh(run((n + 1, 1, 1))).shape) == {"data": 1, "fsdp": n, "tensor": 1}
  assert dict(loading.run_mesh(run((1, 1, -1)), "(-1, 1, 1)").shape) == {
    "data": n,
    "fsdp": 1,
    "tensor": 1,
  }
  with pytest.raises(
    errors.UserError,
    match=r"--mesh_shape=9,9,9: mesh.shape=\(9, 9, 9\) "
    "needs 729 devices",
  ):
    loading.run_mesh(run((1, -1, 1)), "9,9,9")


def test_lm_eval_drops_writing_options_on_other_processes():
  argv = [
    "lm_eval",
    "--model",
    "odetransformer",
    "--output_path",
    "out",
    "--log_samples",
    "--tasks",
    "t",
    "-o=out2",
    "-s",
    "--wandb_args",
    "project=p",
    "--limit",
    "3",
  ]
  assert lm_eval.without_writing_options(argv) == [
    "lm_eval",
    "--model",
    "odetransformer",
    "--tasks",
    "t",
    "--limit",
    "3",
  ]
