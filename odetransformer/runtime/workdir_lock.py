"""One training process per workdir: a lock at `<workdir>/.lock`.

Two runs writing checkpoints into one directory would overwrite each other's steps; a
second run therefore stops at once with a UserError that names the PID and host of the
run holding the workdir. The lock holds its owner's record: host, PID, start time and a
run id of its own, so that a run can tell its lock from another's.

Local paths: `fcntl.flock` on the file, which the kernel drops when its holder dies
however it dies, so a lock left by a killed run is not in the way: the next run takes it
over with a warning naming the former holder (whose record is still in the file). A run
that ends normally empties the file; one that created the workdir and wrote nothing else
into it (it stopped at a data error) removes the file and the directory again. On a
filesystem without flock support (some network mounts) the lock is skipped with a
warning.

A failed start leaves nothing behind that it created: a run that ends on an error before
its first train step (`mark_started`) and wrote no checkpoint tells `release` so
(`failed_start=True`), which removes what the run added to the workdir since it took the
lock (its data cache, tokenizer, config.json, TensorBoard directory), the lock file if the
run created it, and the workdir if the run created it. What the workdir held before is
never touched; a run that got to its first step keeps everything (its logs say how it
failed).

Object stores (`gs://`): flock means nothing there. The lock is the object `.lock`,
created only if absent (a generation precondition), holding the same record plus a
heartbeat that a daemon thread rewrites every `heartbeat_s` seconds, each time only if
the object is still the one this run wrote last. A lock whose object was not rewritten
for `stale_s` seconds is taken over with a warning that says what is known: the holder's
host and PID and how old its last heartbeat is (whether a process on another host still
runs cannot be checked from here). A run that ends normally deletes its object.

Either way a run never goes on writing into a workdir whose lock it did not create: a
lock file deleted or replaced under a live run (another run then created its own) is
noticed at the next heartbeat or checkpoint (`check`), and the run stops in one line.

Multi-host runs take it on process 0 only (the others write nothing but their shards
of checkpoints, which process 0 coordinates).
"""

import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid

from absl import logging

from odetransformer.errors import UserError
from odetransformer.runtime import fileio

LOCK_FILE = ".lock"
# The run's checkpoints (train/checkpoint/paths.CHECKPOINT_DIR): a run that added anything
# there keeps all it wrote, whatever `release` is told.
CHECKPOINTS = "checkpoints"
HEARTBEAT_S = 60.0  # how often a remote lock's heartbeat is rewritten
STALE_S = 600.0  # a remote lock without a heartbeat for this long is taken over


class WorkdirInUseError(UserError):
  """Another live process holds the workdir (or took it from this run)."""


def _describe(holder: dict) -> str:
  if not holder:
    return "another process (it is still starting, so its PID is not written yet)"
  started = holder.get("started")
  when = (
    f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
    if isinstance(started, (int, float))
    else ""
  )
  return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"


def _parse(data: bytes) -> dict:
  try:
    text = data.decode("utf-8", "replace").strip()
    record = json.loads(text) if text else {}
    return record if isinstance(record, dict) else {}
  except ValueError:
    return {}


