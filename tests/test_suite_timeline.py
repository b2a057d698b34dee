"""The suite's timing plugin (tests/suite_timeline.py, which `.ci/run` loads with
`-p tests.suite_timeline`): run by pytest over a few tests of its own, on two workers, it
counts what each test compiled, loaded and spent in its child processes, and prints the
sums of what the workers recorded."""

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from tests import suite_timeline

from tiny import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]

_TIMELINE_TESTS = {
  "test_jit.py": """
    import jax, jax.numpy as jnp

    def test_compiles():
      f, x = (lambda x: jnp.sin(x) * 3), jnp.ones(5)
      jax.jit(f)(x).block_until_ready()
      jax.clear_caches()  # the same program again: from the persistent cache
      jax.jit(f)(x).block_until_ready()

    def test_nothing():
      pass
  """,
  "test_child.py": """
    import subprocess, sys

    BUSY = "import time\\nwhile time.process_time() < 0.5: pass"

    def test_child():
      subprocess.run([sys.executable, "-c", BUSY], check=True)
  """,
}


@pytest.mark.slow
def test_suite_timeline_counts_compiles_and_child_cpu_and_adds_up(tmp_path):
  """The plugin on two workers, over three tests: the jitted one's compiles are counted,
  the child's half CPU-second lands on the test that started it, and the printed table's
  modules and totals are the sums of the rows the workers wrote. The jitted program run
  again after jax's in-memory caches are cleared is counted as loaded (a fresh persistent
  cache)."""
  for name, text in _TIMELINE_TESTS.items():
    (tmp_path / name).write_text(textwrap.dedent(text))
  out_dir = tmp_path / "timeline"
  out_dir.mkdir()
  env = cpu_env(JAX_COMPILATION_CACHE_DIR=tmp_path / "cache", **{suite_timeline.DIR_ENV: out_dir})
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]
    + ["-p", "tests.suite_timeline", f"--rootdir={tmp_path}", str(tmp_path)],
    cwd=str(ROOT),
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = {r["test"].split("/")[-1]: r for r in suite_timeline.read_rows(out_dir)}
  assert sorted(rows) == [
    "test_child.py::test_child",
    "test_jit.py::test_compiles",
    "test_jit.py::test_nothing",
  ]
  compiles = rows["test_jit.py::test_compiles"]
  assert compiles["programs"] >= 3 and compiles["compile_s"] > 0  # ones, f, f loaded
  assert compiles["loaded"] == 1
  # Those compiled, by name: f once (its second run loaded), and jnp.ones's program.
  assert compiles["compiled"]["jit(<lambda>)"][0] == 1
  assert sum(n for n, _ in compiles["compiled"].values()) == compiles["programs"] - 1
  assert sum(s for _, s in compiles["compiled"].values()) < compiles["compile_s"]
  nothing = rows["test_jit.py::test_nothing"]
  assert nothing["programs"] == nothing["loaded"] == 0 and nothing["compiled"] == {}
  child = rows["test_child.py::test_child"]
  assert 0.5 <= child["child_cpu_s"] <= child["wall_s"]
  assert rows["test_jit.py::test_compiles"]["child_cpu_s"] == 0
  # The printed table is the rows' (after the run's summary rule).
  lines = proc.stdout.splitlines()
  start = next(i for i, line in enumerate(lines) if "suite timeline (" in line) + 1
  expected = suite_timeline.table(suite_timeline.read_rows(out_dir))
  assert lines[start : start + len(expected)] == expected
  assert f"compiled, not loaded: {compiles['programs'] - 1} programs;" in proc.stdout
  total = re.search(r"^all\s+3\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)", proc.stdout, re.MULTILINE)
  assert total, proc.stdout
  assert float(total.group(3)) == pytest.approx(
    sum(r["child_cpu_s"] for r in rows.values()), abs=0.05
  )
