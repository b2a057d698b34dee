"""Orbax checkpoints: enough to resume a run bit for bit, readable by other tools.

Layout under `<workdir>`:

  config.json                  the run's full config (written at start, process 0)
  checkpoints/<step>/
    model/                     nnx.state(model) as a pure dict (orbax StandardSave)
    opt/                       nnx.state(optimizer) as a pure dict (Adam moments, step)
    meta/                      JSON: step, base RNG key data, process count, config
    data/                      JSON: the grain iterator state of every process

Model and optimizer are separate items so that evaluation, generation and
materialisation restore only `model`. The data-iterator state is plain JSON restored
by `input_pipeline.restore_iterator_state`, not grain's own orbax handler (which loses
the packing remainder). Restore targets come from `nnx.get_abstract_model` so they
carry concrete-mesh shardings (an `nnx.eval_shape` target carries an AbstractMesh).

    checksums.json             sha256 of every file above, written once the save is
                               complete (process 0), checked before every restore

Reliability: orbax writes each step under `<step>.orbax-checkpoint-tmp-<ts>` and renames
it when complete, so a run killed mid-save leaves only such a temporary directory:
`latest_step()` never lists it, and the manager deletes it at start
(`cleanup_tmp_directories`). Orbax 0.12.8 checksums only the shard indices of its zarr
arrays, not the data: flipped bits in a weight file restore without a word. Hence
`checksums.json`; a checkpoint whose files do not match it (or that fails to restore
otherwise: truncated files) is moved to `<workdir>/corrupt_checkpoints/` with a warning
and the previous one is used; when none restores, `CheckpointError` stops the run and
nothing is moved or overwritten. A save that fails (disk full, directory gone) is a
one-line CheckpointError too. Each checkpoint's `meta` records the run's fingerprint
(`fingerprint`): what its arrays mean — the model config, the data source and split,
the tokenizer file's hash — so that a resume with other settings is refused before
anything is written (`fingerprint_diffs`).
"""
import hashlib
import json
import logging as std_logging
import os
import shutil
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

from odetransformer.errors import ConfigError, UserError

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"   # the run's tokenizer, copied into its workdir
CHECKSUM_FILE = "checksums.json"


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


# --------------------------------------------------------------------------------------
# What a checkpoint depends on
# --------------------------------------------------------------------------------------
# Model fields that may change between a run and its resumption: no effect on the
# checkpointed arrays or on what they mean (vocab_size is the tokenizer's, compared as
# data.vocab_size).
RESUMABLE_MODEL_FIELDS = ("vocab_size", "remat_policy", "dtype", "state_dtype")
# The data settings that decide what the run trains on and with which tokenizer.
FINGERPRINT_DATA_FIELDS = ("source", "train_split", "train_files", "text_key", "vocab_size",
                           "tokenizer_sample_bytes")


def file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def fingerprint(config, tokenizer_sha256: Optional[str] = None) -> dict:
  """What a run's checkpoints depend on, as plain JSON values.

  The model config (less `RESUMABLE_MODEL_FIELDS`), the data source and split and the
  settings that train its tokenizer, and the tokenizer file's sha256 (None before the
  tokenizer is known).
  """
  plain = json.loads(config.to_json_best_effort())
  model = {k: v for k, v in plain.get("model", {}).items() if k not in RESUMABLE_MODEL_FIELDS}
  data = {k: plain.get("data", {}).get(k) for k in FINGERPRINT_DATA_FIELDS}
  return {"model": model, "data": data, "tokenizer_sha256": tokenizer_sha256}


def fingerprint_diffs(old: dict, new: dict) -> list:
  """'section.key old -> new' for each difference between two fingerprints.

  A None tokenizer hash (not known yet, or a checkpoint written before hashes) matches
  any. When the new run names its tokenizer file, the hash decides and the settings that
  would train one (tokenizer_sample_bytes) do not matter. A key only one side has is a
  field added to (or dropped from) the code since: its default keeps the old meaning.
  """
  diffs = []
  for section in ("model", "data"):
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
  return diffs


def stored_fingerprint(workdir: str) -> Optional[tuple]:
  """(step, fingerprint) of the newest checkpoint whose meta reads; None if none.

  Checkpoints written before fingerprints were recorded give one made from the config
  their meta holds (no tokenizer hash).
  """
  directory = checkpoint_dir(workdir)
  for step in reversed(finalized_steps(workdir)):
    try:
      with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
        meta = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(meta.get("fingerprint"), dict):
      return step, meta["fingerprint"]
    if isinstance(meta.get("config"), dict):
      import ml_collections  # pylint: disable=g-import-not-at-top
      return step, fingerprint(ml_collections.ConfigDict(meta["config"]))
  return None


