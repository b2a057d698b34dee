"""Orbax checkpoints: enough to resume a run bit for bit, readable by other tools.

Layout under `<workdir>`:

  config.json                  the run's full config (written at start, process 0)
  checkpoints/<step>/
    model/                     nnx.state(model) as a pure dict (orbax PyTree, zarr3)
    opt/                       nnx.state(optimizer) as a pure dict (Adam moments, step)
    meta/                      JSON: step, base RNG key data, process count, config
    data/                      JSON: the grain iterator state of every process
    <item>/integrity.json      the item's integrity record (below)

Model and optimizer are separate items so that evaluation, generation and
materialisation restore only `model`. The data-iterator state is plain JSON restored
by `input_pipeline.restore_iterator_state`, not grain's own orbax handler (which loses
the packing remainder). Restore targets come from `nnx.get_abstract_model` so they
carry concrete-mesh shardings (an `nnx.eval_shape` target carries an AbstractMesh).

Reliability: orbax writes each step under `<step>.orbax-checkpoint-tmp-<ts>` and renames
it when complete (on an object store, where there is no rename: under `<step>/`, complete
once it holds `commit_success.txt`), so a run killed mid-save leaves only an uncommitted
step, which `latest_step()` never lists. Before each save the run records itself as the
step's writer (`.save_owners/<step>.json`: host, PID, run id); at start a run that holds
the workdir lock deletes the temporary directories whose writer is known to have ended,
and leaves (with a warning) those of a writer that may still be running.

Integrity is part of the save and of the read. The arrays are zarr3 with a crc32c
checksum per chunk (orbax 0.12.8 checksums only each shard's index; see
`_install_chunk_checksums`): each process writes the checksums of what it writes, and
tensorstore checks them on every read, in parallel, on each process for what it reads.
The OCDBT manifests and b-tree nodes carry tensorstore's own checksums. Every other
file of an item (JSON, array metadata, manifests: small) is listed with its sha256 in
`<item>/integrity.json`, written by the primary process in the item handler's
`finalize`, after all writes and before the commit: a hard kill at any instant leaves
an uncommitted checkpoint or one with its record. A committed item without a record
(an older version wrote it, or the record was deleted) is unverified: refused with one
line unless `checkpoint_allow_unverified` is set. A checkpoint whose files do not match
(or that fails to restore otherwise: truncated files) is moved to
`<workdir>/corrupt_checkpoints/` with a warning and the previous one is used; when none
restores, `CheckpointError` stops the run and nothing is moved or overwritten. A reader
(evaluation, generation) whose step is deleted while it reads (the writer's
`max_to_keep` rotation) moves to the newest committed step. A save that fails (disk
full, directory gone) is a one-line CheckpointError too.

Each checkpoint's `meta` records the run's fingerprint
(`fingerprint`): what its arrays mean — the model config, the data source and split,
the tokenizer file's hash — and what makes a resume exact — the training data's
content hash, the batch shape and the seed — so that a resume with other settings is
refused before anything is written (`fingerprint_diffs`); `resume_with_changes`
accepts the latter knowingly.
"""
import json
import logging as std_logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from odetransformer.runtime import fileio
from odetransformer.runtime import workdir_lock
from odetransformer.errors import ConfigError, UserError

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"   # the run's tokenizer, copied into its workdir
OWNERS_DIR = ".save_owners"          # <step>.json: the run that writes that step
COMMIT_FILE = "commit_success.txt"   # orbax's mark of a complete step on object stores
_TMP_STEP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")   # a local step being written
INTEGRITY_FILE = "integrity.json"    # in each item of a checkpoint


# Array layouts that changed in the code (not the config) and what to do about them.
SHAPE_CHANGE_HINT = (
    "its arrays' shapes differ from this model's under the same config: it was written "
    "by an odetransformer whose arrays were laid out differently (before 2026-11-22 the "
    "hypernetworks' P was stored [d_t, *weight axes], now [*weight axes, d_t]); use "
    "it with that version, or start a new --workdir")


class CheckpointError(UserError, RuntimeError):
  """A workdir's checkpoints cannot be used or written (reported in one line)."""


class LayoutMismatchError(CheckpointError, ValueError):
  """A stored array's shape differs from the model's (see `SHAPE_CHANGE_HINT`)."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint's files differ from the checksums written when it was saved."""


class UnverifiedCheckpointError(CheckpointError):
  """A committed checkpoint without its integrity record."""


UNVERIFIED_HINT = (
    "its files cannot be checked; restore it unchecked with "
    "--config.checkpoint_allow_unverified=true (main.py; the tools: "
    "--checkpoint_allow_unverified), or delete it to use the previous one")
UNVERIFIED_FLAG_HELP = ("Restore a checkpoint without its integrity record (one written by "
                        "an older version) unchecked.")


