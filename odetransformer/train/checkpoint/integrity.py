"""Integrity, part of each save and of each read.

The arrays are zarr3 with a crc32c checksum per chunk (orbax 0.12.8 checksums only each
shard's index; see `_install_chunk_checksums`): each process writes the checksums of what
it writes, and tensorstore checks them on every read, in parallel, on each process for
what it reads. The OCDBT manifests and b-tree nodes carry tensorstore's own checksums.
Every other file of an item (JSON, array metadata, manifests: small) is listed with its
sha256 in `<item>/integrity.json`, written by the primary process in the item handler's
`finalize`, after all writes and before the commit: a hard kill at any instant leaves an
uncommitted checkpoint or one with its record. A committed item without a record (an
older version wrote it, or the record was deleted) is unverified: refused with one line
unless `checkpoint_allow_unverified` is set.

The save and restore arguments here (`ArraysSave`, `JsonSave`, ...) route each item to
the handlers that write and check these records (`integrity_item_handlers`).
"""

import json

import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import tensorstore_utils

from odetransformer.runtime import fileio
from odetransformer.train.checkpoint.paths import CheckpointError

INTEGRITY_FILE = "integrity.json"  # in each item of a checkpoint


class CorruptCheckpointError(CheckpointError):
  """A checkpoint's files differ from the checksums written when it was saved."""


class UnverifiedCheckpointError(CheckpointError):
  """A committed checkpoint without its integrity record."""


UNVERIFIED_HINT = (
  "its files cannot be checked; restore it unchecked with "
  "--config.checkpoint_allow_unverified=true (main.py; the tools: "
  "--checkpoint_allow_unverified), or delete it to use the previous one"
)
UNVERIFIED_FLAG_HELP = (
  "Restore a checkpoint without its integrity record (one written by an older version) unchecked."
)


def _build_zarr3_metadata_with_crc32c(*args, **kwargs):
  """Orbax's zarr3 array metadata with a `crc32c` codec after each chunk's codecs:
  tensorstore writes a checksum per chunk and checks it on every read. Compression is
  zstd level 1, as in orbax's default (zarr2) arrays; its zarr3 default, level 3,
  costs more time for weights, which barely compress."""
  metadata = _ORBAX_BUILD_ZARR3_METADATA(*args, **kwargs)
  for codec in metadata["codecs"]:
    if codec.get("name") == "sharding_indexed":
      inner = codec["configuration"]["codecs"]
      for c in inner:
        if c.get("name") == "zstd":
          c["configuration"]["level"] = 1
      if not any(c.get("name") == "crc32c" for c in inner):
        inner.append({"name": "crc32c"})
  return metadata


_ORBAX_BUILD_ZARR3_METADATA = None


def _install_chunk_checksums():
  """Makes orbax's zarr3 arrays carry per-chunk crc32c checksums (once per process).

  Orbax 0.12.8 checksums only each zarr3 shard's index; the chunk codecs are chosen
  by a module function with no option, hence this wrapper. Only zarr3 writes are
  affected, and only `_IntegrityPyTreeHandler` writes zarr3.
  """
  global _ORBAX_BUILD_ZARR3_METADATA
  if _ORBAX_BUILD_ZARR3_METADATA is None:
    _ORBAX_BUILD_ZARR3_METADATA = tensorstore_utils._build_zarr3_metadata
    tensorstore_utils._build_zarr3_metadata = _build_zarr3_metadata_with_crc32c


def _chunk_file(rel: str) -> bool:
  """True for a tensorstore OCDBT data file (`.../d/<hash>`): chunks with their crc32c
  and b-tree nodes with their own checksums, checked by tensorstore as it reads."""
  return "d" in rel.split("/")[:-1]


def files_under(root) -> list:
  """Relative paths of the files under `root` (ascending; not integrity records)."""
  return [rel for rel in fileio.walk_files(root) if rel.split("/")[-1] != INTEGRITY_FILE]