def tokenizer_sha256(path: Optional[str]) -> Optional[str]:
  return file_sha256(path) if path and os.path.isfile(path) else None


def check_resumable(config, workdir: str) -> Optional[dict]:
  """ConfigError when `workdir` holds checkpoints of another model, data or tokenizer.

  Compares this config with the fingerprint the newest checkpoint records: model
  fields, data source and split, and — when `data.tokenizer_path` names a file — its
  hash; otherwise the settings that would train the tokenizer. Runs before anything is
  written (no tokenizer trained, no config.json rewritten), so a refused workdir stays
  exactly as it was. Returns the stored fingerprint (None: no checkpoint).
  """
  found = stored_fingerprint(workdir)
  if found is None:
    return None
  step, stored = found
  _refuse_if_different(workdir, step, stored,
                       fingerprint(config, tokenizer_sha256(config.data.get("tokenizer_path"))))
  return stored


def check_tokenizer(config, tokenizer_path: str, workdir: str, stored: Optional[dict]) -> dict:
  """The run's fingerprint, with its tokenizer's hash; ConfigError when a resumed run's
  tokenizer file differs from the checkpoints' (before it is copied into the workdir)."""
  new = fingerprint(config, tokenizer_sha256(tokenizer_path))
  if stored is not None:
    _refuse_if_different(workdir, finalized_steps(workdir)[-1], stored, new)
  return new


def _refuse_if_different(workdir: str, step: int, stored: dict, new: dict):
  diffs = fingerprint_diffs(stored, new)
  if diffs:
    raise ConfigError(
        f"{workdir} holds checkpoints (step {step}) of a different model, data or "
        f"tokenizer ({'; '.join(diffs)}); resume with the same settings, start a new "
        "--workdir, or fine-tune from this run with --config.init_from")


def save_tokenizer(src: str, workdir: str):
  """Copies the tokenizer to `<workdir>/tokenizer.model` (what the tools load)."""
  path = os.path.join(workdir, TOKENIZER_FILE)
  if jax.process_index() != 0 or not src or os.path.abspath(src) == os.path.abspath(path):
    return
  if os.path.isfile(path) and tokenizer_sha256(path) == tokenizer_sha256(src):
    return                 # a resumed run's own tokenizer: left as it is
  shutil.copyfile(src, path + ".tmp")
  os.replace(path + ".tmp", path)


def validate_options(config):
  """UserError for checkpoint settings that would lose work (checked before any write)."""
  keep = config.get("checkpoint_max_to_keep", 3)
  if keep is not None and (not isinstance(keep, int) or keep < 1):
    raise UserError(f"checkpoint_max_to_keep={keep!r} would keep no checkpoint (not even "
                    "the final one); use a positive count, e.g. 3")


# --------------------------------------------------------------------------------------
# Checksums of the files of a checkpoint
# --------------------------------------------------------------------------------------
def _files_under(root: str) -> list:
  out = []
  for base, _, files in os.walk(root):
    for name in files:
      rel = os.path.relpath(os.path.join(base, name), root)
      if rel != CHECKSUM_FILE:
        out.append(rel)
  return sorted(out)


def write_checksums(step_dir: str):
  """Writes `<step_dir>/checksums.json` (sha256 of every file) atomically."""
  sums = {rel: file_sha256(os.path.join(step_dir, rel)) for rel in _files_under(step_dir)}
  tmp = os.path.join(step_dir, CHECKSUM_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"sha256": sums}, f, indent=0, sort_keys=True)
  os.replace(tmp, os.path.join(step_dir, CHECKSUM_FILE))


