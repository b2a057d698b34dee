"""Tokenizer worker processes die with the process that started them.

grain 0.2.18 starts `data.worker_count` worker processes (multiprocessing 'spawn') and
stops them when the iterator is closed or garbage-collected; a parent killed by SIGKILL,
the OOM killer or a node agent never gets there, and its workers would live on (each
holding a tokenizer and its buffers). grain has no option for this, so each worker
runs `exit_with_parent`'s watcher from its init function.

Not `prctl(PR_SET_PDEATHSIG)`: Linux sends that signal when the *thread* that created
the child exits, and grain starts workers from its short-lived prefetch threads, so it
would kill healthy workers. The watcher checks instead whether the worker has been
re-parented (its parent process gone), a few times a second, and then kills the worker.
"""

import functools
import os
import signal
import threading
import time

POLL_S = 0.2


def _watch(parent_pid: int) -> None:
  while os.getppid() == parent_pid:
    time.sleep(POLL_S)
  os.kill(os.getpid(), signal.SIGKILL)


def _start_watcher(parent_pid: int, worker_index: int, worker_count: int) -> None:
  del worker_index, worker_count
  threading.Thread(target=_watch, args=(parent_pid,), name="exit-with-parent", daemon=True).start()


def exit_with_parent(parent_pid: int):
  """A grain `worker_init_fn`: the worker kills itself once `parent_pid` has exited."""
  return functools.partial(_start_watcher, parent_pid)