# --------------------------------------------------------------------------------------
# What a checkpoint depends on
# --------------------------------------------------------------------------------------
# Model fields that may change between a run and its resumption: no effect on the
# checkpointed arrays or on what they mean (vocab_size is the tokenizer's, compared as
# data.vocab_size).
RESUMABLE_MODEL_FIELDS = ("vocab_size", "remat_policy", "dtype", "state_dtype", "attention_impl")
# The data settings that decide what the run trains on and with which tokenizer.
FINGERPRINT_DATA_FIELDS = ("source", "train_split", "train_files", "text_key", "vocab_size",
                           "tokenizer_sample_bytes")


# What makes a resume continue the run exactly: the batch shape and the seed.
RESUME_FIELDS = ("global_batch_size", "seq_len", "seed")
# Differences that `resume_with_changes` cannot accept: the arrays would mean something
# else (another model, vocabulary or tokenizer).
ARRAY_MEANING_DIFFS = ("model.", "data.vocab_size ", "data.tokenizer_sample_bytes ",
                       "tokenizer file ")


def file_sha256(path: str) -> str:
  return fileio.sha256(path)


def fingerprint(config, tokenizer_sha256: Optional[str] = None,
                data_hash: Optional[str] = None) -> dict:
  """What a run's checkpoints depend on, as plain JSON values.

  The model config (less `RESUMABLE_MODEL_FIELDS`), the data source and split and the
  settings that train its tokenizer, the batch shape and seed (`RESUME_FIELDS`), the
  tokenizer file's sha256 and the training data's content hash (each None while not
  known yet).
  """
  plain = json.loads(config.to_json_best_effort())
  model = {k: v for k, v in plain.get("model", {}).items() if k not in RESUMABLE_MODEL_FIELDS}
  data = {k: plain.get("data", {}).get(k) for k in FINGERPRINT_DATA_FIELDS}
  resume = {k: plain.get(k) for k in RESUME_FIELDS}
  return {"model": model, "data": data, "resume": resume,
          "tokenizer_sha256": tokenizer_sha256, "data_content_hash": data_hash}


def fingerprint_diffs(old: dict, new: dict) -> list:
  """'section.key old -> new' for each difference between two fingerprints.

  A None hash (not known yet, or a checkpoint written before hashes) matches any. When
  the new run names its tokenizer file, the hash decides and the settings that would
  train one (tokenizer_sample_bytes) do not matter. A key only one side has is a field
  added to (or dropped from) the code since: its default keeps the old meaning.
  """
  diffs = []
  for section in ("model", "data", "resume"):
    a, b = old.get(section) or {}, new.get(section) or {}
    for key in sorted(set(a) & set(b)):
      if section == "model" and key in RESUMABLE_MODEL_FIELDS:
        continue
      if key == "tokenizer_sample_bytes" and new.get("tokenizer_sha256"):
        continue
      if a.get(key) != b.get(key):
        diffs.append(f"{section}.{key} {a.get(key)!r} -> {b.get(key)!r}")
  a, b = old.get("tokenizer_sha256"), new.get("tokenizer_sha256")
  if a and b and a != b:
    diffs.append(f"tokenizer file sha256 {a[:12]}… -> {b[:12]}…")
  a, b = old.get("data_content_hash"), new.get("data_content_hash")
  if a and b and a != b:
    diffs.append(f"training data content {a[:40]!r} -> {b[:40]!r}")
  return diffs


def stored_fingerprint(workdir: str) -> Optional[tuple]:
  """(step, fingerprint) of the newest checkpoint whose meta reads; None if none.

  Checkpoints written before fingerprints were recorded give one made from the config
  their meta holds (no tokenizer hash).
  """
  directory = checkpoint_dir(workdir)
  for step in reversed(finalized_steps(workdir)):
    meta = _read_json(fileio.join(directory, str(step), "meta", "metadata"))
    if meta is None:
      continue
    if isinstance(meta.get("fingerprint"), dict):
      return step, meta["fingerprint"]
    if isinstance(meta.get("config"), dict):
      import ml_collections  # pylint: disable=g-import-not-at-top
      return step, fingerprint(ml_collections.ConfigDict(meta["config"]))
  return None


def tokenizer_sha256(path: Optional[str]) -> Optional[str]:
  return fileio.sha256(path) if path and fileio.isfile(path) else None


def check_resumable(config, workdir: str) -> Optional[dict]:
  """ConfigError when `workdir` holds checkpoints of another model, data or tokenizer,
  or of other batch settings.

  Compares this config with the fingerprint the newest checkpoint records: model
  fields, data source and split, batch shape and seed, and — when
  `data.tokenizer_path` names a file — its hash; otherwise the settings that would
  train the tokenizer. Runs before anything is written (no tokenizer trained, no
  config.json rewritten), so a refused workdir stays exactly as it was. Returns the
  stored fingerprint (None: no checkpoint).
  """
  found = stored_fingerprint(workdir)
  if found is None:
    return None
  step, stored = found
  _refuse_if_different(config, workdir, step, stored,
                       fingerprint(config, tokenizer_sha256(config.data.get("tokenizer_path"))))
  return stored