def verify_checksums(step_dir: str, items: Optional[tuple] = None) -> bool:
  """Checks the files of `step_dir` (only those under `items`, if given) against its
  checksums.json. False when there is none (a checkpoint of an older version, or one
  whose run was killed before hashing it); CorruptCheckpointError on a mismatch."""
  path = os.path.join(step_dir, CHECKSUM_FILE)
  if not os.path.exists(path):
    return False
  try:
    with open(path) as f:
      sums = json.load(f)["sha256"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__})") from e
  for rel, expected in sorted(sums.items()):
    if items is not None and rel.split(os.sep)[0] not in items:
      continue
    full = os.path.join(step_dir, rel)
    try:
      actual = file_sha256(full)
    except OSError as e:
      raise CorruptCheckpointError(f"{full} is missing or unreadable ({e.strerror})") from e
    if actual != expected:
      raise CorruptCheckpointError(
          f"{full} is corrupt: its sha256 differs from the one written when it was saved")
  return True


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
  """Steps with a complete checkpoint (plain integer directories), ascending."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.fspath(workdir), CHECKPOINT_DIR)


def save_config(config, workdir: str):
  """Writes `<workdir>/config.json` (process 0 only)."""
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  os.replace(tmp, path)


def load_config(workdir: str):
  """The ConfigDict a run in `workdir` was started with.

  From `<workdir>/config.json`; when that is gone, from the newest checkpoint's meta
  (which holds the same config), with a warning. FileNotFoundError when neither exists.
  """
  import ml_collections  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    for step in reversed(finalized_steps(workdir)):
      try:
        with open(os.path.join(checkpoint_dir(workdir), str(step), "meta", "metadata")) as f:
          config = json.load(f).get("config")
      except (OSError, ValueError):
        continue
      if isinstance(config, dict):
        logging.warning("%s is missing: using the config recorded in checkpoint %d",
                        path, step)
        return ml_collections.ConfigDict(config)
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


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
  """

  def __init__(self, workdir: str, *, max_to_keep: int = 3, async_save: bool = True,
               fingerprint: Optional[dict] = None):
    self.workdir = os.fspath(workdir)
    self.directory = checkpoint_dir(workdir)
    self.fingerprint = fingerprint
    _quiet_orbax_tracebacks()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)   # a kill mid-save leaves <step>.orbax-checkpoint-tmp-*
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._preempted = threading.Event()
    self._old_handlers = {}
    self._pending_step = None     # the step of a save that may still be in flight
    self._unhashed = set()        # steps this run saved that have no checksums.json yet

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
        model=ocp.args.StandardSave(nnx.to_pure_dict(_as_state(model))),
        opt=ocp.args.StandardSave(nnx.to_pure_dict(_as_state(optimizer))),
        meta=ocp.args.JsonSave(meta),
        data=ocp.args.JsonSave(data),
    )
    self.wait_until_finished()    # orbax waits for the previous save anyway
    try:
      saved = bool(self._manager.save(int(step), args=args, force=force))
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(int(step), e) from e
    if saved:
      self._pending_step = int(step)
      self._unhashed.add(int(step))
    return saved

  def _save_error(self, step: int, e: BaseException) -> CheckpointError:
    kept = [s for s in finalized_steps(self.workdir) if s != step]
    resume = (f"it resumes from step {kept[-1]}" if kept
              else "no checkpoint was written yet")
    return CheckpointError(
        f"saving the checkpoint of step {step} in {self.directory} failed "
        f"({_one_line(e)}); free disk space or restore the directory, then run the same "
        f"command again ({resume})")

  def _hash_finished_saves(self):
    """checksums.json for the complete checkpoints this run saved (process 0; nothing in
    flight: called after waiting). Older ones without (a run killed before hashing, an
    older version) are not hashed now: their files were never checked."""
    if jax.process_index() != 0:
      self._unhashed.clear()
      return
    for step in sorted(self._unhashed & set(finalized_steps(self.workdir))):
      write_checksums(os.path.join(self.directory, str(step)))
    self._unhashed.clear()      # the rest were deleted (max_to_keep) or never completed

  def restore(self, step: int, abstract_model_state, abstract_opt_state):
    """Restores one step into abstract states (from `nnx.get_abstract_model`).

    Returns:
      (model_state, opt_state, meta, data_state): nnx.States to `nnx.merge` or
      `nnx.update` with, the meta dict, and this process's iterator state.
    """
    step, (model_state, opt_state, meta, data) = restore_newest(
        self._manager, self.directory, [int(step)], abstract_model_state, abstract_opt_state)
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
                                    abstract_model_state, abstract_opt_state)
    failed = [s for s in steps if s > step]
    if failed:
      self.set_aside(failed)
    model_state, opt_state, meta, data = restored
    return step, model_state, opt_state, meta, _this_process_data(data)

  def set_aside(self, steps):
    """Moves the (corrupt) step directories to `<workdir>/corrupt_checkpoints/`."""
    if jax.process_index() == 0:
      dest_root = os.path.join(self.workdir, CORRUPT_DIR)
      os.makedirs(dest_root, exist_ok=True)
      for step in steps:
        dest = os.path.join(dest_root, f"{step}-{int(time.time())}")
        shutil.move(os.path.join(self.directory, str(step)), dest)
        logging.warning("moved the corrupt checkpoint of step %d to %s", step, dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices("odetransformer_set_aside_corrupt_checkpoints")
    self._manager.reload()

  def wait_until_finished(self):
    """Waits for a save in flight, then hashes it; a failed save is a CheckpointError."""
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      step, self._pending_step = self._pending_step, None
      raise self._save_error(step if step is not None else -1, e) from e
    if self._pending_step is not None:
      step, self._pending_step = self._pending_step, None
      try:
        self._hash_finished_saves()
      except OSError as e:
        raise self._save_error(step, e) from e

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


def _verify_on_process_0(step_dir: str, items: Optional[tuple] = None):
  """`verify_checksums` on process 0 (files on shared storage), its verdict on all."""
  error = ""
  if jax.process_index() == 0:
    try:
      verify_checksums(step_dir, items)
    except CorruptCheckpointError as e:
      error = str(e)
  error = _allgather_strings(error)[0]
  if error:
    raise CorruptCheckpointError(error)


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


def restore_newest(manager, directory: str, steps, abstract_model_state,
                   abstract_opt_state=None) -> tuple:
  """The one restore path: the first of `steps` (newest first) whose files match their
  checksums and restore, as (step, (model_state, opt_state, meta, data)).

  With `abstract_opt_state` None only the model item is read (opt_state, meta and data
  are None). A checkpoint whose arrays have other shapes than the model's stops at once
  (LayoutMismatchError: the code, not the files, differs); a corrupt or unreadable one
  is skipped with a warning, and CheckpointError (one line) names the newest when none
  restores. Nothing is moved here.
  """
  targets = {"model": nnx.to_pure_dict(abstract_model_state)}
  if abstract_opt_state is not None:
    targets["opt"] = nnx.to_pure_dict(abstract_opt_state)
  failed = []
  for step in steps:
    for item, target in targets.items():
      try:
        _check_stored_shapes(directory, step, item, target)
      except LayoutMismatchError as e:
        raise LayoutMismatchError(f"the checkpoint of step {step} in {directory} does not "
                                  f"restore: {SHAPE_CHANGE_HINT}; {e}") from e
    args = {item: ocp.args.StandardRestore(target) for item, target in targets.items()}
    if abstract_opt_state is not None:
      args.update(meta=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
    try:
      _verify_on_process_0(os.path.join(directory, str(step)),
                           items=None if abstract_opt_state is not None else ("model",))
      restored = manager.restore(step, args=ocp.args.Composite(**args))
    except Exception as e:  # pylint: disable=broad-except
      failed.append((step, e))
      logging.warning("the checkpoint of step %d in %s does not restore (%s)%s", step,
                      directory, _one_line(e),
                      "; trying the previous one" if step != steps[-1] else "")
      continue
    if failed:
      logging.warning("using step %d, the newest checkpoint that restores", step)
    model_state = _fill(abstract_model_state, restored["model"])
    if abstract_opt_state is None:
      return step, (model_state, None, None, None)
    return step, (model_state, _fill(abstract_opt_state, restored["opt"]),
                  restored["meta"], restored["data"])
  newest, error = failed[0]
  raise CheckpointError(
      f"no checkpoint in {directory} restores (steps {[s for s, _ in failed]}; nothing was "
      "changed): their files are corrupt or truncated; restore them from a backup or "
      f"train again in a new --workdir (step {newest}: {_one_line(error)})")


def restore_model_state(workdir: str, abstract_model_state, step: Optional[int] = None):
  """Just the model item (for evaluation, generation, materialisation).

  The latest checkpoint whose model restores (`restore_newest`); a corrupt one is
  skipped with a warning and left where it is (a tool only reads).

  Args:
    workdir: a training workdir.
    abstract_model_state: from `nnx.get_abstract_model(lambda: create_model(cfg), mesh)`.
    step: which checkpoint; the latest that restores when None.

  Returns:
    (model_state, step).
  """
  directory = checkpoint_dir(workdir)
  _quiet_orbax_tracebacks()
  manager = ocp.CheckpointManager(directory,
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  try:
    steps = sorted(manager.all_steps(), reverse=True) if step is None else [int(step)]
    if not steps:
      raise CheckpointError(f"{directory} holds no complete checkpoint; train first "
                            "(python main.py --workdir=...) or pass the --workdir of a run")
    if step is not None and not os.path.isdir(os.path.join(directory, str(int(step)))):
      raise CheckpointError(f"{directory} has no checkpoint of step {step}; choose one of "
                            f"{finalized_steps(workdir)} or leave the step out (the latest)")
    found, (state, _, _, _) = restore_newest(manager, directory, steps, abstract_model_state)
    return state, found
  finally:
    manager.close()
