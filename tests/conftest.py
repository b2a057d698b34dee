"""Shared pytest setup: CPU unless JAX_PLATFORMS says otherwise, fast compiles (the XLA
flags this XLA knows), the processes the tests start, markers, helpers for shared data.

The packages come installed (`pip install -e .`); main.py, configs/ and benchmarks/ from
the repository root, which pyproject's `pythonpath` gives this process and PYTHONPATH
below the processes the tests start (with tests/, for the helpers they import).
"""

import atexit
import gc
import multiprocessing.process
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On a GPU, pytest-xdist's workers share the card: without this each would take 75% of its
# memory at start and the second would fail.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Scripts the tests start import configs, main and the tests' own modules, as the tests do.
os.environ["PYTHONPATH"] = os.pathsep.join(
  [str(ROOT), str(ROOT / "tests")]
  + [
    p
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if p and p not in (str(ROOT), str(ROOT / "tests"))
  ]
)
# Before jax starts, for this process and its children (tiny.cpu_env copies os.environ):
# the tests' XLA flags, and one persistent compilation cache for the session, kept for the
# next (tiny.kept_compile_cache). Tests build the same tiny models again and again, in this
# process and in the programs they launch; the cache compiles each program once.
# Scripts that tests launch may import test modules (and so this file) again: keep the
# flags and the cache they were given.
import tiny  # noqa: E402  (after PYTHONPATH and the env above)

if tiny.TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {tiny.TEST_XLA_FLAGS}".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tiny.kept_compile_cache()
  if _cache is None:
    _cache = tempfile.mkdtemp(prefix="odet_tests_jax_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(
    JAX_COMPILATION_CACHE_DIR=str(_cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )

# One data cache for the session's tiny runs on the embedded corpus (tests that ask for
# the `shared_data_cache` fixture): its tokenizer is trained and its corpus prepared once,
# not once per test module. pytest-xdist's workers and the processes the tests start
# inherit it; a cache is made for concurrent jobs (a second preparer waits on its lock).
if "ODET_TEST_DATA_CACHE" not in os.environ:
  _data_cache = tempfile.mkdtemp(prefix="odet_tests_data_cache_")
  atexit.register(shutil.rmtree, _data_cache, ignore_errors=True)
  os.environ["ODET_TEST_DATA_CACHE"] = _data_cache


# Python's cyclic garbage collector took ~7% of a test process's CPU at its default
# thresholds: tracing allocates objects by the million, and each older-generation pass
# walks the ~200k objects that the imported packages and collected tests hold. Fewer young
# passes here, and those objects frozen once collected (pytest_collection_finish), so no
# pass walks them again (the figure: the commit that added this).
gc.set_threshold(20_000, 20, 10)


def pytest_collection_finish(session):
  del session
  gc.freeze()


import tf32  # noqa: E402  (after the XLA flags above)

if os.environ.get(tf32.EMULATE_ENV) == "1":
  tf32.emulate_tf32_on_cpu()


@pytest.fixture(autouse=True, scope="module")
def _module_matmul_precision(request):
  """A module marked `matmul_precision(name)` (pytestmark) runs its module fixtures and
  tests under jax.default_matmul_precision(name)."""
  yield from _under_matmul_precision(request.node)


@pytest.fixture(autouse=True)
def _test_matmul_precision(request):
  """A test marked `matmul_precision(name)` runs (with its function fixtures) under
  jax.default_matmul_precision(name): float32 comparisons ask for the precision they test,
  since GPUs compute float32 matmuls as TF32 by default."""
  yield from _under_matmul_precision(request.node)


def _under_matmul_precision(node):
  marker = node.get_closest_marker("matmul_precision")
  if marker is None:
    yield
    return
  import jax  # lazy: conftest stays jax-free (scripts set XLA flags after importing it)

  with jax.default_matmul_precision(*marker.args):
    yield


# --------------------------------------------------------------------------------------
# The quick tier (-m "not slow") starts no Python process and no GCS emulator: each costs
# seconds (a fresh jax, or the emulator's start). In a run that leaves slow tests out, a
# test that does fails, naming what it started, so the edit loop stays quick as tests are
# added; a full run (CI) is not slowed by such a test and lets it pass.
# --------------------------------------------------------------------------------------
_started = []  # what the running test's setup and call started (a list of words each)


def _is_python(program) -> bool:
  name = os.path.basename(os.fsdecode(program))
  return program == sys.executable or name.startswith("python")


_popen_init = subprocess.Popen.__init__


def _recording_popen_init(self, args, *rest, **kwargs):
  argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
  if argv and _is_python(argv[0]) and not kwargs.get("shell"):
    _started.append(" ".join(map(os.fsdecode, argv))[:200])
  _popen_init(self, args, *rest, **kwargs)


_process_start = multiprocessing.process.BaseProcess.start


def _recording_process_start(self):
  _started.append(f"multiprocessing {self.name}")
  _process_start(self)


subprocess.Popen.__init__ = _recording_popen_init
multiprocessing.process.BaseProcess.start = _recording_process_start


@pytest.hookimpl(tryfirst=True)  # before the fixtures of the test are set up
def pytest_runtest_setup(item):
  del item
  _started.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if (
    call.when != "call"
    or not report.passed
    or item.get_closest_marker("slow")
    or "not slow" not in (item.config.option.markexpr or "")
  ):
    return
  started = list(_started)
  if "gcs_bucket" in getattr(item, "fixturenames", ()):
    started.append("the GCS emulator (fixture gcs_bucket)")
  if started:
    report.outcome = "failed"
    report.longrepr = (
      f"{item.nodeid} started {len(started)} process(es) but is not marked "
      "slow (@pytest.mark.slow, or pytestmark in its module):\n  " + "\n  ".join(started[:5])
    )


SHARED_DATA = ROOT.parent / "shared" / "data"
SHARED_REFERENCE = ROOT.parent / "shared" / "reference"


def shared_data_path(*parts: str) -> pathlib.Path:
  """Path under ../shared/data; skips the test when absent unless CI requires it."""
  return _shared_path(SHARED_DATA.joinpath(*parts))


def shared_reference_path(*parts: str) -> pathlib.Path:
  """Path under ../shared/reference (the authors' code and configs); skips like
  `shared_data_path`."""
  return _shared_path(SHARED_REFERENCE.joinpath(*parts))


def _shared_path(path: pathlib.Path) -> pathlib.Path:
  if not path.exists():
    if os.environ.get("ODET_REQUIRE_SHARED_DATA") == "1":
      pytest.fail(f"{path} is missing but ODET_REQUIRE_SHARED_DATA=1")
    pytest.skip(f"{path} not present (fresh clone without ../shared)")
  return path


@pytest.fixture(scope="session")
def gcs_bucket():
  """'gs://<bucket>' on a GCS emulator started for the session (tests/gcs.py)."""
  import gcs  # lazy: gcs.py imports the GCS clients (a second); only bucket tests need them

  with gcs.emulated_bucket() as url:
    yield url


@pytest.fixture(scope="session")
def shared_data_cache():
  """The session's data cache (ODET_TEST_DATA_CACHE above), shared by every worker: for
  tiny runs that only read the embedded corpus; a test that damages or inspects a cache
  uses its own."""
  return pathlib.Path(os.environ["ODET_TEST_DATA_CACHE"])
