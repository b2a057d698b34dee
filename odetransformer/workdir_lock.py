"""One training process per workdir: an advisory lock on `<workdir>/.lock`.

Two runs writing checkpoints into one directory would overwrite each other's steps; a
second run therefore stops at once with a UserError that names the PID and host of the
run holding the workdir. The lock is `fcntl.flock` on the file, which the kernel drops
when its holder dies however it dies, so a lock left by a killed run is not in the way:
the next run takes it over and says so (a warning naming the dead holder, whose PID and
host are still in the file). A run that ends normally empties the file; one that
created the workdir and wrote nothing else into it (it stopped at a data error) removes
the file and the directory again.

Multi-host runs take it on process 0 only (the others write nothing but their shards
of checkpoints, which process 0 coordinates). On a filesystem without flock support
(some network mounts) the lock is skipped with a warning.
"""
import errno
import fcntl
import json
import os
import socket
import time
from typing import Optional

from absl import logging

from odetransformer.errors import UserError

LOCK_FILE = ".lock"


class WorkdirInUseError(UserError):
  """Another live process holds the workdir."""


def _describe(holder: dict) -> str:
  if not holder:
    return "another process (it is still starting, so its PID is not written yet)"
  started = holder.get("started")
  when = (f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
          if isinstance(started, (int, float)) else "")
  return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"


def _read_holder(fd: int) -> dict:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", "replace").strip()
    return json.loads(text) if text else {}
  except (OSError, ValueError):
    return {}


class WorkdirLock:
  """Holds `<workdir>/.lock` from `acquire()` to `release()` (or process exit).

  Args:
    workdir: the run's directory; created if absent (after the config was validated:
      acquiring is the first write of a run).
    enabled: False on processes other than 0 of a multi-host run.
  """

  def __init__(self, workdir: str, enabled: bool = True):
    self.workdir = os.fspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILE)
    self.enabled = enabled
    self._fd: Optional[int] = None
    self._created_dir = False

  def acquire(self) -> "WorkdirLock":
    """Takes the lock or raises a one-line UserError (in use, not a directory, not
    writable). Never blocks."""
    if not self.enabled:
      return self
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise UserError(f"--workdir={self.workdir} is a file, not a directory; pass a "
                      "directory (new or of an earlier run)")
    try:
      self._created_dir = not os.path.exists(self.workdir)
      os.makedirs(self.workdir, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise UserError(f"--workdir={self.workdir} is not writable ({e.strerror}); pass a "
                      "directory this user can write to") from e
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read_holder(fd)
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise WorkdirInUseError(
            f"--workdir={self.workdir} is in use by {_describe(holder)}; wait for that "
            f"run to end or stop it, or pass another --workdir") from e
      logging.warning("cannot lock %s (%s): two runs on this workdir would not be "
                      "stopped", self.path, e.strerror)
      return self
    previous = _read_holder(fd)
    if previous:
      logging.warning("took over the workdir lock of %s, which is no longer running "
                      "(it ended without releasing it)", _describe(previous))
    self._fd = fd
    self._write({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
    return self

  def _write(self, holder: Optional[dict]):
    os.ftruncate(self._fd, 0)
    if holder:
      os.pwrite(self._fd, (json.dumps(holder) + "\n").encode(), 0)

  def release(self):
    """Empties the file (a clean end: the next run sees no previous holder), unlocks."""
    if self._fd is None:
      return
    try:
      self._write(None)
      if self._created_dir and os.listdir(self.workdir) == [LOCK_FILE]:
        os.remove(self.path)
        os.rmdir(self.workdir)
    except OSError:
      pass   # e.g. the directory was removed: nothing left to tidy
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
