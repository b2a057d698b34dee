"""The workdir lock on object storage (against a
GCS emulator), a run that stops when its lock is no longer its own, and start-up cleanup
that deletes only unfinished saves whose writer is known to have ended."""

import json
import os
import signal
import socket
import subprocess
import time

import pytest
from test_reliability import (
  LONG_RUN_STEPS,
  assert_one_line_error,
  main_cmd,
  start_and_wait_for_checkpoint,
)
from test_train import fast_compiles  # noqa: F401  (fast_compiles: autouse fixture, the rbg PRNG)

from odetransformer.runtime import fileio
from odetransformer.runtime.workdir_lock import (
  CHECKPOINTS,
  LOCK_FILE,
  WorkdirInUseError,
  WorkdirLock,
)
from odetransformer.train.checkpoint.manager import Checkpointer
from odetransformer.train.checkpoint.paths import (
  CHECKPOINT_DIR,
  OWNERS_DIR,
  finalized_steps,
  unfinished_steps,
)


@pytest.mark.slow
def test_object_lock_refuses_takes_over_stale_and_notices_loss(gcs_bucket, caplog):
  wd = f"{gcs_bucket}/lock"
  lock_path = f"{wd}/.lock"
  first = WorkdirLock(wd, heartbeat_s=0.2, stale_s=30).acquire()
  record = json.loads(fileio.read_text(lock_path))
  assert {k: record[k] for k in ("pid", "host", "run")} == {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "run": first.record["run"],
  }
  # A fresh lock: refused in one line, the object untouched.
  with pytest.raises(WorkdirInUseError, match=r"is in use by PID \d+ on host .*last heartbeat"):
    WorkdirLock(wd, stale_s=30).acquire()
  deadline = time.monotonic() + 10  # heartbeats (every 0.2 s) rewrite the object
  while json.loads(fileio.read_text(lock_path))["heartbeat"] == record["heartbeat"]:
    assert time.monotonic() < deadline, "no heartbeat rewrote the lock in 10 s"
    time.sleep(0.05)
  assert json.loads(fileio.read_text(lock_path))["heartbeat"] > record["heartbeat"]
  first.check()
  # Deleted under the live run: its heartbeat notices; a second run then creates its own,
  # and the first names that run (not only the deletion its heartbeat saw).
  fileio.remove(lock_path)
  first._thread.join(timeout=10)
  assert not first._thread.is_alive() and first._lost == "was deleted"
  with pytest.raises(WorkdirInUseError, match="of this run was deleted while it ran"):
    first.check()
  second = WorkdirLock(wd, heartbeat_s=0.2, stale_s=1).acquire()
  assert second.previous is None
  time.sleep(0.5)
  with pytest.raises(WorkdirInUseError, match=f"of this run was taken by PID {os.getpid()}"):
    first.check()
  first.release()  # not its lock: left alone
  second.check()
  # The second run dies without releasing (its heartbeats stop): stale after 1 s.
  second._stop.set()
  second._thread.join()
  time.sleep(1.5)
  with caplog.at_level("WARNING"):
    third = WorkdirLock(wd, stale_s=1).acquire()
  assert third.previous["run"] == second.record["run"] and third.previous["gone"]
  assert f"took over the workdir lock of PID {os.getpid()} on host " in caplog.text
  assert "cannot be checked from here" in caplog.text and "no longer running" not in caplog.text
  third.release()
  assert not fileio.exists(lock_path)


def _unfinished(workdir, step, owner, remote):
  """What a save of `step` interrupted by `owner` ({'pid', 'host', 'run'} or None) leaves."""
  name = str(step) if remote else f"{step}.orbax-checkpoint-tmp-1700000000"
  fileio.write_bytes_atomic(fileio.join(workdir, "checkpoints", name, "model", "x"), b"x")
  if owner is not None:
    fileio.write_text_atomic(fileio.join(workdir, OWNERS_DIR, f"{step}.json"), json.dumps(owner))


@pytest.mark.parametrize("remote", [False, True], ids=["local", "gs"])
def test_startup_deletes_only_saves_whose_writer_has_ended(remote, request, tmp_path, caplog):
  wd = f"{request.getfixturevalue('gcs_bucket')}/cleanup" if remote else str(tmp_path)
  dead = subprocess.Popen(["true"])
  dead.wait()
  host = socket.gethostname()
  _unfinished(wd, 3, {"pid": dead.pid, "host": host, "run": "dead"}, remote)
  _unfinished(wd, 4, {"pid": os.getpid(), "host": host, "run": "alive"}, remote)
  _unfinished(wd, 5, {"pid": 1, "host": "elsewhere", "run": "other-host"}, remote)
  _unfinished(wd, 6, None, remote)
  lock = WorkdirLock(wd).acquire()
  try:
    with caplog.at_level("WARNING"):
      ckpt = Checkpointer(wd, lock=lock)
    ckpt.close()
  finally:
    lock.release()
  left = [s for s, _ in unfinished_steps(wd)]
  assert left == [4, 5, 6]
  assert "which may still be running" in caplog.text
  assert "of a run that recorded no owner" in caplog.text
  # Without the lock nothing is deleted.
  ckpt = Checkpointer(wd)
  ckpt.close()
  assert [s for s, _ in unfinished_steps(wd)] == [4, 5, 6]