def write_integrity_record(item_dir, chunk_checksums: bool):
  """Writes `<item_dir>/integrity.json`: the sha256 of each of its files that chunk
  checksums do not cover (JSON, array metadata, OCDBT manifests: small).

  Called in the handlers' `finalize`, on the primary process, after every process's
  writes completed and before orbax commits the checkpoint (the rename of its
  temporary directory; on object stores, commit_success.txt).
  """
  files = [rel for rel in files_under(item_dir) if not (chunk_checksums and _chunk_file(rel))]
  record = {
    "version": 1,
    "chunks": "crc32c" if chunk_checksums else None,
    "sha256": {rel: fileio.sha256(fileio.join(item_dir, rel)) for rel in files},
  }
  fileio.write_text_atomic(
    fileio.join(item_dir, INTEGRITY_FILE), json.dumps(record, indent=0, sort_keys=True)
  )


def verify_integrity_record(item_dir):
  """Checks the files `<item_dir>/integrity.json` lists (array chunks are checked by
  tensorstore as they are read).

  Raises:
    UnverifiedCheckpointError: there is no record (an older version wrote the item,
      or the record was deleted).
    CorruptCheckpointError: the record is unreadable, or a file it lists is missing
      or differs.
  """
  path = fileio.join(item_dir, INTEGRITY_FILE)
  try:
    text = fileio.read_text(path)
  except FileNotFoundError as e:
    raise UnverifiedCheckpointError(f"{item_dir} has no {INTEGRITY_FILE}") from e
  try:
    sums = json.loads(text)["sha256"]
    items = sorted(sums.items())
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__})") from e
  for rel, expected in items:
    full = fileio.join(item_dir, rel)
    try:
      actual = fileio.sha256(full)
    except FileNotFoundError as e:
      raise CorruptCheckpointError(f"{full} is missing") from e
    if actual != expected:
      raise CorruptCheckpointError(
        f"{full} is corrupt: its sha256 differs from the one recorded when it was saved"
      )


class _IntegrityPyTreeHandler(ocp.PyTreeCheckpointHandler):
  """Arrays as zarr3 with a crc32c per chunk, plus the record of the other files."""

  def __init__(self):
    _install_chunk_checksums()
    super().__init__(use_zarr3=True)

  def finalize(self, directory):
    super().finalize(directory)  # merges the processes' OCDBT manifests
    write_integrity_record(directory, chunk_checksums=True)


class _IntegrityJsonHandler(ocp.JsonCheckpointHandler):
  """A JSON item plus the record of its file."""

  def finalize(self, directory):
    super().finalize(directory)
    write_integrity_record(directory, chunk_checksums=False)


def _routed_to(handler_cls, args_cls, name: str, **save_or_restore):
  """A subclass of orbax's `args_cls` that routes an item to `handler_cls` (orbax finds
  an item's handler by the type of its arguments)."""
  return ocp.args.register_with_handler(handler_cls, **save_or_restore)(
    type(name, (args_cls,), {"__module__": __name__})
  )


ArraysSave = _routed_to(_IntegrityPyTreeHandler, ocp.args.PyTreeSave, "ArraysSave", for_save=True)
ArraysRestore = _routed_to(
  _IntegrityPyTreeHandler, ocp.args.PyTreeRestore, "ArraysRestore", for_restore=True
)
JsonSave = _routed_to(_IntegrityJsonHandler, ocp.args.JsonSave, "JsonSave", for_save=True)
JsonRestore = _routed_to(
  _IntegrityJsonHandler, ocp.args.JsonRestore, "JsonRestore", for_restore=True
)


ARRAY_ITEMS, JSON_ITEMS = ("model", "opt"), ("meta", "data")


def integrity_item_handlers() -> dict:
  """The orbax handler of each checkpoint item (for `ocp.CheckpointManager`)."""
  handlers = {item: _IntegrityPyTreeHandler() for item in ARRAY_ITEMS}
  handlers.update({item: _IntegrityJsonHandler() for item in JSON_ITEMS})
  return handlers
