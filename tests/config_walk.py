"""The walk a run's settings take through the code: which modules are handed the whole
config, in what order, during one `train_and_evaluate`.

A module "is handed the config" when one of its functions is called with the run's
config among its arguments: an ml_collections ConfigDict (the config users write, or any
part of it: untyped either way), a `RunConfig` (odetransformer/train/run_config.py), or
an object that carries one (`setup.Run`). The typed sections of a RunConfig (OptimConfig,
DataConfig, ...) are what code downstream should take, and are not followed. The walk is
the sequence of such modules in call order, with consecutive repeats merged. Each module
has a layer: its longest chain of project imports from `odetransformer.train.loop` (0 =
the loop; larger = lower in the stack). A *climb* is a step of the walk to a module of a
smaller layer than the one before it (the config came back up to be handed down again);
a module is *re-entered* when it appears in the walk again after another module.

  python -m tests.config_walk      # prints the walk, its climbs and re-entries
"""

import ast
import collections
import dataclasses
import functools
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("odetransformer", "input_pipeline")
START = "odetransformer.train.loop"


def _module_file(name: str) -> pathlib.Path | None:
  path = ROOT.joinpath(*name.split("."))
  for candidate in (path.with_suffix(".py"), path / "__init__.py"):
    if candidate.exists():
      return candidate
  return None


def _imports(name: str) -> set:
  """The project modules `name` imports (any form, anywhere in the file)."""
  tree = ast.parse(_module_file(name).read_text())
  package = name if _module_file(name).name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}".rstrip(".")
      found.add(base)
      found.update(f"{base}.{a.name}" for a in node.names)
  return {m for m in found if m.split(".")[0] in PACKAGES and _module_file(m)}


def layers(start: str = START) -> dict:
  """Module -> its longest import chain from `start` (the import graph is acyclic)."""

  @functools.cache
  def below(name):
    return _imports(name) - {name}

  depth = {}

  def visit(name, d, path):
    if name in path:
      return
    if depth.get(name, -1) >= d:
      return
    depth[name] = d
    for child in below(name):
      visit(child, d + 1, path | {name})

  visit(start, 0, frozenset())
  return depth


def _is_config(value, depth: int = 0) -> bool:
  import ml_collections

  if isinstance(value, ml_collections.ConfigDict):
    return True
  if type(value).__name__ == "RunConfig":
    return True
  if depth or not dataclasses.is_dataclass(value) or isinstance(value, type):
    return False
  # An object that carries the config (setup.Run): the settings travel with it.
  return any(_is_config(getattr(value, f.name, None), 1) for f in dataclasses.fields(value))


def trace(run) -> list:
  """The modules handed a config, in call order (repeats merged), while `run()` runs."""
  walk = []

  def profile(frame, event, arg):
    if event != "call":
      return
    module = frame.f_globals.get("__name__", "")
    if module.split(".")[0] not in PACKAGES:
      return
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if any(_is_config(frame.f_locals.get(n)) for n in names):
      if not walk or walk[-1] != module:
        walk.append(module)

  sys.setprofile(profile)
  try:
    run()
  finally:
    sys.setprofile(None)
  return walk


@dataclasses.dataclass
class Walk:
  modules: list
  climbs: list  # (from, to)
  entries: dict  # module -> times entered

  @property
  def max_entries(self) -> int:
    return max(self.entries.values())


def measure(walk: list, depth: dict) -> Walk:
  climbs = [
    (a, b) for a, b in zip(walk, walk[1:]) if depth.get(b, 99) < depth.get(a, 99) and a != b
  ]
  return Walk(walk, climbs, dict(collections.Counter(walk)))


def default_walk() -> Walk:
  """The walk of a 2-step run of configs/default.py (the embedded corpus)."""
  from configs import default
  from odetransformer.train import loop

  config = default.get_config()
  config.num_train_steps = 2
  config.log_every_steps = config.eval_every_steps = config.checkpoint_every_steps = 0
  config.data.eval_max_batches = 1
  config.checkpoint_async = False
  with tempfile.TemporaryDirectory() as workdir:
    walk = trace(lambda: loop.train_and_evaluate(config, workdir))
  return measure(walk, layers())


if __name__ == "__main__":
  w = default_walk()
  depth = layers()
  print("walk:")
  for m in w.modules:
    print(f"  {depth.get(m, '?'):>2} {m}")
  print(f"{len(w.modules)} steps, {len(w.entries)} modules, {len(w.climbs)} climbs:")
  for a, b in w.climbs:
    print(f"  {a} -> {b}")
  print("entered more than twice:", {m: n for m, n in w.entries.items() if n > 2})
