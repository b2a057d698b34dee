"""Preparing a data or tokenizer cache: one preparer at a time, no leftovers, one line.

- `exclusive(cache_dir)`: jobs preparing into the same local cache take turns on a
  flock'd `.prepare.lock` in it (a second job waits, then finds the work done). On an
  object store (gs://) there is no lock: only the tokenizer is cached there, written as
  one object whose content does not depend on who writes it.
- `remove_incomplete(dir)`: TFDS prepares into `incomplete.*` beside the final directory
  and renames it at the end; a killed preparation leaves one behind. Called under the
  lock, so every `incomplete.*` there is a dead job's.
- `one_line_errors(...)`: a full disk during preparation, or a damaged prepared file
  when it is read, becomes a `DataError` (exit 2) naming the fix: the space needed, or
  the directory to delete.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import os

from absl import logging

from input_pipeline.errors import DataError
from odetransformer.runtime import fileio

LOCK_FILE = ".prepare.lock"
INCOMPLETE_PREFIX = "incomplete."
# What array_record / riegeli (and the checks below) say of a file cut short or overwritten.
_DAMAGED = ("Riegeli", "ArrayRecord file", "damaged record")
# Written beside prepared data: every file's size (checked whenever the data is opened)
# and sha256 (the data's content hash).
MANIFEST = "odet_files.json"


@contextlib.contextmanager
def exclusive(cache_dir: str, what: str):
  """Holds the cache's preparation lock (local caches; see the module docstring)."""
  if not fileio.is_local(cache_dir):
    yield
    return
  fileio.makedirs(cache_dir)
  with open(os.path.join(cache_dir, LOCK_FILE), "a", encoding="utf-8") as f:
    try:
      fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info("another job is preparing %s in %s: waiting for it", what, cache_dir)
      fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    yield  # closing the file releases the lock, also when the process dies


def remove_incomplete(parent: str) -> None:
  """Deletes what killed preparations left in `parent` (call with the lock held)."""
  for name in fileio.listdir(parent):
    if name.startswith(INCOMPLETE_PREFIX):
      logging.info("removing %s, left by a preparation that did not finish", name)
      fileio.rmtree(fileio.join(parent, name))


def is_no_space(e: BaseException) -> bool:
  return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def is_damaged(e: BaseException) -> bool:
  return isinstance(e, (RuntimeError, OSError, ValueError)) and any(s in str(e) for s in _DAMAGED)


@contextlib.contextmanager
def one_line_errors(where: str, *, need_bytes: int = 0, delete: str = "", reprepare: str = ""):
  """Turns a full disk and a damaged prepared file into one-line DataErrors.

  Args:
    where: The directory being written or read.
    need_bytes: About how much the preparation writes (0: unknown).
    delete: The directory holding damaged data, deleted to have it prepared again.
    reprepare: The command that prepares it again after deleting (empty: the next run).
  """
  try:
    yield
  except DataError:
    raise
  except Exception as e:
    detail = " ".join(str(e).split())[:160]
    if is_no_space(e):
      need = f" about {need_bytes / 2**20:,.0f} MiB" if need_bytes else ""
      raise DataError(
        f"no space left on device while preparing data in {where}; fix: free"
        f"{need or ' space'} there or set data.cache_dir to a disk with room "
        "(partial files are removed on the next run)"
      ) from e
    if is_damaged(e) and delete:
      then = f", then run {reprepare}" if reprepare else " (it is prepared again on the next run)"
      raise DataError(
        f"the prepared data in {delete} is damaged ({detail}); fix: delete {delete}{then}"
      ) from e
    raise


def _files(directory: str) -> list[str]:
  return [
    name
    for name in fileio.listdir(directory)
    if name != MANIFEST and fileio.isfile(fileio.join(directory, name))
  ]


def write_manifest(directory: str) -> None:
  """Records the size and sha256 of each prepared file in `directory` (after preparing)."""
  record = {
    name: {
      "bytes": fileio.path(fileio.join(directory, name)).stat().length,
      "sha256": fileio.sha256(fileio.join(directory, name)),
    }
    for name in _files(directory)
  }
  fileio.write_text_atomic(
    fileio.join(directory, MANIFEST), json.dumps(record, indent=1, sort_keys=True)
  )


def _manifest(directory: str) -> dict | None:
  path = fileio.join(directory, MANIFEST)
  return json.loads(fileio.read_text(path)) if fileio.exists(path) else None


def content_hash(directory: str) -> str | None:
  """sha256 over the prepared record files' sha256s, from the manifest (None without one)."""
  record = _manifest(directory)
  if record is None:
    return None
  # The records alone: TFDS's metadata files may change when identical data is prepared
  # again, which must not make it other data.
  blob = json.dumps(
    {name: r["sha256"] for name, r in record.items() if ".array_record" in name}, sort_keys=True
  )
  return hashlib.sha256(blob.encode()).hexdigest()


def check_manifest(directory: str, *, delete: str, reprepare: str = "") -> None:
  """DataError when a prepared file in `directory` is missing or not the size it was
  written with (cut short by a full disk, a killed copy, ...); nothing to check when
  the data was prepared without a manifest."""
  expected = _manifest(directory)
  if expected is None:
    return
  found = {
    name: fileio.path(fileio.join(directory, name)).stat().length for name in _files(directory)
  }
  for name, r in sorted(expected.items()):
    if found.get(name) != r["bytes"]:
      now = "missing" if name not in found else f"{found[name]:,} bytes"
      with one_line_errors(directory, delete=delete, reprepare=reprepare):
        raise RuntimeError(f"damaged record file {name}: {now}, {r['bytes']:,} bytes when prepared")


class Checked:
  """A random-access source whose reads of damaged files raise one-line DataErrors."""

  def __init__(self, source, directory: str, reprepare: str = ""):
    self._source, self._dir, self._reprepare = source, directory, reprepare

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index):
    with one_line_errors(self._dir, delete=self._dir, reprepare=self._reprepare):
      record = self._source[index]
      if isinstance(record, dict) and any(v is None for v in record.values()):
        # A damaged array_record file can also read back as empty features.
        raise RuntimeError(f"damaged record {index}: it reads back without a value")
      return record

  def __iter__(self):
    return (self[i] for i in range(len(self)))
