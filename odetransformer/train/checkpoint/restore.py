"""Restoring checkpoints: the one restore path (`restore_newest`) and the model alone
(`restore_model_state`, for the tools).

Restore targets come from `nnx.get_abstract_model` so they carry concrete-mesh
shardings (an `nnx.eval_shape` target carries an AbstractMesh). Each step's integrity
records are checked before it is read, and tensorstore checks every chunk's crc32c as it
reads (`integrity`). A checkpoint whose arrays have other shapes than the model's stops
at once (`LayoutMismatchError`: the code, not the files, differs); a corrupt or
unreadable one is skipped for the previous one; a reader (evaluation, generation) whose
step is deleted while it reads (the writer's `max_to_keep` rotation) moves to the newest
committed step. Every process reads its part and they agree on the verdict.
"""

import json
import time

from absl import logging
from etils import epath
from flax import nnx
import jax
import orbax.checkpoint as ocp

from odetransformer.runtime import fileio, logs, multihost
from odetransformer.train.checkpoint import integrity
from odetransformer.train.checkpoint.paths import (
  CheckpointError,
  checkpoint_dir,
  error_line,
  finalized_steps,
)

# Array layouts that changed in the code (not the config) and what to do about them.
SHAPE_CHANGE_HINT = (
  "its arrays' shapes differ from this model's under the same config: it was written "
  "by an odetransformer whose arrays were laid out differently (before 2026-11-22 the "
  "hypernetworks' P was stored [d_t, *weight axes], now [*weight axes, d_t]); use "
  "it with that version, or start a new --workdir"
)


class LayoutMismatchError(CheckpointError, ValueError):
  """A stored array's shape differs from the model's (see `SHAPE_CHANGE_HINT`)."""


def _check_stored_shapes(directory, step: int, item: str, target):
  """LayoutMismatchError naming the first array whose stored shape differs from
  `target`'s.

  Checked from the item's metadata before restoring: orbax finds a mismatch only
  while reading, and leaves its other reads pending, which print "Event loop is
  closed" tracebacks when the process exits. Metadata that cannot be read (a
  corrupt checkpoint) is left for the restore to report.
  """
  try:
    metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(directory) / str(int(step)) / item)
  except Exception:
    return
  leaves = jax.tree_util.tree_flatten_with_path(getattr(metadata, "tree", metadata))[0]
  stored = {
    jax.tree_util.keystr(path): tuple(m.shape)
    for path, m in leaves
    if getattr(m, "shape", None) is not None
  }
  for path, x in jax.tree_util.tree_flatten_with_path(target)[0]:
    key = jax.tree_util.keystr(path)
    if key in stored and tuple(x.shape) != stored[key]:
      raise LayoutMismatchError(
        f"{item}{key}: requested shape {tuple(x.shape)} is not "
        f"compatible with the stored shape {stored[key]}"
      )


def _fill(abstract_state, pure_dict):
  """An nnx.State shaped like `abstract_state` holding the restored arrays."""
  state = jax.tree.map(lambda x: x, abstract_state)  # do not mutate the caller's copy
  nnx.replace_by_pure_dict(state, pure_dict)
  return state


def _restore_args(targets: dict, json_items: tuple) -> dict:
  args = {
    item: integrity.ArraysRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
    )
    for item, target in targets.items()
  }
  args.update({item: integrity.JsonRestore() for item in json_items})
  return args


def _in_chain(e: BaseException | None, found) -> BaseException | None:
  """The first exception of `e`'s chain (e, its cause, ...) for which `found` holds."""
  while e is not None and not found(e):
    e = e.__cause__ or e.__context__
  return e


def _corrupt_chunk(step_dir: str, e: BaseException) -> integrity.CorruptCheckpointError | None:
  """The CorruptCheckpointError for tensorstore's checksum failure `e` (None: another
  error)."""
  e = _in_chain(e, lambda x: "Digest mismatch" in str(x))
  if e is None:
    return None
  return integrity.CorruptCheckpointError(
    f"{step_dir} is corrupt: an array chunk's crc32c differs from the one written when "
    f"it was saved ({error_line(e)[:200]})"
  )


def _read_step(
  manager, directory: str, step: int, targets: dict, json_items: tuple, allow_unverified: bool
) -> dict:
  """This process's read of one step: the integrity records of the items it reads,
  then the items (tensorstore checks each chunk's crc32c as it reads)."""
  step_dir = fileio.join(directory, str(step))
  unverified = []
  for item in (*targets, *json_items):
    try:
      integrity.verify_integrity_record(fileio.join(step_dir, item))
    except integrity.UnverifiedCheckpointError:
      unverified.append(item)
  if unverified:
    what = (
      f"the checkpoint of step {step} in {directory} has no integrity record "
      f"({', '.join(unverified)}: written by an older odetransformer, or its "
      f"{integrity.INTEGRITY_FILE} was deleted)"
    )
    if not allow_unverified:
      raise integrity.UnverifiedCheckpointError(f"{what}: {integrity.UNVERIFIED_HINT}")
    logging.warning("%s: restoring it unchecked (checkpoint_allow_unverified)", what)
  try:
    return manager.restore(step, args=ocp.args.Composite(**_restore_args(targets, json_items)))
  except Exception as e:
    corrupt = _corrupt_chunk(step_dir, e)
    if corrupt is not None:
      raise corrupt from e
    raise


