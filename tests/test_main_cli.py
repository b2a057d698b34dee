"""main.py's command line: help is a success that lists the flags."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag", ["--help", "-h", "--helpshort"])
def test_help_exits_0_and_lists_the_flags(flag):
  r = subprocess.run(
    [sys.executable, "main.py", flag],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("Trains (or resumes) a model from a config file.")
  flags_listed = re.findall(r"^  --(?:\[no\])?(\w+):", r.stdout, re.MULTILINE)
  assert sorted(flags_listed) == ["config", "verbose", "workdir"], r.stdout
  assert "python main.py --config=configs/default.py --workdir=/tmp/odet_default\n" in r.stdout
  assert "ODET_HUGEPAGES=1" in r.stdout
  assert not re.search(r"\b_[a-z]\w*", r.stdout), "help names a private function"


def test_an_unknown_flag_is_still_a_one_line_error():
  r = subprocess.run(
    [sys.executable, "main.py", "--no_such_flag"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 2
  assert r.stderr.splitlines() == [
    "error: Unknown command line flag 'no_such_flag'; see --helpshort for the flags"
  ]


def test_a_misspelt_override_names_the_key_and_the_fix(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      "main.py",
      "--config=configs/default.py",
      f"--workdir={tmp_path / 'wd'}",
      "--config.model.solver_step=5",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 2
  assert r.stderr.splitlines() == [
    "error: unknown config key 'solver_step' in --config.model.solver_step=5; did you mean "
    "--config.model.solver_steps?"
  ]


def test_a_bad_value_says_where_to_change_it(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      "main.py",
      "--config=configs/default.py",
      f"--workdir={tmp_path / 'wd'}",
      "--config.num_train_steps=-5",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert r.returncode == 2
  assert [l for l in r.stderr.splitlines() if l.startswith("error:")] == [
    "error: num_train_steps=-5 must be positive; change --config.num_train_steps (or its "
    "line in the config file)"
  ]
  assert not (tmp_path / "wd").exists()
