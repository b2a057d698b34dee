"""The one I/O layer for workdirs, data caches, tokenizers and checkpoints.

Every path a user passes (`--workdir`, `data.cache_dir`, `data.tokenizer_path`,
`init_from`) may be a local path or a URL that `etils.epath` supports (`gs://bucket/run`,
...): orbax writes checkpoints through the same library, so the whole run lives in one
place. Code outside this module never calls `open`, `os.path`, `shutil` or `pathlib` on
such a path; it calls these functions (or `fileio.path(p)`, an `epath.Path`).

Object stores have no rename and no partial writes: an object appears whole when its
write completes. `write_bytes_atomic` therefore writes a temporary file and renames it on
a local filesystem, and writes the object directly on an object store.

Google Cloud Storage emulators (tests, a local fake-gcs-server): setting
`STORAGE_EMULATOR_HOST=http://HOST:PORT`, the variable Google's clients and gcsfs read, is
all it takes; `configure_emulator` (run when this module is imported) derives what the
other libraries need from it.
"""

import hashlib
import io
import os
import tempfile

from etils import epath
import fsspec
import numpy as np

from odetransformer.errors import UserError

PathLike = str | os.PathLike

EMULATOR_VAR = "STORAGE_EMULATOR_HOST"


def configure_emulator() -> str:
  """Points every GCS client of the process at `$STORAGE_EMULATOR_HOST` (no-op unset).

  google-cloud-storage reads the variable itself (and then sends no credentials).
  Derived here, never overriding a value the user set:
  - tensorstore (orbax's arrays): `TENSORSTORE_GCS_HTTP_URL` (its GCS endpoint) and
    `GOOGLE_AUTH_TOKEN_FOR_TESTING` (a fixed bearer token instead of looking for
    credentials); it reads both when its first GCS store opens, after imports.
  - google-cloud-cpp (array_record's GCS reader, so TFDS data under a gs:// data_dir):
    `CLOUD_STORAGE_EMULATOR_ENDPOINT`; without it the reader looks for the real service
    and its credentials, retrying until it gives up.
  - gcsfs (etils.epath, so the rest of this module): anonymous access, and
    `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`, read when gcsfs is imported: otherwise its
    file system asks the Storage Control gRPC API for each bucket's type, which an
    emulator does not serve (a timeout per bucket).

  Returns the emulator's URL ('' when none).
  """
  url = os.environ.get(EMULATOR_VAR, "")
  if url in ("", "default"):
    return ""
  if "://" not in url:
    url = "http://" + url
  os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
  os.environ.setdefault("CLOUD_STORAGE_EMULATOR_ENDPOINT", url)
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  fsspec.config.conf.setdefault("gcs", {}).setdefault("token", "anon")
  return url


def _configure_gcsfs():
  """gcsfs lists objects afresh each time: other processes (tensorstore, other hosts)
  write the same bucket, and a cached listing would miss their checkpoints."""
  fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)


configure_emulator()
_configure_gcsfs()


def path(p: PathLike) -> epath.Path:
  """`p` as an `epath.Path` (local or remote)."""
  return epath.Path(p)


def check_encodable(p: PathLike, what: str) -> None:
  """A one-line UserError when path `p` cannot reach the filesystem and the C libraries
  (orbax's tensorstore, SentencePiece) intact: bytes the process's locale could not
  decode, which Python keeps as lone surrogates (e.g. a non-ASCII path under LC_ALL=C
  with PYTHONUTF8=0)."""
  try:
    os.fspath(p).encode("utf-8")
  except UnicodeEncodeError:
    raise UserError(
      f"{what}={os.fspath(p)!a} holds bytes this process's locale cannot decode "
      "(LC_ALL/LANG name a non-UTF-8 locale and UTF-8 mode is off); run with "
      "PYTHONUTF8=1 or a UTF-8 locale (e.g. LC_ALL=C.UTF-8), or use an ASCII path"
    ) from None


def is_local(p: PathLike) -> bool:
  """True for a path on a local (POSIX) filesystem, False for a URL like gs://."""
  return "://" not in os.fspath(p)


def absolute(p: PathLike) -> str:
  """`p` as a user finds it from anywhere: a local path made absolute, a URL as it is."""
  return os.path.abspath(p) if is_local(p) else os.fspath(p)


def same_file(a: PathLike, b: PathLike) -> bool:
  """Whether `a` and `b` name the same file (a relative local path is resolved)."""
  if is_local(a) and is_local(b):
    return os.path.abspath(a) == os.path.abspath(b)
  return os.fspath(a).rstrip("/") == os.fspath(b).rstrip("/")


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