def pid_gone(record: dict) -> bool:
  """True when `record` names a process of this host that no longer exists. A process
  on another host cannot be checked: False."""
  if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
    return False
  try:
    os.kill(record["pid"], 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    return False  # it exists, as another user's
  return False


class WorkdirLock:
  """Holds `<workdir>/.lock` from `acquire()` to `release()` (or process exit).

  Args:
    workdir: the run's directory (local or a URL); created if absent (after the config
      was validated: acquiring is the first write of a run).
    enabled: False on processes other than 0 of a multi-host run.
    heartbeat_s, stale_s: for object-store locks (see the module docstring).

  After `acquire`: `record` is this run's record (None when disabled or skipped) and
  `previous` the record of a former holder whose lock this run took over (None when it
  found no holder), with `gone`: whether that holder is known to have ended (a PID of
  this host that no longer exists, or a stale heartbeat). `started`: whether the run
  reported its first train step (`mark_started`); until then `release(failed_start=True)`
  removes what the run created.
  """

  def __init__(
    self,
    workdir: str,
    enabled: bool = True,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    stale_s: float = STALE_S,
  ):
    self.workdir = os.fspath(workdir)
    self.path = fileio.join(self.workdir, LOCK_FILE)
    self.enabled = enabled
    self.heartbeat_s, self.stale_s = float(heartbeat_s), float(stale_s)
    self.record: dict | None = None
    self.previous: dict | None = None
    self._fd: int | None = None
    self._created_dir = False
    self._blob = None
    self._generation = None
    self._lost = ""  # why the lock is no longer this run's
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.started = False
    self._found: set | None = None  # the workdir's entries before acquire (None: unknown)
    self._found_checkpoints: set = set()

  def acquire(self) -> "WorkdirLock":
    """Takes the lock or raises a one-line UserError (in use, not a directory, not
    writable). Never blocks."""
    if not self.enabled:
      return self
    record = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": time.time(),
      "run": uuid.uuid4().hex,
    }
    self._found, self._found_checkpoints = self._entries(), self._checkpoint_entries()
    if fileio.is_local(self.workdir):
      self._acquire_flock(record)
    else:
      self._acquire_object(record)
    return self

  def mark_started(self):
    """The run's first train step is done: from now on a failure keeps what it wrote."""
    self.started = True

  # -- what a failed start created ------------------------------------------------------
  def _entries(self) -> set | None:
    """The names in the workdir ({} when it does not exist; None when it cannot be
    listed: then nothing is ever removed)."""
    try:
      return set(fileio.listdir(self.workdir))
    except Exception:  # not a directory, no access: acquire reports it
      return None

  def _checkpoint_entries(self) -> set:
    try:
      return set(fileio.listdir(fileio.join(self.workdir, CHECKPOINTS)))
    except Exception:
      return set()

  def _remove_created(self) -> list:
    """Removes the workdir's entries that were not there when the lock was taken (the
    lock file aside: `release` handles it); returns their names."""
    created = sorted(set(fileio.listdir(self.workdir)) - self._found - {LOCK_FILE})
    for name in created:
      entry = fileio.join(self.workdir, name)
      try:
        if fileio.isdir(entry):
          fileio.rmtree(entry)
        else:
          fileio.remove(entry)
      except Exception as e:
        logging.warning("cannot remove %s, which the failed start created (%s)", entry, e)
    return created

  # -- local: flock ---------------------------------------------------------------------
  def _acquire_flock(self, record: dict):
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise UserError(
        f"--workdir={self.workdir} is a file, not a directory; pass a "
        "directory (new or of an earlier run)"
      )
    try:
      self._created_dir = not os.path.exists(self.workdir)
      os.makedirs(self.workdir, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise UserError(
        f"--workdir={self.workdir} is not writable ({e.strerror}); pass a "
        "directory this user can write to"
      ) from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _parse(os.pread(fd, 4096, 0))
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise WorkdirInUseError(
          f"--workdir={self.workdir} is in use by {_describe(holder)}; wait for that "
          f"run to end or stop it, or pass another --workdir"
        ) from e
      logging.warning(
        "cannot lock %s (%s): two runs on this workdir would not be stopped", self.path, e.strerror
      )
      return
    previous = _parse(os.pread(fd, 4096, 0))
    if previous:
      known = (
        "that process is not running"
        if pid_gone(previous)
        else "it released the lock without clearing it, or holds it on another host "
        "where this filesystem's locks do not reach (a process there cannot be "
        "checked from here): if it still runs, stop one of the two"
      )
      logging.warning("took over the workdir lock of %s: %s", _describe(previous), known)
      self.previous = dict(previous, gone=pid_gone(previous))
    self._fd = fd
    self.record = record
    self._write_fd(record)

  def _write_fd(self, record: dict | None):
    os.ftruncate(self._fd, 0)
    if record:
      os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)

  def _check_flock(self) -> str:
    try:
      same = os.path.samestat(os.fstat(self._fd), os.stat(self.path))
      now = _parse(fileio.read_bytes(self.path)) if same else {}
    except OSError:
      return "was deleted"
    if not same:
      return "was deleted and created again"
    if now.get("run") != self.record["run"]:
      return f"was overwritten by {_describe(now)}"
    return ""

  # -- object store: create-if-absent and heartbeats ------------------------------------
  def _acquire_object(self, record: dict):
    from google.api_core import exceptions  # lazy: google-cloud only for a gs:// workdir

    try:
      self._blob = fileio.gcs_blob(self.path)
      try:
        self._put(record, if_generation_match=0)
      except exceptions.PreconditionFailed:
        self._take_over_if_stale(record)
    except WorkdirInUseError:
      raise
    except Exception as e:
      raise UserError(
        f"cannot create the workdir lock {self.path} ({type(e).__name__}: "
        f"{' '.join(str(e).split())[:200]}); check the bucket's name and this "
        "machine's access to it, or pass another --workdir"
      ) from e
    self.record = record
    self._thread = threading.Thread(target=self._beat, name="workdir-lock-heartbeat", daemon=True)
    self._thread.start()

  def _put(self, record: dict, if_generation_match: int):
    record = dict(record, heartbeat=time.time())
    self._blob.upload_from_string(
      json.dumps(record) + "\n",
      content_type="application/json",
      if_generation_match=if_generation_match,
    )
    self._generation = self._blob.generation

  def _take_over_if_stale(self, record: dict):
    from google.api_core import exceptions  # lazy: google-cloud only for a gs:// workdir

    blob = self._blob.bucket.get_blob(self._blob.name)
    if blob is None:  # released meanwhile: create it afresh
      self._put(record, if_generation_match=0)
      return
    holder = _parse(blob.download_as_bytes(if_generation_match=blob.generation))
    age = time.time() - blob.updated.timestamp()
    if age < self.stale_s:
      raise WorkdirInUseError(
        f"--workdir={self.workdir} is in use by {_describe(holder)} (last heartbeat "
        f"{age:.0f} s ago); wait for that run to end or stop it, or pass another "
        "--workdir"
      )
    try:
      self._put(record, if_generation_match=blob.generation)
    except exceptions.PreconditionFailed as e:
      raise WorkdirInUseError(
        f"--workdir={self.workdir} was just taken by another run; pass another --workdir"
      ) from e
    logging.warning(
      "took over the workdir lock of %s: its last heartbeat is %.0f s old (a lock counts "
      "as stale after %.0f s); whether that process still runs cannot be checked from "
      "here: if it does, stop it",
      _describe(holder),
      age,
      self.stale_s,
    )
    self.previous = dict(holder, gone=True)  # as far as can be known: stale

  def _beat(self):
    from google.api_core import exceptions  # lazy: google-cloud only for a gs:// workdir

    warned = False
    while not self._stop.wait(self.heartbeat_s):
      try:
        self._put(self.record, if_generation_match=self._generation)
      except (exceptions.PreconditionFailed, exceptions.NotFound):
        self._lost = self._check_object() or "was replaced"
        return
      except Exception as e:
        if not warned:
          logging.warning(
            "cannot renew the workdir lock %s (%s); retrying", self.path, type(e).__name__
          )
          warned = True

  def _check_object(self) -> str:
    blob = self._blob.bucket.get_blob(self._blob.name)
    if blob is None:
      return "was deleted"
    if blob.generation != self._generation:
      holder = _parse(blob.download_as_bytes())
      if holder.get("run") != self.record["run"]:
        return f"was taken by {_describe(holder)}"
    return ""

  # -- both -----------------------------------------------------------------------------
  def check(self):
    """WorkdirInUseError (one line) when the lock is no longer this run's (deleted,
    replaced by another run's): the run must not write more into the workdir."""
    if self.record is None:
      return
    if self._fd is not None:
      lost = self._lost or self._check_flock()
    elif not self._lost:
      lost = self._check_object()
    else:  # the object now: the heartbeat that found it gone may not have seen who took it
      try:
        lost = self._check_object() or self._lost
      except Exception:  # noqa: BLE001 (lost either way; keep what the heartbeat saw)
        lost = self._lost
    if lost:
      self._lost = lost
      raise WorkdirInUseError(
        f"the lock {self.path} of this run {lost} while it ran: another run may be "
        "writing this workdir, so this one stopped without writing more; stop the other "
        "run or let it finish, then resume with the same command"
      )

  def release(self, failed_start: bool = False):
    """Clears the lock if it is still this run's (the next run sees no previous holder).

    `failed_start`: the run is ending on an error. Unless it reached its first train
    step (`mark_started`) or added a checkpoint, what it created since `acquire` is
    removed (module docstring): its new entries in the workdir, the lock file it created,
    and the workdir it created. Nothing that was there before.
    """
    clean = (
      failed_start
      and not self.started
      and self.record is not None
      and self._found is not None
      and self._checkpoint_entries() <= self._found_checkpoints
    )
    if clean:
      try:
        self._lost = self._lost or (
          self._check_flock() if self._fd is not None else self._check_object()
        )
      except Exception as e:  # cannot tell whether the workdir is still this run's
        self._lost = self._lost or f"cannot be checked ({type(e).__name__})"
      clean = not self._lost
    if clean:
      removed = self._remove_created()
      logging.info(
        "the run failed before its first step: removed what it had created in %s (%s)",
        self.workdir,
        ", ".join(removed + ([] if LOCK_FILE in self._found else [LOCK_FILE])) or "nothing",
      )
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._blob is not None and self.record is not None:
      try:
        if not self._lost:
          self._blob.delete(if_generation_match=self._generation)
      except Exception:
        pass  # taken over or gone: it is not this run's to delete
      self.record = None
    if self._fd is None:
      return
    try:
      if not self._check_flock():
        self._write_fd(None)
        if self._created_dir and os.listdir(self.workdir) == [LOCK_FILE]:
          os.remove(self.path)
          os.rmdir(self.workdir)
        elif clean and LOCK_FILE not in self._found:
          os.remove(self.path)
    except OSError:
      pass  # e.g. the directory was removed: nothing left to tidy
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None
    self.record = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
