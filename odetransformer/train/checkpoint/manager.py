"""The Checkpointer: periodic async saves, keep-last-k, automatic resume and preemption
saves.

Layout of one checkpoint, `<workdir>/checkpoints/<step>/`:

  model/                     nnx.state(model) as a pure dict (orbax PyTree, zarr3)
  opt/                       nnx.state(optimizer) as a pure dict (Adam moments, step)
  meta/                      JSON: step, base RNG key data, process count, fingerprint
  data/                      JSON: the grain iterator state of every process
  <item>/integrity.json      the item's integrity record (`integrity`)

Model and optimizer are separate items so that evaluation, generation and
materialisation restore only `model`. The data-iterator state is plain JSON restored by
`input_pipeline.restore_iterator_state`, not grain's own orbax handler (which loses the
packing remainder).

Reliability: orbax writes each step under a temporary name and commits it when complete
(`paths`), so a run killed mid-save leaves only an uncommitted step, which
`latest_step()` never lists. Before each save the run records itself as the step's writer
(`.save_owners/<step>.json`: host, PID, run id); at start a run that holds the workdir
lock deletes the temporary directories whose writer is known to have ended, and leaves
(with a warning) those of a writer that may still be running. A checkpoint that does not
restore is moved to `<workdir>/corrupt_checkpoints/` with a warning and the previous one
is used; when none restores, `CheckpointError` stops the run and nothing is moved or
overwritten. A save that fails (disk full, directory gone) is a one-line CheckpointError
too.
"""

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from absl import logging
from flax import nnx
import jax
import orbax.checkpoint as ocp

from odetransformer.runtime import fileio, logs, multihost, workdir_lock
from odetransformer.train.checkpoint import integrity
from odetransformer.train.checkpoint.paths import (
  CORRUPT_DIR,
  OWNERS_DIR,
  CheckpointError,
  checkpoint_dir,
  error_line,
  finalized_steps,
  read_json,
  unfinished_steps,
)
from odetransformer.train.checkpoint.restore import restore_newest


def _owner_path(workdir: str, step: int) -> str:
  return fileio.join(workdir, OWNERS_DIR, f"{int(step)}.json")


