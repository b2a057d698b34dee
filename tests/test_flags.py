"""One flag library: every command reads its flags with absl, the checkpoint-loading ones
from one definition (`loading.define_load_flags`), and a bad flag is one line.

The commands are found, not listed: every module of the repository with a `__main__`
block. Those on `cli_flags.parse_flags` (analysis, benchmarks) are run in this process, one
after another, which is what their own FlagValues allow; the tools on absl's global FLAGS
(main.py's style) parse into a fresh FlagValues of their own flags.
"""

import importlib
import pathlib
import re

from absl import flags
import pytest

from odetransformer import cli_flags, errors
from odetransformer.train import loading

ROOT = pathlib.Path(__file__).resolve().parents[1]
TREES = ("odetransformer", "input_pipeline", "benchmarks", "configs")


def sources():
  files = [ROOT / "main.py"]
  for tree in TREES:
    files += sorted((ROOT / tree).rglob("*.py"))
  return files


def module_name(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def commands():
  """(module name, source) of each module that runs as a program: one with a `__main__`
  block, and for a package run as `python -m PACKAGE` (its `__main__.py`), the `cli`
  module beside it that holds its command line."""
  out = []
  for p in sources():
    if p.name == "__main__.py" and p.with_name("cli.py").exists():
      out.append((module_name(p.with_name("cli.py")), p.with_name("cli.py").read_text()))
    elif p.name != "main.py" and re.search(r'^if __name__ == "__main__":', p.read_text(), re.M):
      out.append((module_name(p), p.read_text()))
  return out


PARSE_FLAGS = [name for name, text in commands() if "def define_flags(define)" in text]
TRAINER = "odetransformer.tools.train"
GLOBAL_FLAGS = [name for name, text in commands() if "\n  cli_flags.run_absl_tool(" in text]


def test_no_module_uses_argparse():
  users = [
    str(p.relative_to(ROOT))
    for p in sources()
    if re.search(r"^\s*(import argparse|from argparse )", p.read_text(), re.M)
  ]
  assert users == []


def test_every_command_is_on_absl():
  """Each program parses with parse_flags or absl's app, or has no flags of its own: the
  runpy shims, param_count's table, lm_eval (the harness's own command line). The
  trainer (main.py's code) defines its flags on absl's global FLAGS when imported and
  parses them with absl's app (tests/test_main_cli.py)."""
  flagless = {"odetransformer.model.param_count", "odetransformer.tools.lm_eval"}
  shims = {name for name, text in commands() if "runpy.run_module(" in text}
  others = {name for name, _ in commands()} - set(PARSE_FLAGS) - set(GLOBAL_FLAGS) - shims
  assert others == flagless | {TRAINER}
  assert "app.run(main, flags_parser=" in dict(commands())[TRAINER]
  assert len(PARSE_FLAGS) >= 14 and len(GLOBAL_FLAGS) >= 4  # analysis + benchmarks; tools


def test_loading_flags_have_one_definition():
  """--mesh_shape and --checkpoint_allow_unverified are defined in loading.py alone; every
  command that takes them calls define_load_flags."""
  shared = re.compile(
    r'(define|DEFINE_\w+)\(\s*("\w+",\s*)?"(mesh_shape|checkpoint_allow_unverified)"'
  )
  defining = [str(p.relative_to(ROOT)) for p in sources() if shared.search(p.read_text())]
  assert defining == ["odetransformer/train/loading.py"]
  fv = flags.FlagValues()
  loading.define_load_flags(cli_flags.definer(fv))
  assert set(fv) == {"workdir", "step", "mesh_shape", "checkpoint_allow_unverified", "verbose"}
  users = {name for name, text in commands() if "loading.define_load_flags(define)" in text}
  assert {
    "odetransformer.tools.evaluate",
    "odetransformer.tools.generate",
    "odetransformer.tools.export",
    "odetransformer.analysis.spectra",
    "odetransformer.analysis.lyapunov",
  } <= users


@pytest.mark.parametrize("name", PARSE_FLAGS)
def test_a_bad_flag_is_one_line(name, capsys):
  main = importlib.import_module(name).main
  with pytest.raises(errors.UserError) as e:
    main(["--no_such_flag=1"])
  assert errors.describe(e.value) == (
    "Unknown command line flag 'no_such_flag'; see --helpshort for the flags"
  )
  with pytest.raises(SystemExit) as e:
    main(["--help"])
  assert e.value.code == 0
  assert "--[no]verbose" in capsys.readouterr().out


@pytest.mark.parametrize("name", GLOBAL_FLAGS)
def test_a_bad_flag_of_a_global_flags_tool_is_one_line(name):
  fv = importlib.import_module(name).define_flags(flags.FlagValues())
  with pytest.raises(errors.UserError) as e:
    cli_flags.parse_absl_flags([name, "--no_such_flag=1"], fv)
  assert errors.describe(e.value) == (
    "Unknown command line flag 'no_such_flag'; see --helpshort for the flags"
  )


def test_a_missing_required_flag_or_a_stray_argument_is_one_line():
  def define_flags(define):
    define("string", "out", None, "Output directory.", required=True)

  with pytest.raises(errors.UserError) as e:
    cli_flags.parse_flags(define_flags, [])
  assert errors.describe(e.value) == (
    "--out is required; pass --out=<value> (--helpshort lists the flags)"
  )
  assert cli_flags.parse_flags(define_flags, ["--out", "d"]).out == "d"
  with pytest.raises(errors.UserError) as e:
    cli_flags.parse_flags(define_flags, ["--out=d", "stray"])
  assert errors.describe(e.value) == (
    "unexpected arguments ['stray']; flags take the form --name=value"
  )
