"""Library log records and tracebacks a user should not have to read.

`quiet_library_logs` filters the absl logger: orbax's and TFDS's INFO lines, and the
tracebacks orbax logs for a failed background save. `quiet_orbax_tracebacks` also
drops, from `sys.excepthook` and `sys.unraisablehook`, the "Event loop is closed"
tracebacks that every read or write still pending prints after a failed save or
restore, and those of the reads a failed restore abandoned, whenever the garbage
collector closes them. `--verbose` on the command line keeps them all.
"""

import inspect
import logging as std_logging
import sys

from absl import logging as absl_logging

from odetransformer import errors

_CHATTY = ("/orbax/", "/tensorflow_datasets/")
# Orbax's WARNINGs that a checkpoint manager is read-only (and which options that turns
# off): every restore of ours opens it so on purpose (the tools, fine-tuning's
# init_from), so they tell the user nothing.
_NOTICES = ("Given directory is read only", "CheckpointManagerOptions.read_only=True")


class _LibraryLogs(std_logging.Filter):
  """The one filter on library log records (on the absl logger).

  Drops orbax and TFDS records below `min_level` (their INFO lines: dozens per
  checkpoint, and TFDS narrating the preparation of a local corpus file by file; tools
  that only read a checkpoint raise it to ERROR), and orbax's notices that a restore
  opened its directory read-only (`_NOTICES`) at any level. Orbax logs a failed
  background save with a traceback per thread; the CheckpointError that follows says it
  in one line: its error lines are kept, their tracebacks dropped (kept with --verbose).
  """

  def __init__(self, min_level: int):
    super().__init__()
    self.min_level = min_level

  def filter(self, record):
    if not any(lib in record.pathname for lib in _CHATTY):
      return True
    if str(record.msg).startswith(_NOTICES):
      return False
    if record.levelno >= std_logging.ERROR and "/orbax/" in record.pathname:
      if not errors.verbose_requested():
        record.exc_info, record.exc_text = None, None
    return record.levelno >= self.min_level


def quiet_library_logs(min_level: int | None = None) -> None:
  """Installs the library log filter once; `min_level` (default WARNING when installing)
  sets the lowest level of orbax and TFDS records shown."""
  std_logging.getLogger("gcsfs").setLevel(std_logging.WARNING)  # INFO: a line per file read
  logger = std_logging.getLogger("absl")
  found = [f for f in logger.filters if isinstance(f, _LibraryLogs)]
  if found:
    if min_level is not None:
      found[0].min_level = min_level
    return
  logger.addFilter(_LibraryLogs(std_logging.WARNING if min_level is None else min_level))


def quiet_tool_logs(cli: bool = False) -> None:
  """For the tools that only read a checkpoint (evaluate, generate, export, lm_eval, the
  benchmarks that score a run): orbax's and TFDS's records below ERROR hidden (a
  restore's notices are not the user's business); for a command line (`cli`), absl's
  INFO lines of other libraries too."""
  if cli and absl_logging.get_verbosity() >= absl_logging.INFO:
    absl_logging.set_verbosity(absl_logging.WARNING)
  quiet_library_logs(std_logging.ERROR)


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


def _abandoned_orbax_read(args) -> bool:
  """An orbax coroutine closed by the garbage collector (GeneratorExit) that raised
  instead: what each array read a failed restore abandoned (a corrupt checkpoint, the
  previous one read instead) prints, with its TensorStore spec, at whatever later
  moment the collector runs; the failure itself is reported once, elsewhere."""
  obj = args.object
  return (
    inspect.iscoroutine(obj)
    and "/orbax/" in obj.cr_code.co_filename
    and isinstance(getattr(args.exc_value, "__cause__", None), GeneratorExit)
  )


def quiet_orbax_tracebacks():
  """Orbax's tracebacks of a failed save or restore as single lines (not with
  --verbose); installed once."""
  quiet_library_logs()
  hook = sys.excepthook
  if getattr(hook, "_odet_quiet", False) or errors.verbose_requested():
    return

  def excepthook(exc_type, exc, tb):
    if not _closed_loop_callback(exc_type, exc, tb):
      hook(exc_type, exc, tb)

  excepthook._odet_quiet = True
  sys.excepthook = excepthook
  unraisable = sys.unraisablehook

  def unraisablehook(args):
    closed_loop = _closed_loop_callback(args.exc_type, args.exc_value, args.exc_traceback)
    if not closed_loop and not _abandoned_orbax_read(args):
      unraisable(args)

  sys.unraisablehook = unraisablehook
