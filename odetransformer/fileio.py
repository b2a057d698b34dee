"""The one I/O layer for workdirs, data caches, tokenizers and checkpoints.

Every path a user passes (`--workdir`, `data.cache_dir`, `data.tokenizer_path`,
`init_from`) may be a local path or a URL that `etils.epath` supports (`gs://bucket/run`,
...): orbax writes checkpoints through the same library, so the whole run lives in one
place. Code outside this module never calls `open`, `os.path`, `shutil` or `pathlib` on
such a path; it calls these functions (or `fileio.path(p)`, an `epath.Path`).

Object stores have no rename and no partial writes: an object appears whole when its
write completes. `write_bytes_atomic` therefore writes a temporary file and renames it on
a local filesystem, and writes the object directly on an object store.
"""
import hashlib
import os
from typing import Union

from etils import epath

PathLike = Union[str, os.PathLike]


def path(p: PathLike) -> epath.Path:
  """`p` as an `epath.Path` (local or remote)."""
  return epath.Path(p)


def is_local(p: PathLike) -> bool:
  """True for a path on a local (POSIX) filesystem, False for a URL like gs://."""
  return "://" not in os.fspath(p)


def join(p: PathLike, *parts: str) -> str:
  """`p / parts` as a string (keeps a URL's scheme)."""
  return os.fspath(path(p).joinpath(*parts))


def exists(p: PathLike) -> bool:
  return path(p).exists()


def isdir(p: PathLike) -> bool:
  return path(p).is_dir()


def isfile(p: PathLike) -> bool:
  return path(p).is_file()


def makedirs(p: PathLike) -> None:
  path(p).mkdir(parents=True, exist_ok=True)


def listdir(p: PathLike) -> list:
  """Names of the entries of directory `p` (sorted); [] when it does not exist."""
  q = path(p)
  if not q.is_dir():
    return []
  return sorted(child.name for child in q.iterdir())


def read_bytes(p: PathLike) -> bytes:
  return path(p).read_bytes()


def read_text(p: PathLike) -> str:
  return path(p).read_text(encoding="utf-8")


def write_bytes_atomic(p: PathLike, data: bytes) -> None:
  """Writes `p` so that readers see the old content or the new, never a part."""
  q = path(p)
  if not is_local(p):
    q.write_bytes(data)     # an object appears whole when its upload completes
    return
  tmp = q.parent / f".{q.name}.tmp-{os.getpid()}"
  tmp.write_bytes(data)
  os.replace(os.fspath(tmp), os.fspath(q))


def write_text_atomic(p: PathLike, text: str) -> None:
  write_bytes_atomic(p, text.encode("utf-8"))


def remove(p: PathLike) -> None:
  path(p).unlink(missing_ok=True)


def rmtree(p: PathLike) -> None:
  q = path(p)
  if q.exists():
    q.rmtree()


def move(src: PathLike, dst: PathLike) -> None:
  """Renames a file or directory (a copy and delete on an object store)."""
  path(src).rename(path(dst))


def copy(src: PathLike, dst: PathLike) -> None:
  """Copies a file (`dst` appears whole)."""
  write_bytes_atomic(dst, read_bytes(src))


def sha256(p: PathLike, block: int = 1 << 22) -> str:
  h = hashlib.sha256()
  with path(p).open("rb") as f:
    for chunk in iter(lambda: f.read(block), b""):
      h.update(chunk)
  return h.hexdigest()
