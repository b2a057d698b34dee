"""How every command reads its flags: absl, with each mistake a one-line UserError.

    from odetransformer import cli_flags, errors
    if __name__ == "__main__":
      cli_flags.run_absl_tool(main, define_flags)  # a tool on absl's global FLAGS
      errors.run_cli(main)  # a command whose main(argv) calls cli_flags.parse_flags

The tools read absl's global FLAGS through `run_absl_tool` (as main.py does through
`parse_absl_flags`); the analysis tools and benchmarks through `parse_flags`, which
defines them in a FlagValues of their own so that several commands run in one process
(the tests) without their flags meeting. Either way a bad flag, a missing required one,
an unknown `--config.*` key or a config file that does not load is a `errors.UserError`
that names the fix, and a renamed flag (`RENAMED_FLAGS`) still parses for one release.
"""

import ast
from collections.abc import Callable, Sequence
import logging
import re
import sys
import types

from absl import app, flags

from odetransformer import errors

# The flags `definer` defines belong to the module that calls it (their help groups them
# so), not to this one.
flags.disclaim_key_flags()

# Command-line flags renamed in a release: old name -> new. The old name still parses for
# one release, with one warning line (`renamed_flags`).
RENAMED_FLAGS = {"num_steps": "solver_steps"}


def run_absl_tool(main: Callable, define_flags: Callable[[], object]) -> None:
  """A command's `if __name__ == "__main__":` body: defines its absl flags, parses them
  (`parse_absl_flags`) and runs `main` through `errors.run_cli`."""
  define_flags()
  errors.run_cli(lambda: app.run(main, flags_parser=parse_absl_flags))


def definer(flag_values: flags.FlagValues) -> Callable:
  """`define(kind, name, default, help, **kw)`: defines one absl flag in `flag_values`;
  `kind` names absl's DEFINE_<kind> ('string', 'integer', 'float', 'bool', 'enum' with
  `enum_values=`, ...), `kw` is passed on (`lower_bound=`, `required=`)."""

  def define(kind: str, name: str, default, text: str, **kw):
    return getattr(flags, f"DEFINE_{kind}")(
      name=name, default=default, help=text, flag_values=flag_values, **kw
    )

  return define


def parse_flags(
  define_flags: Callable[[Callable], object], argv: Sequence[str] | None = None, doc: str = ""
):
  """A command's flags parsed from `argv` (its arguments, without the program name;
  default `sys.argv[1:]`) into a FlagValues of its own, as a namespace of their values.

  `define_flags(define)` defines them (`define` as `definer` returns); `--verbose` is
  added when it does not. A bad flag, a missing required one and a stray positional
  argument are UserErrors (one line through `run_cli`); `--help` prints the flags (after
  `doc`) and exits 0.
  """
  fv = flags.FlagValues()
  define = definer(fv)
  define_flags(define)
  if "verbose" not in fv:
    define("bool", "verbose", False, "Show the traceback of a user error as well.")
  args = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("--help", "-help", "--helpshort", "-h") for a in args):
    print((doc.strip() + "\n\n" if doc.strip() else "") + fv.get_help())
    sys.exit(0)
  rest = parse_absl_flags([sys.argv[0] if argv is None else "command", *args], fv)
  if len(rest) > 1:
    raise errors.UserError(f"unexpected arguments {rest[1:]}; flags take the form --name=value")
  return types.SimpleNamespace(**fv.flag_values_dict())


def _unknown_override(argv: Sequence[str], key: str) -> str:
  """The `--<config>.a.b=value` arguments of `argv` whose path holds `key`."""
  found = [a for a in argv[1:] if a.startswith("--") and key in a.split("=")[0].split(".")[1:]]
  return ", ".join(found) or "a --config.* override"


