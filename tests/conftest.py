"""Shared pytest setup: repo root on sys.path, CPU only, helpers for shared data."""
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SHARED_DATA = ROOT.parent / "shared" / "data"


def shared_data_path(*parts: str) -> pathlib.Path:
  """Path under ../shared/data; skips the test when absent unless CI requires it."""
  path = SHARED_DATA.joinpath(*parts)
  if not path.exists():
    if os.environ.get("ODET_REQUIRE_SHARED_DATA") == "1":
      pytest.fail(f"{path} is missing but ODET_REQUIRE_SHARED_DATA=1")
    pytest.skip(f"{path} not present (fresh clone without ../shared)")
  return path