@pytest.mark.slow
def test_run_whose_lock_file_was_replaced_stops_in_one_line(tmp_path, shared_data_cache):
  """The real command: its `.lock` deleted, and another run's created, under it; at its
  next save it stops (exit 2, one line) and writes no checkpoint after."""
  wd = tmp_path / "wd"
  cache = shared_data_cache
  proc = start_and_wait_for_checkpoint(
    main_cmd(
      wd, cache, LONG_RUN_STEPS, "--config.checkpoint_every_steps=1", "--config.log_every_steps=100"
    ),
    wd,
  )
  (wd / ".lock").unlink()
  other = WorkdirLock(str(wd)).acquire()  # what a second run does first
  try:
    _, err = proc.communicate(timeout=120)
    proc.stderr = err
    before = finalized_steps(str(wd))
    assert_one_line_error(proc, "was deleted and created again", "stopped without writing more")
    time.sleep(0.5)
    assert finalized_steps(str(wd)) == before
    assert (wd / ".lock").read_text() == json.dumps(other.record) + "\n"  # not cleared
  finally:
    other.release()
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)


def _tree(wd) -> list:
  """Every file under `wd`, relative ('/'-separated), with the workdir's own entries."""
  return fileio.walk_files(wd)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "gs"])
def test_a_failed_start_leaves_nothing_it_created(remote, request, tmp_path, caplog):
  """What a start writes before its first step (the data cache, tokenizer, config,
  TensorBoard directory, an empty checkpoints/) goes again when it fails there, with the
  lock file and a workdir it created; what was there before stays, and so does all of a
  run that got to its first step or wrote a checkpoint, or that ended without an error."""
  base = f"{request.getfixturevalue('gcs_bucket')}/failed-start" if remote else str(tmp_path)

  def start(wd, *, step=False, checkpoint=False, failed=True):
    lock = WorkdirLock(wd).acquire()
    for name in ("data_cache/prepared/local-1/train.array_record", "tokenizer.model"):
      fileio.write_text_atomic(fileio.join(wd, name), "x")
    fileio.write_text_atomic(fileio.join(wd, "tensorboard", "events.out"), "x")
    fileio.makedirs(fileio.join(wd, CHECKPOINTS))  # as orbax's manager makes it
    if checkpoint:
      fileio.write_text_atomic(fileio.join(wd, CHECKPOINTS, "2", "model", "x"), "x")
    if step:
      lock.mark_started()
    with caplog.at_level("INFO", logger="absl"):  # whatever verbosity an earlier test left
      lock.release(failed_start=failed)

  fresh = fileio.join(base, "fresh")
  start(fresh)
  assert not fileio.exists(fresh) and _tree(fresh) == []
  assert "removed what it had created in" in caplog.text and "data_cache" in caplog.text

  # A workdir that held a file, a data cache and an emptied lock of an earlier run.
  old = fileio.join(base, "old")
  fileio.write_text_atomic(fileio.join(old, "notes.txt"), "mine")
  fileio.write_text_atomic(fileio.join(old, "data_cache", "kept"), "mine")
  if not remote:  # (on gs:// a released lock is deleted, not emptied)
    fileio.write_text_atomic(fileio.join(old, LOCK_FILE), "")
  before = _tree(old)
  start(old)
  # New files inside an entry that was there (data_cache/prepared) are not told apart.
  assert _tree(old) == sorted(before + ["data_cache/prepared/local-1/train.array_record"])
  assert fileio.read_text(fileio.join(old, "notes.txt")) == "mine"

  for kept in (dict(step=True), dict(checkpoint=True), dict(failed=False)):
    wd = fileio.join(base, "kept-" + "-".join(kept))
    start(wd, **kept)
    assert {"data_cache", "tokenizer.model", "tensorboard"} <= set(fileio.listdir(wd)), kept


def test_the_lock_names_the_checkpoint_directory_the_checkpointer_writes():
  assert CHECKPOINTS == CHECKPOINT_DIR
