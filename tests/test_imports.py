"""The packages' import graph has no circle (module-level and in-function imports alike)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("odetransformer", "input_pipeline", "benchmarks")


def _module_name(path: str, root: str) -> str:
  rel = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
  return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def import_graph(root: str = ROOT, packages=PACKAGES) -> dict:
  """{module: {project modules it imports}}, read from the source (nothing is imported)."""
  files = {}
  for package in packages:
    for dirpath, _, names in os.walk(os.path.join(root, package)):
      for name in names:
        if name.endswith(".py"):
          path = os.path.join(dirpath, name)
          files[_module_name(path, root)] = path
  graph = {}
  for module, path in files.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    deps = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
      else:
        continue
      for name in names:
        while name and name not in files:  # `from pkg import mod` or a symbol
          name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):
          deps.add(name)
    # A package's __init__ is imported with any of its modules: not a circle by itself.
    graph[module] = {d for d in deps if not (d in packages and module.startswith(d + "."))}
  return graph


def find_cycle(graph: dict):
  """One import circle as a list of modules (first == last), or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == 1:
        return stack[stack.index(dep) :] + [dep]
      if dep not in state:
        found = visit(dep)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_cycle_finder_sees_a_planted_circle(tmp_path):
  pkg = tmp_path / "odetransformer"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from odetransformer import b\n")
  (pkg / "b.py").write_text("def f():\n  from odetransformer.c import g\n")
  (pkg / "c.py").write_text("import odetransformer.a\ng = 1\n")
  graph = import_graph(str(tmp_path), ("odetransformer",))
  assert graph["odetransformer.b"] == {"odetransformer.c"}
  assert find_cycle(graph) == [
    "odetransformer.a",
    "odetransformer.b",
    "odetransformer.c",
    "odetransformer.a",
  ]
  (pkg / "c.py").write_text("g = 1\n")
  assert find_cycle(import_graph(str(tmp_path), ("odetransformer",))) is None


def test_no_import_circle():
  graph = import_graph()
  assert "odetransformer.train.loop" in graph and graph["odetransformer.train.loop"]
  cycle = find_cycle(graph)
  assert cycle is None, "import circle: " + " -> ".join(cycle)


# Imports only go down: each room may import the rooms listed for it (and itself).
LAYERS = {
  "odetransformer.errors": (),
  "odetransformer.cli_flags": ("odetransformer.errors",),
  "odetransformer.runtime": ("odetransformer.errors",),
  "odetransformer.model": ("odetransformer.errors",),
  "input_pipeline": ("odetransformer.errors", "odetransformer.cli_flags", "odetransformer.runtime"),
  "odetransformer.train": (
    "odetransformer.errors",
    "odetransformer.runtime",
    "odetransformer.model",
    "input_pipeline",
  ),
  "odetransformer.analysis": (
    "odetransformer.errors",
    "odetransformer.cli_flags",
    "odetransformer.runtime",
    "odetransformer.model",
    "input_pipeline",
    "odetransformer.train",
  ),
  "odetransformer.tools": (
    "odetransformer.errors",
    "odetransformer.cli_flags",
    "odetransformer.runtime",
    "odetransformer.model",
    "input_pipeline",
    "odetransformer.train",
  ),
}


def _room(module: str):
  for room in sorted(LAYERS, key=len, reverse=True):
    if module == room or module.startswith(room + "."):
      return room
  return None


def layer_violations(graph: dict) -> list:
  """['a -> b', ...]: imports from a room into one it may not import."""
  bad = []
  for module, deps in sorted(graph.items()):
    room = _room(module)
    if room is None:
      continue
    for dep in sorted(deps):
      target = _room(dep)
      if target is not None and target != room and target not in LAYERS[room]:
        bad.append(f"{module} -> {dep}")
  return bad


def test_layer_check_sees_an_upward_import():
  graph = {
    "odetransformer.model.blocks": {"odetransformer.errors"},
    "odetransformer.train.loop": {"odetransformer.model.blocks"},
  }
  assert layer_violations(graph) == []
  graph["odetransformer.model.blocks"].add("odetransformer.train.loop")
  graph["odetransformer.model.decode"] = {"odetransformer.runtime.fileio"}
  assert layer_violations(graph) == [
    "odetransformer.model.blocks -> odetransformer.train.loop",
    "odetransformer.model.decode -> odetransformer.runtime.fileio",
  ]


def test_imports_only_go_down():
  graph = import_graph()
  every_module = set(graph)
  for room in LAYERS:
    assert any(_room(m) == room for m in every_module), f"no module in {room}"
  unplaced = sorted(
    m
    for m in every_module
    if m.startswith("odetransformer.") and _room(m) is None and m not in (*LAUNCHERS, SCRIPTS)
  )
  assert unplaced == [], f"modules outside every room: {unplaced}"
  assert layer_violations(graph) == []


# The public commands `python -m odetransformer.NAME`: launchers that import nothing and
# run `odetransformer.tools.NAME` as __main__.
LAUNCHERS = tuple(
  f"odetransformer.{name}"
  for name in ("evaluate", "generate", "export", "import_checkpoint", "lm_eval", "memory")
)


# The console scripts (pyproject.toml): like the launchers, they import nothing of ours.
SCRIPTS = "odetransformer.scripts"


def test_public_commands_are_launchers_of_the_tools():
  graph = import_graph()
  for launcher in LAUNCHERS:
    name = launcher.rpartition(".")[2]
    assert graph[launcher] == set() and f"odetransformer.tools.{name}" in graph
    with open(os.path.join(ROOT, "odetransformer", name + ".py"), encoding="utf-8") as f:
      assert f'run_module("odetransformer.tools.{name}", run_name="__main__"' in f.read()
  assert graph[SCRIPTS] == set()