def check_tokenizer(config, tokenizer_path: str, workdir: str, stored: Optional[dict],
                    data_hash: Optional[str] = None) -> dict:
  """The run's fingerprint, with its tokenizer's hash and its training data's content
  hash (`Datasets.content_hash`); ConfigError when a resumed run's tokenizer file or
  data differ from the checkpoints' (before the tokenizer is copied into the workdir).
  """
  new = fingerprint(config, tokenizer_sha256(tokenizer_path), data_hash)
  if stored is not None:
    diffs = _refuse_if_different(config, workdir, finalized_steps(workdir)[-1], stored, new)
    if diffs:
      logging.warning("resuming with changes (resume_with_changes=true): %s; the run no "
                      "longer continues exactly", "; ".join(diffs))
  return new


def _refuse_if_different(config, workdir: str, step: int, stored: dict, new: dict) -> list:
  """ConfigError naming the differences, unless there are none or all are accepted by
  `resume_with_changes`; returns the accepted ones."""
  diffs = fingerprint_diffs(stored, new)
  if not diffs:
    return []
  if any(d.startswith(ARRAY_MEANING_DIFFS) for d in diffs):
    raise ConfigError(
        f"{workdir} holds checkpoints (step {step}) of a different model, data or "
        f"tokenizer ({'; '.join(diffs)}); resume with the same settings, start a new "
        "--workdir, or fine-tune from this run with --config.init_from")
  if not config.get("resume_with_changes", False):
    raise ConfigError(
        f"{workdir} holds checkpoints (step {step}) trained on other data or batch "
        f"settings ({'; '.join(diffs)}); resume with the same settings, pass "
        "--config.resume_with_changes=true to continue from them anyway (no longer an "
        "exact resume), or start a new --workdir")
  return diffs


def save_tokenizer(src: str, workdir: str):
  """Copies the tokenizer to `<workdir>/tokenizer.model` (what the tools load)."""
  path = fileio.join(workdir, TOKENIZER_FILE)
  if jax.process_index() != 0 or not src or fileio.same_file(src, path):
    return
  if fileio.isfile(path) and fileio.sha256(path) == fileio.sha256(src):
    return                 # a resumed run's own tokenizer: left as it is
  fileio.copy(src, path)


def validate_options(config):
  """UserError for checkpoint settings that would lose work (checked before any write)."""
  keep = config.get("checkpoint_max_to_keep", 3)
  if keep is not None and (not isinstance(keep, int) or keep < 1):
    raise UserError(f"checkpoint_max_to_keep={keep!r} would keep no checkpoint (not even "
                    "the final one); use a positive count, e.g. 3")


# --------------------------------------------------------------------------------------
# Integrity: written as part of each save, checked as part of each read
# --------------------------------------------------------------------------------------
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
  from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  if _ORBAX_BUILD_ZARR3_METADATA is None:
    _ORBAX_BUILD_ZARR3_METADATA = tensorstore_utils._build_zarr3_metadata  # pylint: disable=protected-access
    tensorstore_utils._build_zarr3_metadata = _build_zarr3_metadata_with_crc32c  # pylint: disable=protected-access


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
  record = {"version": 1, "chunks": "crc32c" if chunk_checksums else None,
            "sha256": {rel: fileio.sha256(fileio.join(item_dir, rel)) for rel in files}}
  fileio.write_text_atomic(fileio.join(item_dir, INTEGRITY_FILE),
                           json.dumps(record, indent=0, sort_keys=True))


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
          f"{full} is corrupt: its sha256 differs from the one recorded when it was saved")


class _IntegrityPyTreeHandler(ocp.PyTreeCheckpointHandler):
  """Arrays as zarr3 with a crc32c per chunk, plus the record of the other files."""

  def __init__(self):
    _install_chunk_checksums()
    super().__init__(use_zarr3=True)

  def finalize(self, directory):
    super().finalize(directory)           # merges the processes' OCDBT manifests
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
      type(name, (args_cls,), {"__module__": __name__}))


ArraysSave = _routed_to(_IntegrityPyTreeHandler, ocp.args.PyTreeSave, "ArraysSave",
                        for_save=True)
ArraysRestore = _routed_to(_IntegrityPyTreeHandler, ocp.args.PyTreeRestore, "ArraysRestore",
                           for_restore=True)
JsonSave = _routed_to(_IntegrityJsonHandler, ocp.args.JsonSave, "JsonSave", for_save=True)
JsonRestore = _routed_to(_IntegrityJsonHandler, ocp.args.JsonRestore, "JsonRestore",
                         for_restore=True)


ARRAY_ITEMS, JSON_ITEMS = ("model", "opt"), ("meta", "data")


def integrity_item_handlers() -> dict:
  """The orbax handler of each checkpoint item (for `ocp.CheckpointManager`)."""
  handlers = {item: _IntegrityPyTreeHandler() for item in ARRAY_ITEMS}
  handlers.update({item: _IntegrityJsonHandler() for item in JSON_ITEMS})
  return handlers


_CHATTY = ("/orbax/", "/tensorflow_datasets/")


