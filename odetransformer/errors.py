"""The user's mistakes: one exception base, reported in one line by every entry point.

`UserError` is raised wherever a user's input is at fault — a flag, a config value or
file, a data file, a workdir — with a message that names the problem and the fix.
Every command (main.py, evaluate, generate, export, memory, lm_eval, the analysis tools)
runs its main function through `run_cli`, the one place that turns a UserError into

    error: <what is wrong>; <what to do>

on stderr and exit status 2 (`describe`: no class name; a config value's error that
names no fix gets where to change it). `--verbose` on the command line shows the traceback
instead. Anything else is a bug and keeps its traceback. The exit statuses every command
shares are here too (`EXIT_USER_ERROR`, `EXIT_STOPPED_EARLY`, `EXIT_INTERRUPTED`).

How a command reads its flags (and turns a bad one into a UserError):
`odetransformer/cli_flags.py`.
"""

from collections.abc import Callable, Sequence
import logging
import os
import re
import sys
import traceback

EXIT_USER_ERROR = 2
# A run that SIGTERM or Ctrl-C stopped after saving a checkpoint: not finished, and the
# same command resumes it (sysexits.h's EX_TEMPFAIL, "try again later"), told apart from a
# finished run (0) by a scheduler or a babysitting loop.
EXIT_STOPPED_EARLY = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


class UserError(Exception):
  """Bad input from the user; the message names the problem and the fix.

  Subclasses exist only where callers (or tests) match on a narrower type; they add
  no behaviour.
  """


class ConfigError(UserError, ValueError):
  """A config value that cannot work, or values that cannot work together."""


def one_line(text) -> str:
  """`text` with every run of whitespace (newlines included) as one space."""
  return " ".join(str(text).split())


# A message about one config value: `<dotted.key>=<value> …`.
_CONFIG_VALUE = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)=\S")


def describe(e: BaseException) -> str:
  """The error line's text, `<what>; <what to do>`, in one line (a subclass's name is for
  code that catches it, not for the user). A ConfigError that names one value and no fix
  (`model.solver_steps=0 must be a positive integer`) gets where to change it."""
  message = one_line(e) or type(e).__name__
  value = _CONFIG_VALUE.match(message)
  if isinstance(e, ConfigError) and value and "; " not in message:
    message += f"; change --config.{value.group(1)} (or its line in the config file)"
  return message


def verbose_requested(argv: Sequence[str] | None = None) -> bool:
  """Whether the command line asks for tracebacks (`--verbose`, `--verbose=true`; the
  last of them and `--noverbose` wins).

  Read from argv itself so that it also works when parsing the flags is what failed.
  """
  verbose = False
  for arg in (sys.argv if argv is None else argv)[1:]:
    if arg == "--":
      break
    if arg in ("--verbose", "-verbose") or arg.lower() in ("--verbose=true", "--verbose=1"):
      verbose = True
    elif arg in ("--noverbose", "-noverbose") or arg.lower() in ("--verbose=false", "--verbose=0"):
      verbose = False
  return verbose


def run_cli(main: Callable[[], object], argv: Sequence[str] | None = None):
  """Runs an entry point: a UserError becomes one stderr line and exit status 2.

  `main` takes no arguments (wrap `app.run(...)` in a lambda; a main on `cli_flags.parse_flags`
  reads sys.argv itself).
  With `--verbose` in `argv` (default `sys.argv`) the traceback is printed as well.

  The process ends with `os._exit` once the streams are flushed: the error has passed
  every `finally` on its way here, and what is left may not end by itself — after a
  failed save orbax's signalling threads wait forever for signals that never come, and
  a normal exit joins them.
  """
  try:
    return main()
  except UserError as e:
    if verbose_requested(argv):
      traceback.print_exc()
    print(f"error: {describe(e)}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(EXIT_USER_ERROR)
  except KeyboardInterrupt:
    # Ctrl-C where no handler of ours saves anything (main.py's loop has one): stop
    # without a traceback.
    if verbose_requested(argv):
      traceback.print_exc()
    print("interrupted", file=sys.stderr, flush=True)
    sys.exit(EXIT_INTERRUPTED)
