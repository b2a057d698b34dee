"""main.py's command line: help is a success that lists the flags."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # every test here starts processes

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag", ["--help", "-h", "--helpshort"])
def test_help_exits_0_and_lists_the_flags(flag):
  r = subprocess.run([sys.executable, "main.py", flag], cwd=ROOT, capture_output=True,
                     text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("Trains (or resumes) a model from a config file.")
  flags_listed = re.findall(r"^  --(?:\[no\])?(\w+):", r.stdout, re.MULTILINE)
  assert sorted(flags_listed) == ["config", "verbose", "workdir"], r.stdout
  assert "python main.py --config=configs/default.py --workdir=/tmp/odet_default\n" in r.stdout
  assert "ODET_HUGEPAGES=1" in r.stdout
  assert not re.search(r"\b_[a-z]\w*", r.stdout), "help names a private function"


def test_an_unknown_flag_is_still_a_one_line_error():
  r = subprocess.run([sys.executable, "main.py", "--no_such_flag"], cwd=ROOT,
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2
  assert r.stderr.splitlines() == [
      "error: Unknown command line flag 'no_such_flag'; see --helpshort for the flags"]