class _LibraryLogs(std_logging.Filter):
  """The one filter on library log records (on the absl logger).

  Drops orbax and TFDS records below `min_level` (their INFO lines: dozens per
  checkpoint, and TFDS narrating the preparation of a local corpus file by file; tools
  that only read a checkpoint raise it to ERROR). Orbax logs a failed background save
  with a traceback per thread (~200 lines); the CheckpointError that follows says it in
  one line: its error lines are kept, their tracebacks dropped (kept with --verbose).
  """

  def __init__(self, min_level: int):
    super().__init__()
    self.min_level = min_level

  def filter(self, record):
    if not any(lib in record.pathname for lib in _CHATTY):
      return True
    if record.levelno >= std_logging.ERROR and "/orbax/" in record.pathname:
      from odetransformer import errors  # pylint: disable=g-import-not-at-top
      if not errors.verbose_requested():
        record.exc_info, record.exc_text = None, None
    return record.levelno >= self.min_level


def quiet_library_logs(min_level: Optional[int] = None) -> None:
  """Installs the library log filter once; `min_level` (default WARNING when installing)
  sets the lowest level of orbax and TFDS records shown."""
  std_logging.getLogger("gcsfs").setLevel(std_logging.WARNING)   # INFO: a line per file read
  logger = std_logging.getLogger("absl")
  found = [f for f in logger.filters if isinstance(f, _LibraryLogs)]
  if found:
    if min_level is not None:
      found[0].min_level = min_level
    return
  logger.addFilter(_LibraryLogs(std_logging.WARNING if min_level is None else min_level))


def _closed_loop_callback(exc_type, exc, tb) -> bool:
  """A tensorstore completion callback that found orbax's event loop closed: what each
  read or write still pending prints (as an unraisable exception, or through
  sys.excepthook) when a save or restore has failed; the failure itself is reported
  once, elsewhere."""
  if exc_type is not RuntimeError or str(exc) != "Event loop is closed":
    return False
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return tb is not None and "asyncio" in tb.tb_frame.f_code.co_filename


def _quiet_orbax_tracebacks():
  """Orbax's tracebacks of a failed save or restore as single lines (not with
  --verbose); installed once."""
  quiet_library_logs()
  from odetransformer import errors  # pylint: disable=g-import-not-at-top
  hook = sys.excepthook
  if getattr(hook, "_odet_quiet", False) or errors.verbose_requested():
    return

  def excepthook(exc_type, exc, tb):
    if not _closed_loop_callback(exc_type, exc, tb):
      hook(exc_type, exc, tb)
  excepthook._odet_quiet = True  # pylint: disable=protected-access
  sys.excepthook = excepthook
  unraisable = sys.unraisablehook

  def unraisablehook(args):
    if not _closed_loop_callback(args.exc_type, args.exc_value, args.exc_traceback):
      unraisable(args)
  sys.unraisablehook = unraisablehook


def finalized_steps(workdir: str) -> list:
  """Steps with a complete checkpoint, ascending: plain integer directories (on an
  object store: those holding orbax's commit file)."""
  directory = checkpoint_dir(workdir)
  steps = [int(n) for n in fileio.listdir(directory) if n.isdigit()]
  if fileio.is_local(directory):
    return sorted(s for s in steps if fileio.isdir(fileio.join(directory, str(s))))
  return sorted(s for s in steps if fileio.exists(fileio.join(directory, str(s), COMMIT_FILE)))


def unfinished_steps(workdir: str) -> list:
  """[(step, directory)] of the checkpoints being written, or left by a run that
  stopped mid-save."""
  directory = checkpoint_dir(workdir)
  names = fileio.listdir(directory)
  if fileio.is_local(directory):
    found = [(int(m.group(1)), n) for n in names for m in [_TMP_STEP.match(n)] if m]
  else:
    found = [(int(n), n) for n in names if n.isdigit()
             and not fileio.exists(fileio.join(directory, n, COMMIT_FILE))]
  return sorted((step, fileio.join(directory, name)) for step, name in found)


def checkpoint_dir(workdir: str) -> str:
  return fileio.join(workdir, CHECKPOINT_DIR)


def _owner_path(workdir: str, step: int) -> str:
  return fileio.join(workdir, OWNERS_DIR, f"{int(step)}.json")


def _read_json(path: str) -> Optional[dict]:
  try:
    value = json.loads(fileio.read_text(path))
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


def save_config(config, workdir: str):
  """Writes `<workdir>/config.json` (process 0 only)."""
  if jax.process_index() != 0:
    return
  fileio.makedirs(workdir)
  fileio.write_text_atomic(fileio.join(workdir, CONFIG_FILE),
                           config.to_json_best_effort(indent=2, sort_keys=True))


def load_config(workdir: str):
  """The ConfigDict a run in `workdir` was started with.

  From `<workdir>/config.json`; when that is gone, from the newest checkpoint's meta
  (which holds the same config), with a warning. FileNotFoundError when neither exists.
  """
  import ml_collections  # pylint: disable=g-import-not-at-top
  path = fileio.join(workdir, CONFIG_FILE)
  if not fileio.exists(path):
    for step in reversed(finalized_steps(workdir)):
      meta = _read_json(fileio.join(checkpoint_dir(workdir), str(step), "meta", "metadata"))
      if isinstance((meta or {}).get("config"), dict):
        logging.warning("%s is missing: using the config recorded in checkpoint %d",
                        path, step)
        return ml_collections.ConfigDict(meta["config"])
  return ml_collections.ConfigDict(json.loads(fileio.read_text(path)))


