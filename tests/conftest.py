"""Shared pytest setup: CPU unless JAX_PLATFORMS says otherwise, fast compiles (the XLA
flags this XLA knows), the processes the tests start, markers, helpers for shared data.

The packages come installed (`pip install -e .`); main.py, configs/ and benchmarks/ from
the repository root, which pyproject's `pythonpath` gives this process and PYTHONPATH
below the processes the tests start (with tests/, for the helpers they import).
"""
import atexit
import os
import pathlib
import shutil
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Scripts the tests start import configs, main and the tests' own modules, as the tests do.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), str(ROOT / "tests")] +
    [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
     if p and p not in (str(ROOT), str(ROOT / "tests"))])
# Before jax starts, for this process and its children (tiny.cpu_env copies os.environ):
# the tests' XLA flags, and one persistent compilation cache for the session. Tests build
# the same tiny models again and again, in this process and in the programs they launch;
# the cache compiles each program once.
# Scripts that tests launch may import test modules (and so this file) again: keep the
# flags and the cache they were given.
from tiny import TEST_XLA_FLAGS  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="odet_tests_jax_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

import tf32  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
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
  import jax  # pylint: disable=g-import-not-at-top
  with jax.default_matmul_precision(*marker.args):
    yield


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
  import gcs  # pylint: disable=g-import-not-at-top
  with gcs.emulated_bucket() as url:
    yield url