class Checkpointer:
  """Periodic async saves, keep-last-k, automatic resume and preemption saves.

  Args:
    workdir: the run's directory; checkpoints go to `<workdir>/checkpoints`.
    max_to_keep: how many recent checkpoints survive (>= 1; `validate_options`).
    async_save: write in a background thread (training continues meanwhile).
    fingerprint: recorded in every checkpoint's meta (`fingerprint.fingerprint`).
    lock: the run's acquired `WorkdirLock`. Only with it are temporary directories
      deleted at start (`_remove_dead_saves`), and each save checks that the lock is still
      this run's (`claim_step`).

  `allow_unverified` (set by the caller): restore checkpoints without their integrity
  record (`restore_newest`).
  """

  allow_unverified = False

  def __init__(
    self,
    workdir: str,
    *,
    max_to_keep: int = 3,
    async_save: bool = True,
    fingerprint: dict | None = None,
    lock: workdir_lock.WorkdirLock | None = None,
  ):
    self.workdir = os.fspath(workdir)
    self.directory = checkpoint_dir(workdir)
    self.fingerprint = fingerprint
    self.lock = lock
    logs.quiet_orbax_tracebacks()
    self._remove_dead_saves()
    # Not orbax's cleanup_tmp_directories: it deletes every temporary directory, those of
    # a run still writing into this workdir too.
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
    )
    self._manager = ocp.CheckpointManager(
      self.directory, options=options, item_handlers=integrity.integrity_item_handlers()
    )
    self._preempted = threading.Event()
    self._old_handlers = {}
    self._pending_step = None  # the step of a save that may still be in flight

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
        if name.split(".")[0] not in {str(s) for s, _ in unfinished}:  # of complete saves
          fileio.remove(fileio.join(self.workdir, OWNERS_DIR, name))
      for step, path in unfinished:
        owner = read_json(_owner_path(self.workdir, step))
        if owner and (
          workdir_lock.pid_gone(owner)
          or (previous.get("gone") and previous.get("run") == owner.get("run"))
        ):
          fileio.rmtree(path)
          logging.info("deleted %s, an unfinished save of a run that has ended", path)
          continue
        writer = (
          f"of PID {owner.get('pid')} on host {owner.get('host')}, which may still be running"
          if owner
          else "of a run that recorded no owner"
        )
        logging.warning(
          "left %s, an unfinished save %s; delete it once no run writes this workdir", path, writer
        )
    multihost.sync("odetransformer_remove_dead_saves")

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
    error = multihost.allgather_strings(error)[0]
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

    def handler(signum, frame):
      name = signal.Signals(signum).name
      if signum == signal.SIGINT and self._preempted.is_set():
        print(
          f"{name} again: exiting now without saving; the newest complete checkpoint "
          f"in {self.directory} is kept",
          file=sys.stderr,
          flush=True,
        )
        os._exit(130)
      # Set before logging: a second SIGINT can run this handler again as soon as the
      # line is out, and must then find the first one seen.
      self._preempted.set()
      logging.warning(
        "%s received: saving a checkpoint and stopping%s.",
        name,
        " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else "",
      )

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
  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list:
    return list(self._manager.all_steps())

  def save(
    self, step: int, model, optimizer, *, meta: dict, data_state: Any, force: bool = False
  ) -> bool:
    """Starts an (async) save of everything needed to resume at `step`.

    `model` and `optimizer` are modules or their `nnx.State`s. `data_state` is this
    process's iterator state (JSON-able); every process's state is gathered so that
    each one restores its own.
    """
    states = multihost.allgather_strings(json.dumps(data_state))
    data = {"process_count": jax.process_count(), "states": [json.loads(s) for s in states]}
    meta = dict(meta, step=int(step), process_count=jax.process_count())
    if self.fingerprint is not None:
      meta["fingerprint"] = self.fingerprint
    args = ocp.args.Composite(
      model=integrity.ArraysSave(nnx.to_pure_dict(_as_state(model))),
      opt=integrity.ArraysSave(nnx.to_pure_dict(_as_state(optimizer))),
      meta=integrity.JsonSave(meta),
      data=integrity.JsonSave(data),
    )
    self.wait_until_finished()  # orbax waits for the previous save anyway
    try:
      saved = bool(self._manager.save(int(step), args=args, force=force))
    except Exception as e:
      raise self._save_error(int(step), e) from e
    if saved:
      self._pending_step = int(step)
    return saved

  def _save_error(self, step: int, e: BaseException) -> CheckpointError:
    kept = [s for s in finalized_steps(self.workdir) if s != step]
    resume = f"it resumes from step {kept[-1]}" if kept else "no checkpoint was written yet"
    return CheckpointError(
      f"saving the checkpoint of step {step} in {self.directory} failed "
      f"({error_line(e)}); free disk space or restore the directory, then run the same "
      f"command again ({resume})"
    )

  def restore(self, step: int, abstract_model_state, abstract_opt_state):
    """Restores one step into abstract states (from `nnx.get_abstract_model`).

    Returns:
      (model_state, opt_state, meta, data_state): nnx.States to `nnx.merge` or
      `nnx.update` with, the meta dict, and this process's iterator state.
    """
    step, (model_state, opt_state, meta, data) = restore_newest(
      self._manager,
      self.directory,
      [int(step)],
      abstract_model_state,
      abstract_opt_state,
      allow_unverified=self.allow_unverified,
    )
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
    step, restored = restore_newest(
      self._manager,
      self.directory,
      steps,
      abstract_model_state,
      abstract_opt_state,
      allow_unverified=self.allow_unverified,
    )
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
    multihost.sync("odetransformer_set_aside_corrupt_checkpoints")
    self._manager.reload()

  def wait_until_finished(self):
    """Waits for a save in flight (committed with its integrity record: see
    `integrity.write_integrity_record`); a failed save is a CheckpointError."""
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as e:
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
      except Exception:
        pass  # the save's own error (above) is the one to report


def _this_process_data(data):
  """This process's data-iterator state from a checkpoint's `data` item (None when the
  checkpoint has none); every process's states when it was written by another number of
  processes (`input_pipeline.restore_iterator_state` picks this process's input shards)."""
  if data is None:
    return None
  if int(data["process_count"]) != jax.process_count():
    return list(data["states"])
  return data["states"][jax.process_index()]


def _as_state(x):
  return x if isinstance(x, nnx.State) else nnx.state(x)
