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
the packing remainder, ../shared/STACK.md §4). Restore targets come from
`nnx.get_abstract_model` so they carry concrete-mesh shardings (STACK §7).

Reliability: orbax writes each step under `<step>.orbax-checkpoint-tmp-<ts>` and renames
it when complete, so a run killed mid-save leaves only such a temporary directory:
`latest_step()` never lists it, and the manager deletes it at start
(`cleanup_tmp_directories`). A finalised checkpoint that fails to restore (truncated
or corrupted files) is moved to `<workdir>/corrupt_checkpoints/` with a warning and the
previous one is used; when none restores, `CheckpointError` stops the run and nothing
is moved or overwritten.
"""
import json
import os
import shutil
import signal
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
CONFIG_FILE = "config.json"


# Array layouts that changed in the code (not the config) and what to do about them.
SHAPE_CHANGE_HINT = (
    "its arrays' shapes differ from this model's under the same config: it was written "
    "by an odetransformer whose arrays were laid out differently (before 2026-11-22 the "
    "hypernetworks' P was stored [d_t, *weight axes], now [*weight axes, d_t]); use "
    "it with that version, or start a new --workdir")


class LayoutMismatchError(ValueError):
  """A stored array's shape differs from the model's (see `SHAPE_CHANGE_HINT`)."""


class CheckpointError(RuntimeError):
  """No checkpoint in the workdir can be restored (reported as one line by main.py)."""


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
  """The ConfigDict a run in `workdir` was started with."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  with open(os.path.join(workdir, CONFIG_FILE)) as f:
    return ml_collections.ConfigDict(json.load(f))


def _allgather_strings(text: str) -> list:
  """Every process's `text`, in process order (collective; trivial on one host)."""
  if jax.process_count() == 1:
    return [text]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  data = np.frombuffer(text.encode("utf-8"), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([data.size], np.int32))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [bytes(gathered[i, :int(lengths[i][0])]).decode("utf-8")
          for i in range(gathered.shape[0])]


class Checkpointer:
  """Periodic async saves, keep-last-k, automatic resume and preemption saves.

  Args:
    workdir: the run's directory; checkpoints go to `<workdir>/checkpoints`.
    max_to_keep: how many recent checkpoints survive.
    async_save: write in a background thread (training continues meanwhile).
  """

  def __init__(self, workdir: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.workdir = os.fspath(workdir)
    self.directory = checkpoint_dir(workdir)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)   # a kill mid-save leaves <step>.orbax-checkpoint-tmp-*
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._preempted = threading.Event()
    self._old_handler = None

  # -- preemption ---------------------------------------------------------------------
  def install_sigterm_handler(self):
    """On SIGTERM, ask the loop to save and stop (single-process runs).

    Multi-process runs rely on orbax's `reached_preemption`, which uses JAX's
    preemption-sync service so that all processes stop at the same step; that
    service installs its own SIGTERM notifier at `jax.distributed.initialize`, which
    a Python handler would replace, so none is installed there.
    """
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
      return
    def handler(signum, frame):  # pylint: disable=unused-argument
      logging.warning("SIGTERM received: saving a checkpoint and stopping.")
      self._preempted.set()
    self._old_handler = signal.signal(signal.SIGTERM, handler)

  def uninstall_sigterm_handler(self):
    if self._old_handler is not None:
      signal.signal(signal.SIGTERM, self._old_handler)
      self._old_handler = None

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
    args = ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.to_pure_dict(_as_state(model))),
        opt=ocp.args.StandardSave(nnx.to_pure_dict(_as_state(optimizer))),
        meta=ocp.args.JsonSave(meta),
        data=ocp.args.JsonSave(data),
    )
    return bool(self._manager.save(int(step), args=args, force=force))

  def restore(self, step: int, abstract_model_state, abstract_opt_state):
    """Restores into abstract states (from `nnx.get_abstract_model`).

    Returns:
      (model_state, opt_state, meta, data_state): nnx.States to `nnx.merge` or
      `nnx.update` with, the meta dict, and this process's iterator state.
    """
    model_target = nnx.to_pure_dict(abstract_model_state)
    opt_target = nnx.to_pure_dict(abstract_opt_state)
    _check_stored_shapes(self.directory, step, "model", model_target)
    _check_stored_shapes(self.directory, step, "opt", opt_target)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(
        model=ocp.args.StandardRestore(model_target),
        opt=ocp.args.StandardRestore(opt_target),
        meta=ocp.args.JsonRestore(),
        data=ocp.args.JsonRestore(),
    ))
    model_state = _fill(abstract_model_state, restored["model"])
    opt_state = _fill(abstract_opt_state, restored["opt"])
    data = restored["data"]
    data_state = None
    if data is not None:
      if int(data["process_count"]) != jax.process_count():
        logging.warning("Checkpoint was written by %d processes, this run has %d: "
                        "the data iterator restarts from its initial state.",
                        data["process_count"], jax.process_count())
      else:
        data_state = data["states"][jax.process_index()]
    return model_state, opt_state, restored["meta"], data_state

  def restore_latest(self, abstract_model_state, abstract_opt_state):
    """`restore` of the newest checkpoint that restores; None when there is none.

    A checkpoint that fails while an older one restores is corrupt: it is moved to
    `<workdir>/corrupt_checkpoints/` (so a later save of that step cannot collide with
    it) with a warning. When every checkpoint fails, nothing is moved and
    CheckpointError names the newest one and its error.

    Returns:
      None, or (step, model_state, opt_state, meta, data_state).
    """
    steps = sorted(self.all_steps(), reverse=True)
    failed = []
    for step in steps:
      try:
        restored = self.restore(step, abstract_model_state, abstract_opt_state)
      except Exception as e:  # pylint: disable=broad-except
        failed.append((step, e))
        logging.warning("checkpoint at step %d in %s does not restore (%s)", step,
                        self.directory, _one_line(e))
        continue
      if failed:
        logging.warning("resuming from step %d, the newest checkpoint that restores", step)
        self.set_aside([s for s, _ in failed])
      return (step,) + restored
    if not failed:
      return None
    step, error = failed[0]
    # The config was checked against the run's config.json before this (train.py), so
    # shapes differ because the code stores them differently, not the model.
    hint = f"; {SHAPE_CHANGE_HINT}" if isinstance(error, LayoutMismatchError) else ""
    raise CheckpointError(
        f"no checkpoint in {self.directory} restores (steps {[s for s, _ in failed]}; "
        f"nothing was changed){hint}; step {step}: {_one_line(error)}")

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
    self._manager.wait_until_finished()

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()
    self.uninstall_sigterm_handler()


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


def restore_model_state(workdir: str, abstract_model_state, step: Optional[int] = None):
  """Just the model item (for evaluation, generation, materialisation).

  Args:
    workdir: a training workdir.
    abstract_model_state: from `nnx.get_abstract_model(lambda: create_model(cfg), mesh)`.
    step: which checkpoint; the latest when None.

  Returns:
    (model_state, step).
  """
  manager = ocp.CheckpointManager(checkpoint_dir(workdir),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {checkpoint_dir(workdir)}")
    target = nnx.to_pure_dict(abstract_model_state)
    try:
      _check_stored_shapes(checkpoint_dir(workdir), step, "model", target)
    except LayoutMismatchError as e:
      raise LayoutMismatchError(f"the checkpoint of step {step} in {checkpoint_dir(workdir)} "
                                f"does not restore: {SHAPE_CHANGE_HINT}; {e}") from e
    restored = manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(target)))
    return _fill(abstract_model_state, restored["model"]), step
  finally:
    manager.close()