def _allgather_strings(text: str) -> list:
  """Every process's `text`, in process order (collective; trivial on one host)."""
  if jax.process_count() == 1:
    return [text]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(text.encode("utf-8"), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([data.size], np.int32))
  padded = np.zeros(max(1, int(np.max(lengths))), np.uint8)   # never a 0-size array
  padded[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [bytes(gathered[i, :int(lengths[i][0])]).decode("utf-8")
          for i in range(gathered.shape[0])]


class Checkpointer:
  """Periodic async saves, keep-last-k, automatic resume and preemption saves.

  Args:
    workdir: the run's directory; checkpoints go to `<workdir>/checkpoints`.
    max_to_keep: how many recent checkpoints survive (>= 1; `validate_options`).
    async_save: write in a background thread (training continues meanwhile).
    fingerprint: recorded in every checkpoint's meta (`fingerprint()`).
    lock: the run's acquired `WorkdirLock`. Only with it are temporary directories
      deleted at start (`_remove_dead_saves`), and each save checks that the lock is still
      this run's (`claim_step`).

  `allow_unverified` (set by the caller): restore checkpoints without their integrity
  record (`restore_newest`).
  """
  allow_unverified = False

  def __init__(self, workdir: str, *, max_to_keep: int = 3, async_save: bool = True,
               fingerprint: Optional[dict] = None,
               lock: Optional[workdir_lock.WorkdirLock] = None):
    self.workdir = os.fspath(workdir)
    self.directory = checkpoint_dir(workdir)
    self.fingerprint = fingerprint
    self.lock = lock
    _quiet_orbax_tracebacks()
    self._remove_dead_saves()
    # Not orbax's cleanup_tmp_directories: it deletes every temporary directory, those of
    # a run still writing into this workdir too.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=integrity_item_handlers())
    self._preempted = threading.Event()
    self._old_handlers = {}
    self._pending_step = None     # the step of a save that may still be in flight

  # -- ownership of the workdir's saves --------------------------------------------------
  def _holds_lock(self) -> bool:
    return self.lock is not None and self.lock.record is not None

  def _remove_dead_saves(self):
    """Deletes the temporary directories of saves whose writer is known to have ended
    (process 0, holding the lock); warns about the others, which it leaves."""
    if jax.process_index() == 0 and self._holds_lock():
      previous = self.lock.previous or {}
      unfinished = unfinished_steps(self.workdir)
      for name in fileio.listdir(fileio.join(self.workdir, OWNERS_DIR)):
        if name.split(".")[0] not in {str(s) for s, _ in unfinished}:   # of complete saves
          fileio.remove(fileio.join(self.workdir, OWNERS_DIR, name))
      for step, path in unfinished:
        owner = _read_json(_owner_path(self.workdir, step))
        if owner and (workdir_lock.pid_gone(owner) or (
            previous.get("gone") and previous.get("run") == owner.get("run"))):
          fileio.rmtree(path)
          logging.info("deleted %s, an unfinished save of a run that has ended", path)
          continue
        writer = (f"of PID {owner.get('pid')} on host {owner.get('host')}, which may still "
                  "be running" if owner else "of a run that recorded no owner")
        logging.warning("left %s, an unfinished save %s; delete it once no run writes "
                        "this workdir", path, writer)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("odetransformer_remove_dead_saves")

  def claim_step(self, step: int):
    """Call before saving `step`, on every process: WorkdirInUseError (one line, on
    every process) when the workdir lock is no longer this run's; else records this run
    as the writer of `step` (what start-up cleanup reads)."""
    error = ""
    if jax.process_index() == 0 and self._holds_lock():
      try:
        self.lock.check()
        fileio.write_text_atomic(_owner_path(self.workdir, step), json.dumps(self.lock.record))
      except workdir_lock.WorkdirInUseError as e:
        error = str(e)
    error = _allgather_strings(error)[0]
    if error:
      raise workdir_lock.WorkdirInUseError(error)

  # -- preemption ---------------------------------------------------------------------
  def install_sigterm_handler(self):
    """On SIGTERM or SIGINT (Ctrl-C), ask the loop to save and stop (single-process
    runs); a second SIGINT exits at once (status 130; the run resumes from its newest
    complete checkpoint).

    Multi-process runs rely on orbax's `reached_preemption`, which uses JAX's
    preemption-sync service so that all processes stop at the same step; that
    service installs its own SIGTERM notifier at `jax.distributed.initialize`, which
    a Python handler would replace, so none is installed there.
    """
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
      return
    def handler(signum, frame):  # pylint: disable=unused-argument
      name = signal.Signals(signum).name
      if signum == signal.SIGINT and self._preempted.is_set():
        print(f"{name} again: exiting now without saving; the newest complete checkpoint "
              f"in {self.directory} is kept", file=sys.stderr, flush=True)
        os._exit(130)  # pylint: disable=protected-access
      # Set before logging: a second SIGINT can run this handler again as soon as the
      # line is out, and must then find the first one seen.
      self._preempted.set()
      logging.warning("%s received: saving a checkpoint and stopping%s.", name,
                      " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else "")
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old_handlers[sig] = signal.signal(sig, handler)

  def uninstall_sigterm_handler(self):
    for sig, old in self._old_handlers.items():
      signal.signal(sig, old)
    self._old_handlers = {}

  def reached_preemption(self, step: int) -> bool:
    if jax.process_count() > 1:
      return bool(self._manager.reached_preemption(step))
    return self._preempted.is_set()

  # -- save / restore -------------------------------------------------------------------
  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list:
    return list(self._manager.all_steps())

  def save(self, step: int, model, optimizer, *, meta: dict, data_state: Any,
           force: bool = False) -> bool:
    """Starts an (async) save of everything needed to resume at `step`.

    `model` and `optimizer` are modules or their `nnx.State`s. `data_state` is this
    process's iterator state (JSON-able); every process's state is gathered so that
    each one restores its own.
    """
    states = _allgather_strings(json.dumps(data_state))
    data = {"process_count": jax.process_count(), "states": [json.loads(s) for s in states]}
    meta = dict(meta, step=int(step), process_count=jax.process_count())
    if self.fingerprint is not None:
      meta["fingerprint"] = self.fingerprint
    args = ocp.args.Composite(
        model=ArraysSave(nnx.to_pure_dict(_as_state(model))),
        opt=ArraysSave(nnx.to_pure_dict(_as_state(optimizer))),
        meta=JsonSave(meta),
        data=JsonSave(data),
    )
    self.wait_until_finished()    # orbax waits for the previous save anyway
    try:
      saved = bool(self._manager.save(int(step), args=args, force=force))
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(int(step), e) from e
    if saved:
      self._pending_step = int(step)
    return saved

  def _save_error(self, step: int, e: BaseException) -> CheckpointError:
    kept = [s for s in finalized_steps(self.workdir) if s != step]
    resume = (f"it resumes from step {kept[-1]}" if kept
              else "no checkpoint was written yet")
    return CheckpointError(
        f"saving the checkpoint of step {step} in {self.directory} failed "
        f"({_one_line(e)}); free disk space or restore the directory, then run the same "
        f"command again ({resume})")

  def restore(self, step: int, abstract_model_state, abstract_opt_state):
    """Restores one step into abstract states (from `nnx.get_abstract_model`).

    Returns:
      (model_state, opt_state, meta, data_state): nnx.States to `nnx.merge` or
      `nnx.update` with, the meta dict, and this process's iterator state.
    """
    step, (model_state, opt_state, meta, data) = restore_newest(
        self._manager, self.directory, [int(step)], abstract_model_state, abstract_opt_state,
        allow_unverified=self.allow_unverified)
    return model_state, opt_state, meta, _this_process_data(data)

  def restore_latest(self, abstract_model_state, abstract_opt_state):
    """The newest checkpoint that restores; None when there is none.

    A checkpoint that fails while an older one restores is corrupt: it is moved to
    `<workdir>/corrupt_checkpoints/` (so a later save of that step cannot collide with
    it) with a warning. When every checkpoint fails, nothing is moved and
    CheckpointError names the newest one and its error.

    Returns:
      None, or (step, model_state, opt_state, meta, data_state).
    """
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      return None
    step, restored = restore_newest(self._manager, self.directory, steps,
                                    abstract_model_state, abstract_opt_state,
                                    allow_unverified=self.allow_unverified)
    failed = [s for s in steps if s > step]
    if failed:
      self.set_aside(failed)
    model_state, opt_state, meta, data = restored
    return step, model_state, opt_state, meta, _this_process_data(data)

  def set_aside(self, steps):
    """Moves the (corrupt) step directories to `<workdir>/corrupt_checkpoints/`."""
    if jax.process_index() == 0:
      for step in steps:
        dest = fileio.join(self.workdir, CORRUPT_DIR, f"{step}-{int(time.time())}")
        fileio.move(fileio.join(self.directory, str(step)), dest)
        logging.warning("moved the corrupt checkpoint of step %d to %s", step, dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("odetransformer_set_aside_corrupt_checkpoints")
    self._manager.reload()

  def wait_until_finished(self):
    """Waits for a save in flight (committed with its integrity record: see
    `write_integrity_record`); a failed save is a CheckpointError."""
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      step, self._pending_step = self._pending_step, None
      raise self._save_error(step if step is not None else -1, e) from e
    self._pending_step = None

  def close(self):
    try:
      self.wait_until_finished()
    finally:
      self.uninstall_sigterm_handler()
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-except
        pass   # the save's own error (above) is the one to report


def _this_process_data(data):
  """This process's data-iterator state from a checkpoint's `data` item (None when the
  checkpoint has none); every process's states when it was written by another number of
  processes (`input_pipeline.restore_iterator_state` picks this process's input shards)."""
  if data is None:
    return None
  if int(data["process_count"]) != jax.process_count():
    return list(data["states"])
  return data["states"][jax.process_index()]


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  text = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return text[:300] + ("…" if len(text) > 300 else "")


def _as_state(x):
  return x if isinstance(x, nnx.State) else nnx.state(x)


def _check_stored_shapes(directory, step: int, item: str, target):
  """LayoutMismatchError naming the first array whose stored shape differs from
  `target`'s.

  Checked from the item's metadata before restoring: orbax finds a mismatch only
  while reading, and leaves its other reads pending, which print "Event loop is
  closed" tracebacks when the process exits. Metadata that cannot be read (a
  corrupt checkpoint) is left for the restore to report.
  """
  try:
    metadata = ocp.PyTreeCheckpointHandler().metadata(
        epath.Path(directory) / str(int(step)) / item)
  except Exception:  # pylint: disable=broad-except
    return
  leaves = jax.tree_util.tree_flatten_with_path(getattr(metadata, "tree", metadata))[0]
  stored = {jax.tree_util.keystr(path): tuple(m.shape) for path, m in leaves
            if getattr(m, "shape", None) is not None}
  for path, x in jax.tree_util.tree_flatten_with_path(target)[0]:
    key = jax.tree_util.keystr(path)
    if key in stored and tuple(x.shape) != stored[key]:
      raise LayoutMismatchError(f"{item}{key}: requested shape {tuple(x.shape)} is not "
                                f"compatible with the stored shape {stored[key]}")


def _fill(abstract_state, pure_dict):
  """An nnx.State shaped like `abstract_state` holding the restored arrays."""
  state = jax.tree.map(lambda x: x, abstract_state)   # do not mutate the caller's copy
  nnx.replace_by_pure_dict(state, pure_dict)
  return state


def _restore_args(targets: dict, json_items: tuple) -> dict:
  args = {item: ArraysRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
          for item, target in targets.items()}
  args.update({item: JsonRestore() for item in json_items})
  return args


def _in_chain(e: Optional[BaseException], found) -> Optional[BaseException]:
  """The first exception of `e`'s chain (e, its cause, ...) for which `found` holds."""
  while e is not None and not found(e):
    e = e.__cause__ or e.__context__
  return e


def _corrupt_chunk(step_dir: str, e: BaseException) -> Optional[CorruptCheckpointError]:
  """The CorruptCheckpointError for tensorstore's checksum failure `e` (None: another
  error)."""
  e = _in_chain(e, lambda x: "Digest mismatch" in str(x))
  if e is None:
    return None
  return CorruptCheckpointError(
      f"{step_dir} is corrupt: an array chunk's crc32c differs from the one written when "
      f"it was saved ({_one_line(e)[:200]})")


def _read_step(manager, directory: str, step: int, targets: dict, json_items: tuple,
               allow_unverified: bool) -> dict:
  """This process's read of one step: the integrity records of the items it reads,
  then the items (tensorstore checks each chunk's crc32c as it reads)."""
  step_dir = fileio.join(directory, str(step))
  unverified = []
  for item in (*targets, *json_items):
    try:
      verify_integrity_record(fileio.join(step_dir, item))
    except UnverifiedCheckpointError:
      unverified.append(item)
  if unverified:
    what = (f"the checkpoint of step {step} in {directory} has no integrity record "
            f"({', '.join(unverified)}: written by an older odetransformer, or its "
            f"{INTEGRITY_FILE} was deleted)")
    if not allow_unverified:
      raise UnverifiedCheckpointError(f"{what}: {UNVERIFIED_HINT}")
    logging.warning("%s: restoring it unchecked (checkpoint_allow_unverified)", what)
  try:
    return manager.restore(step, args=ocp.args.Composite(**_restore_args(targets, json_items)))
  except Exception as e:  # pylint: disable=broad-except
    corrupt = _corrupt_chunk(step_dir, e)
    if corrupt is not None:
      raise corrupt from e
    raise


def _vanished(step_dir: str, e: BaseException) -> bool:
  """True when `step_dir` is gone: deleted while being read (a writer's max_to_keep
  rotation). A file missing from a directory still there waits a few seconds for the
  deletion to finish."""
  missing = _in_chain(e, lambda x: isinstance(x, FileNotFoundError) or any(
      text in str(x) for text in ("NOT_FOUND", "No such file")))
  deadline = time.monotonic() + (5.0 if missing is not None else 0.0)
  while fileio.isdir(step_dir):
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.2)
  return True


def restore_newest(manager, directory: str, steps, abstract_model_state,
                   abstract_opt_state=None, *, allow_unverified: bool = False,
                   relist=None) -> tuple:
  """The one restore path: the first of `steps` (newest first) whose files pass their
  integrity checks and restore, as (step, (model_state, opt_state, meta, data)).

  With `abstract_opt_state` None only the model item is read (opt_state, meta and data
  are None). A checkpoint whose arrays have other shapes than the model's stops at once
  (LayoutMismatchError: the code, not the files, differs), and so does one without its
  integrity record unless `allow_unverified` (UnverifiedCheckpointError); a corrupt or
  unreadable one is skipped with a warning, and CheckpointError (one line) names the
  newest when none restores. A step deleted while it is read (a writer's rotation) is
  not corrupt: `relist()` (steps, newest first), when given, names the steps to try
  instead. Every process reads its part; their verdicts are shared, so all of them
  take the same step. Nothing is moved here.
  """
  targets = {"model": nnx.to_pure_dict(abstract_model_state)}
  json_items = ()
  if abstract_opt_state is not None:
    targets["opt"] = nnx.to_pure_dict(abstract_opt_state)
    json_items = JSON_ITEMS
  queue, tried, failed, vanished = list(steps), set(), [], []
  while queue:
    step = queue.pop(0)
    tried.add(step)
    for item, target in targets.items():
      try:
        _check_stored_shapes(directory, step, item, target)
      except LayoutMismatchError as e:
        raise LayoutMismatchError(f"the checkpoint of step {step} in {directory} does not "
                                  f"restore: {SHAPE_CHANGE_HINT}; {e}") from e
    verdict, restored = "", None
    try:
      restored = _read_step(manager, directory, step, targets, json_items, allow_unverified)
    except Exception as e:  # pylint: disable=broad-except
      kind = ("vanished" if _vanished(fileio.join(directory, str(step)), e) else
              "unverified" if isinstance(e, UnverifiedCheckpointError) else "failed")
      verdict = f"{kind}\t{_one_line(e) if kind == 'failed' else e}"
    verdict = next((v for v in _allgather_strings(verdict) if v), "")
    kind, _, message = verdict.partition("\t")
    if kind == "unverified":
      raise UnverifiedCheckpointError(message)
    if kind == "vanished":
      vanished.append(step)
      logging.warning("the checkpoint of step %d in %s was deleted while being read (a "
                      "running trainer's max_to_keep?)%s", step, directory,
                      "; reading the newest one" if relist else "")
      if relist is not None:
        listed = [int(s) for s in json.loads(_allgather_strings(json.dumps(relist()))[0])]
        queue = [s for s in listed if s not in tried]
      continue
    if kind == "failed":
      failed.append((step, message))
      logging.warning("the checkpoint of step %d in %s does not restore (%s)%s", step,
                      directory, message, "; trying the previous one" if queue else "")
      continue
    if failed:
      logging.warning("using step %d, the newest checkpoint that restores", step)
    model_state = _fill(abstract_model_state, restored["model"])
    if abstract_opt_state is None:
      return step, (model_state, None, None, None)
    return step, (model_state, _fill(abstract_opt_state, restored["opt"]),
                  restored["meta"], restored["data"])
  if not failed:
    raise CheckpointError(
        f"the checkpoints of steps {vanished} in {directory} were deleted while being read "
        "(a running trainer's max_to_keep rotation) and no other is left; run the command "
        "again")
  newest, error = failed[0]
  raise CheckpointError(
      f"no checkpoint in {directory} restores (steps {[s for s, _ in failed]}; nothing was "
      "changed); restore them from a backup or train again in a new --workdir (step "
      f"{newest}: {error})")


def restore_model_state(workdir: str, abstract_model_state, step: Optional[int] = None,
                        allow_unverified: bool = False):
  """Just the model item (for evaluation, generation, materialisation).

  The latest checkpoint whose model restores (`restore_newest`); a corrupt one is
  skipped with a warning and left where it is (a tool only reads). When the latest
  is deleted while it is read (the trainer's rotation), the newest one then committed.

  Args:
    workdir: a training workdir.
    abstract_model_state: from `nnx.get_abstract_model(lambda: create_model(cfg), mesh)`.
    step: which checkpoint; the latest that restores when None.
    allow_unverified: restore a checkpoint without its integrity record.

  Returns:
    (model_state, step).
  """
  directory = checkpoint_dir(workdir)
  _quiet_orbax_tracebacks()
  manager = ocp.CheckpointManager(directory, item_handlers=integrity_item_handlers(),
                                  options=ocp.CheckpointManagerOptions(read_only=True))

  def newest_first():
    manager.reload()
    return sorted(manager.all_steps(), reverse=True)
  try:
    steps = sorted(manager.all_steps(), reverse=True) if step is None else [int(step)]
    if not steps:
      raise CheckpointError(f"{directory} holds no complete checkpoint; train first "
                            "(python main.py --workdir=...) or pass the --workdir of a run")
    if step is not None and not fileio.isdir(fileio.join(directory, str(int(step)))):
      raise CheckpointError(f"{directory} has no checkpoint of step {step}; choose one of "
                            f"{finalized_steps(workdir)} or leave the step out (the latest)")
    found, (state, _, _, _) = restore_newest(
        manager, directory, steps, abstract_model_state, allow_unverified=allow_unverified,
        relist=newest_first if step is None else None)
    return state, found
  finally:
    manager.close()