def renamed_flags(argv: Sequence[str], known) -> list:
  """`argv` with each old flag name of `RENAMED_FLAGS` whose new name is in `known` (the
  command's flag names) and whose old one is not rewritten to the new one, with a
  warning line."""
  out = list(argv)
  for i, arg in enumerate(out):
    for old, new in RENAMED_FLAGS.items():
      if new in known and old not in known and arg.split("=")[0] == f"--{old}":
        logging.warning(
          "--%s is deprecated and will be removed in the next release: use --%s", old, new
        )
        out[i] = f"--{new}" + arg[len(old) + 2 :]
  return out


def parse_absl_flags(argv: list, flag_values: flags.FlagValues | None = None) -> list:
  """absl's flag parsing (into `flag_values`, default absl's global FLAGS) with its
  errors, and config files' ones, as UserErrors; returns the arguments left.

  For `app.run(main, flags_parser=parse_absl_flags)`. An ml_collections config flag
  loads its file while the flags are parsed, so a missing file, a syntax error in it
  or an override of a key the config lacks surface here.
  """
  fv = flags.FLAGS if flag_values is None else flag_values
  try:
    return fv(renamed_flags(argv, fv))
  except flags.Error as e:
    missing = re.search(r"Flag --(\w+) must have a value other than None", str(e))
    if missing:
      raise errors.UserError(
        f"--{missing.group(1)} is required; pass --{missing.group(1)}=<value> "
        "(--helpshort lists the flags)"
      ) from e
    raise errors.UserError(f"{errors.one_line(e)}; see --helpshort for the flags") from e
  except SyntaxError as e:
    raise errors.UserError(
      f"config file {e.filename} line {e.lineno} has a syntax error ({e.msg}); fix the file"
    ) from e
  except (AttributeError, KeyError) as e:
    raise errors.UserError(_unknown_key_message(e, argv)) from e
  except OSError as e:
    raise errors.UserError(
      f"the config file does not load ({_first_line(e)}); pass an "
      "existing --config=configs/<name>.py"
    ) from e
  except (TypeError, ValueError) as e:
    raise errors.UserError(
      f"the config does not load ({_first_line(e, last=True)}); fix the "
      "config file or the --config.* override"
    ) from e


def _unknown_key_message(e: BaseException, argv: Sequence[str]) -> str:
  """An override of a key the config lacks, from ml_collections' KeyError (whose text is
  `'key'` plus, on a second line, `Did you mean "keys" instead of "key"?`)."""
  text = str(e.args[0]) if e.args else str(e)
  while text[:1] in ("'", '"'):  # a KeyError's text is the repr of its message (twice
    try:  # when an AttributeError wraps it)
      text = str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
      break
  first, _, rest = text.partition("\n")
  key = first.strip().strip("\"'")
  where = _unknown_override(argv, key)
  suggestion = re.search(r'Did you mean "([^"]+)"', rest)
  if suggestion and where.startswith("--") and "," not in where:
    flag = where.split("=")[0]
    fix = f"did you mean {flag[: flag.rindex(key)]}{suggestion.group(1)}?"
  elif suggestion:
    fix = f"did you mean {suggestion.group(1)!r}?"
  else:
    fix = "fix its spelling (the config file lists every key)"
  return f"unknown config key {key!r} in {where}; {fix}"


def _first_line(e: BaseException, last: bool = False) -> str:
  """A multi-line library message as one line: its first (or last) non-empty line,
  plus the file it names when it says which."""
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  if not lines:
    return type(e).__name__
  detail = [l for l in lines if "Errno" in l]
  return errors.one_line(detail[-1] if detail else lines[-1] if last else lines[0])


def load_config_flag(config_flag) -> object:
  """`config_flag.value` (an ml_collections config flag), a failed load as a UserError.

  A config file that does not exist loads lazily: the error comes at first access.
  """
  try:
    config = config_flag.value
    config.get("seed")  # an unloadable file raises on first access
    return config
  except OSError as e:
    raise errors.UserError(
      f"the config file does not load ({_first_line(e)}); pass an "
      "existing --config=configs/<name>.py"
    ) from e
