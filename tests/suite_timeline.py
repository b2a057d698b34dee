"""Where the test suite's time goes: a pytest plugin that records, for every test, its wall
time, the CPU time of the process that ran it and of the processes it started, and the
time XLA spent compiling (and how many programs, of them how many were loaded from the
persistent compilation cache instead), then prints a table per test module.

  python -m pytest -q -n 2 -p tests.suite_timeline tests

(from the repository root, where `tests` imports as a package; `.ci/run` adds it.)

A test's figures include its fixtures' setup and teardown (a module fixture counts in the
test that made it). Each process that runs tests (pytest-xdist's workers, or pytest
itself without -n) appends one JSON line per test to a file of its own in
$SUITE_TIMELINE_DIR (default: a fresh temporary directory, named at the end); after the
run the table lists each module's summed figures, slowest first, then the totals, the
slowest tests, and the jitted functions whose programs took longest to compile (those
compiled, not loaded: where a first run's extra time goes). Child CPU counts the
processes a test started and waited for (those killed and reaped count too; the workers'
own threads are in its CPU); their compiles are not named.
"""

import collections
import json
import os
import pathlib
import resource
import tempfile
import time

import pytest

DIR_ENV = "SUITE_TIMELINE_DIR"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # compiled, or loaded
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # loaded from the persistent cache
FIELDS = ("wall_s", "cpu_s", "child_cpu_s", "compile_s", "programs", "loaded")
# The running counts, and the programs compiled (not loaded) during the current test by
# the jitted function's name: [count, seconds].
_compiles = {"seconds": 0.0, "programs": 0, "loaded": 0, "compiled": {}, "hit": False}


def _cpu() -> tuple:
  own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _on_duration(event, duration, fun_name="?", **kwargs):
  del kwargs
  if event == COMPILE_EVENT:
    _compiles["seconds"] += duration
    _compiles["programs"] += 1
    if not _compiles["hit"]:  # jax reports a load's cache hit before its duration
      entry = _compiles["compiled"].setdefault(fun_name, [0, 0.0])
      entry[0] += 1
      entry[1] += duration
    _compiles["hit"] = False


def _on_event(event, **kwargs):
  del kwargs
  if event == CACHE_HIT_EVENT:
    _compiles["loaded"] += 1
    _compiles["hit"] = True


def pytest_configure(config):
  # The controller (or pytest without -n) names the directory before any worker starts:
  # the workers inherit it with the environment.
  if not hasattr(config, "workerinput") and DIR_ENV not in os.environ:
    os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="suite_timeline_")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Runs where the test runs (a worker): setup, call and teardown between the readings."""
  if not _compiles.get("listening"):
    import jax.monitoring  # lazy: where tests run, after conftest set jax's environment

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    _compiles["listening"] = True
  wall, (cpu, child) = time.monotonic(), _cpu()
  seconds, programs, loaded = (_compiles[k] for k in ("seconds", "programs", "loaded"))
  _compiles["compiled"] = {}
  yield
  cpu_now, child_now = _cpu()
  row = {
    "test": item.nodeid,
    "wall_s": time.monotonic() - wall,
    "cpu_s": cpu_now - cpu,
    "child_cpu_s": child_now - child,
    "compile_s": _compiles["seconds"] - seconds,
    "programs": _compiles["programs"] - programs,
    "loaded": _compiles["loaded"] - loaded,
    "compiled": _compiles["compiled"],
  }
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  with open(pathlib.Path(os.environ[DIR_ENV], f"{worker}.jsonl"), "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")


def read_rows(directory) -> list:
  """Every test's row that the processes wrote to `directory`."""
  rows = []
  for path in sorted(pathlib.Path(directory).glob("*.jsonl")):
    rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
  return rows


def module_totals(rows) -> dict:
  """Module path -> its tests' summed FIELDS and their number ('tests')."""
  totals = collections.defaultdict(lambda: dict.fromkeys(FIELDS + ("tests",), 0))
  for row in rows:
    module = totals[row["test"].split("::")[0]]
    for field in FIELDS:
      module[field] += row[field]
    module["tests"] += 1
  return dict(totals)


def compiled_by_name(rows) -> dict:
  """Jitted function name -> [programs compiled (not loaded), their seconds], summed."""
  totals = collections.defaultdict(lambda: [0, 0.0])
  for row in rows:
    for name, (count, seconds) in row["compiled"].items():
      totals[name][0] += count
      totals[name][1] += seconds
  return dict(totals)


def table(rows, slowest: int = 15) -> list:
  """The lines printed after the run."""
  totals = module_totals(rows)
  header = f"{'module':<36} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'child CPU s':>11} "
  header += f"{'compile s':>9} {'programs':>8} {'loaded':>6}"

  def line(name, t):
    return (
      f"{name:<36} {t['tests']:>5} {t['wall_s']:>8.1f} {t['cpu_s']:>8.1f} "
      f"{t['child_cpu_s']:>11.1f} {t['compile_s']:>9.1f} {t['programs']:>8} {t['loaded']:>6}"
    )

  lines = [header]
  for name, t in sorted(totals.items(), key=lambda kv: -kv[1]["wall_s"]):
    lines.append(line(pathlib.Path(name).name, t))
  all_ = {k: sum(t[k] for t in totals.values()) for k in FIELDS + ("tests",)}
  lines.append(line("all", all_))
  lines.append(f"slowest {slowest} tests (wall s, CPU s, child CPU s, compile s):")
  for row in sorted(rows, key=lambda r: -r["wall_s"])[:slowest]:
    lines.append(
      f"  {row['wall_s']:6.1f} {row['cpu_s']:6.1f} {row['child_cpu_s']:6.1f} "
      f"{row['compile_s']:6.1f}  {row['test']}"
    )
  compiled = sorted(compiled_by_name(rows).items(), key=lambda kv: -kv[1][1])
  lines.append(
    f"compiled, not loaded: {sum(n for _, (n, _) in compiled)} programs; the slowest "
    "jitted functions (compile s, programs):"
  )
  for name, (count, seconds) in compiled[:slowest]:
    lines.append(f"  {seconds:6.1f} {count:6}  {name}")
  return lines


def pytest_terminal_summary(terminalreporter, config):
  if hasattr(config, "workerinput"):
    return
  directory = os.environ[DIR_ENV]
  rows = read_rows(directory)
  terminalreporter.write_sep("-", f"suite timeline ({directory})")
  for line in table(rows):
    terminalreporter.write_line(line)