def _vanished(step_dir: str, e: BaseException) -> bool:
  """True when `step_dir` is gone: deleted while being read (a writer's max_to_keep
  rotation). A file missing from a directory still there waits a few seconds for the
  deletion to finish."""
  missing = _in_chain(
    e,
    lambda x: (
      isinstance(x, FileNotFoundError)
      or any(text in str(x) for text in ("NOT_FOUND", "No such file"))
    ),
  )
  deadline = time.monotonic() + (5.0 if missing is not None else 0.0)
  while fileio.isdir(step_dir):
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.2)
  return True


def restore_newest(
  manager,
  directory: str,
  steps,
  abstract_model_state,
  abstract_opt_state=None,
  *,
  allow_unverified: bool = False,
  relist=None,
) -> tuple:
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
    json_items = integrity.JSON_ITEMS
  queue, tried, failed, vanished = list(steps), set(), [], []
  while queue:
    step = queue.pop(0)
    tried.add(step)
    for item, target in targets.items():
      try:
        _check_stored_shapes(directory, step, item, target)
      except LayoutMismatchError as e:
        raise LayoutMismatchError(
          f"the checkpoint of step {step} in {directory} does not restore: {SHAPE_CHANGE_HINT}; {e}"
        ) from e
    verdict, restored = "", None
    try:
      restored = _read_step(manager, directory, step, targets, json_items, allow_unverified)
    except Exception as e:
      kind = (
        "vanished"
        if _vanished(fileio.join(directory, str(step)), e)
        else "unverified"
        if isinstance(e, integrity.UnverifiedCheckpointError)
        else "failed"
      )
      verdict = f"{kind}\t{error_line(e) if kind == 'failed' else e}"
    verdict = next((v for v in multihost.allgather_strings(verdict) if v), "")
    kind, _, message = verdict.partition("\t")
    if kind == "unverified":
      raise integrity.UnverifiedCheckpointError(message)
    if kind == "vanished":
      vanished.append(step)
      logging.warning(
        "the checkpoint of step %d in %s was deleted while being read (a "
        "running trainer's max_to_keep?)%s",
        step,
        directory,
        "; reading the newest one" if relist else "",
      )
      if relist is not None:
        listed = [int(s) for s in json.loads(multihost.allgather_strings(json.dumps(relist()))[0])]
        queue = [s for s in listed if s not in tried]
      continue
    if kind == "failed":
      failed.append((step, message))
      logging.warning(
        "the checkpoint of step %d in %s does not restore (%s)%s",
        step,
        directory,
        message,
        "; trying the previous one" if queue else "",
      )
      continue
    if failed:
      logging.warning("using step %d, the newest checkpoint that restores", step)
    model_state = _fill(abstract_model_state, restored["model"])
    if abstract_opt_state is None:
      return step, (model_state, None, None, None)
    return step, (
      model_state,
      _fill(abstract_opt_state, restored["opt"]),
      restored["meta"],
      restored["data"],
    )
  if not failed:
    raise CheckpointError(
      f"the checkpoints of steps {vanished} in {directory} were deleted while being read "
      "(a running trainer's max_to_keep rotation) and no other is left; run the command "
      "again"
    )
  newest, error = failed[0]
  raise CheckpointError(
    f"no checkpoint in {directory} restores (steps {[s for s, _ in failed]}; nothing was "
    "changed); restore them from a backup or train again in a new --workdir (step "
    f"{newest}: {error})"
  )


def restore_model_state(
  workdir: str, abstract_model_state, step: int | None = None, allow_unverified: bool = False
):
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
  logs.quiet_orbax_tracebacks()
  manager = ocp.CheckpointManager(
    directory,
    item_handlers=integrity.integrity_item_handlers(),
    options=ocp.CheckpointManagerOptions(read_only=True),
  )

  def newest_first():
    manager.reload()
    return sorted(manager.all_steps(), reverse=True)

  try:
    steps = sorted(manager.all_steps(), reverse=True) if step is None else [int(step)]
    if not steps:
      raise CheckpointError(
        f"{directory} holds no complete checkpoint; train first "
        "(python main.py --workdir=...) or pass the --workdir of a run"
      )
    if step is not None and not fileio.isdir(fileio.join(directory, str(int(step)))):
      raise CheckpointError(
        f"{directory} has no checkpoint of step {step}; choose one of "
        f"{finalized_steps(workdir)} or leave the step out (the latest)"
      )
    found, (state, _, _, _) = restore_newest(
      manager,
      directory,
      steps,
      abstract_model_state,
      allow_unverified=allow_unverified,
      relist=newest_first if step is None else None,
    )
    return state, found
  finally:
    manager.close()
