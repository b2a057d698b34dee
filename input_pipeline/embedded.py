"""The embedded default corpus: the Python standard library's own .py files.

It exists offline on every machine that runs this project, so the default config
needs no download. The subset is fixed and bounded (top-level modules of at most
64 KiB, sorted by name, at most 3 MiB in all: ~2.8 MB / 150 files on CPython 3.11),
so preparing it and training a tokenizer on it take seconds. Files go to validation
by a hash of their name (~10%), so the split does not shift when a Python version
adds or drops a module. The text differs between Python versions; the prepared data
is keyed by the files' fingerprint, so each interpreter gets its own.
"""

import pathlib
import sysconfig
import zlib

MAX_FILE_BYTES = 64 * 1024
MAX_TOTAL_BYTES = 3 * 1024 * 1024
VALIDATION_MODULUS = 10  # crc32(name) % 10 == 0 -> validation


def stdlib_dir() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: pathlib.Path | None = None) -> dict[str, list[str]]:
  """Returns {'train': [...], 'validation': [...]}: the corpus's files, sorted by name."""
  root = stdlib_dir() if root is None else root
  chosen, total = [], 0
  for path in sorted(root.glob("*.py")):
    size = path.stat().st_size
    if size == 0 or size > MAX_FILE_BYTES:
      continue
    if total + size > MAX_TOTAL_BYTES:
      break
    chosen.append(path)
    total += size
  is_val = lambda p: zlib.crc32(p.name.encode()) % VALIDATION_MODULUS == 0
  train = [str(p) for p in chosen if not is_val(p)]
  val = [str(p) for p in chosen if is_val(p)]
  if not val and len(train) > 1:  # only on a freakishly small stdlib
    val = [train.pop()]
  return {"train": train, "validation": val}