def walk_files(root: PathLike) -> list:
  """Paths of the files under `root` relative to it ('/'-separated), sorted; [] when
  `root` does not exist."""
  root = path(root)
  if not root.is_dir():
    return []
  # epath's walk gives a remote directory without its scheme: compare without it.
  base = os.fspath(root).split("://", 1)[-1].rstrip("/")
  out = []
  for directory, _, files in root.walk():
    rel = os.fspath(directory).split("://", 1)[-1].rstrip("/")[len(base) :].strip("/")
    out += [f"{rel}/{name}" if rel else name for name in files]
  return sorted(out)


def read_bytes(p: PathLike) -> bytes:
  return path(p).read_bytes()


def read_text(p: PathLike) -> str:
  return path(p).read_text(encoding="utf-8")


def write_bytes_atomic(p: PathLike, data: bytes) -> None:
  """Writes `p` (creating its directory) so that readers see the old content or the
  new, never a part."""
  q = path(p)
  if not is_local(p):
    q.write_bytes(data)  # an object appears whole when its upload completes
    return
  q.parent.mkdir(parents=True, exist_ok=True)  # as on an object store
  tmp = q.parent / f".{q.name}.tmp-{os.getpid()}"
  tmp.write_bytes(data)
  os.replace(os.fspath(tmp), os.fspath(q))


def write_text_atomic(p: PathLike, text: str) -> None:
  write_bytes_atomic(p, text.encode("utf-8"))


def write_npz(p: PathLike, **arrays) -> None:
  """`np.savez` of `arrays` as the file `p`."""
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  write_bytes_atomic(p, buf.getvalue())


def write_figure(p: PathLike, fig, **savefig_kwargs) -> None:
  """A matplotlib figure as the file `p`, in the format its extension names unless
  `savefig_kwargs` give one."""
  savefig_kwargs.setdefault("format", path(p).suffix.lstrip(".") or None)
  buf = io.BytesIO()
  fig.savefig(buf, **savefig_kwargs)
  write_bytes_atomic(p, buf.getvalue())


def remove(p: PathLike) -> None:
  path(p).unlink(missing_ok=True)


def rmtree(p: PathLike) -> None:
  q = path(p)
  if q.exists():
    q.rmtree()


def move(src: PathLike, dst: PathLike) -> None:
  """Renames a file or directory (a copy and delete on an object store, where
  directories are only name prefixes)."""
  if is_local(src) and is_local(dst):
    path(dst).parent.mkdir(parents=True, exist_ok=True)
    path(src).rename(path(dst))
    return
  copy_tree(src, dst)
  rmtree(src)


def copy_tree(src: PathLike, dst: PathLike) -> None:
  """Copies the files under `src` to the same relative paths under `dst` (either may be
  local or remote; a file `src` is copied to `dst`)."""
  if not isdir(src):
    copy(src, dst)
    return
  for rel in walk_files(src):
    copy(path(src) / rel, path(dst) / rel)  # creates a local file's directory


def copy(src: PathLike, dst: PathLike) -> None:
  """Copies a file (`dst` appears whole)."""
  write_bytes_atomic(dst, read_bytes(src))


def local_copy(p: PathLike) -> str:
  """A local path holding `p`'s bytes, for libraries that read only local files
  (SentencePiece, grain workers): `p` itself when local, else a copy under the
  temporary directory named by its content's hash (made once per content)."""
  if is_local(p):
    return os.fspath(p)
  data = read_bytes(p)
  local = os.path.join(
    tempfile.gettempdir(), "odet_remote_copies", hashlib.sha256(data).hexdigest()[:32], path(p).name
  )
  if not os.path.isfile(local):
    write_bytes_atomic(local, data)
  return local


def sha256(p: PathLike, block: int = 1 << 22) -> str:
  h = hashlib.sha256()
  with path(p).open("rb") as f:
    for chunk in iter(lambda: f.read(block), b""):
      h.update(chunk)
  return h.hexdigest()


def gcs_blob(url: PathLike):
  """The google-cloud-storage Blob of `gs://bucket/name` (for what epath lacks:
  generation preconditions). Honours STORAGE_EMULATOR_HOST (no credentials then)."""
  from google.cloud import storage  # lazy: google-cloud-storage only for gs:// locks

  url = os.fspath(url)
  if not url.startswith("gs://"):
    raise ValueError(f"{url} is not a gs:// URL")
  bucket, _, name = url[len("gs://") :].partition("/")
  return storage.Client().bucket(bucket).blob(name)
