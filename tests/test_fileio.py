"""The one I/O layer (odetransformer/runtime/fileio.py): the same results on a local directory
and on gs:// (a GCS emulator), and no module routed through it touches a workdir path
with local-file calls of its own (a static scan)."""

import ast
import hashlib
import os
import subprocess
import sys

import pytest

from odetransformer.runtime import fileio

from tiny import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Modules whose workdir, checkpoint, config and tokenizer paths go through fileio.
ROUTED = (
  "odetransformer/train/checkpoint/paths.py",
  "odetransformer/train/checkpoint/fingerprint.py",
  "odetransformer/train/checkpoint/integrity.py",
  "odetransformer/train/checkpoint/restore.py",
  "odetransformer/train/checkpoint/manager.py",
  "odetransformer/train/loop.py",
  "odetransformer/runtime/workdir_lock.py",
  "odetransformer/train/metrics.py",
  "odetransformer/train/health.py",
  "odetransformer/train/loading.py",
  "odetransformer/train/finetune.py",
  "odetransformer/tools/evaluate.py",
  "odetransformer/analysis/spectra.py",
  "odetransformer/analysis/lyapunov.py",
  "odetransformer/analysis/lyapunov_report.py",
  "odetransformer/train/setup.py",
  "odetransformer/train/evaluation.py",
  "odetransformer/analysis/clustering.py",
)
# (module, function): why a local-file call there is right.
ALLOWED = {
  # flock needs a local file descriptor: this branch runs only for local workdirs.
  ("odetransformer/runtime/workdir_lock.py", "_acquire_flock"): "flock (local paths only)",
  ("odetransformer/runtime/workdir_lock.py", "_write_fd"): "flock (local paths only)",
  ("odetransformer/runtime/workdir_lock.py", "_check_flock"): "flock (local paths only)",
  ("odetransformer/runtime/workdir_lock.py", "release"): "flock (local paths only)",
}
_OS_FILE_CALLS = {
  "makedirs",
  "mkdir",
  "listdir",
  "remove",
  "rmdir",
  "replace",
  "rename",
  "walk",
  "open",
  "scandir",
  "stat",
  "unlink",
}
_MODULES = {"shutil", "pathlib", "glob"}


def local_file_calls(source: str) -> list:
  """[(function, line, what)] of `open(...)`, `os.path.*`, os file calls and uses of
  shutil/pathlib/glob in `source`."""
  found = []

  def visit(node, function):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      function = node.name
    what = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
      what = "open("
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      if node.value.id == "os" and (node.attr == "path" or node.attr in _OS_FILE_CALLS):
        what = f"os.{node.attr}"
      elif node.value.id in _MODULES:
        what = f"{node.value.id}.{node.attr}"
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
      if any(n.split(".")[0] in _MODULES for n in names):
        what = "import " + ", ".join(n for n in names if n)
    if what:
      found.append((function, node.lineno, what))
    for child in ast.iter_child_nodes(node):
      visit(child, function)

  visit(ast.parse(source), "<module>")
  return found


def test_scan_sees_planted_local_file_calls():
  source = (
    "import shutil\n"
    "def f(p):\n  with open(p) as fh:\n    return os.path.join(p, 'x')\n"
    "def g(p):\n  os.makedirs(p)\n  pathlib.Path(p)\n  return os.fspath(p)\n"
  )
  assert local_file_calls(source) == [
    ("<module>", 1, "import shutil"),
    ("f", 3, "open("),
    ("f", 4, "os.path"),
    ("g", 6, "os.makedirs"),
    ("g", 7, "pathlib.Path"),
  ]


def test_routed_modules_use_only_fileio_for_paths():
  bad = []
  for module in ROUTED:
    with open(os.path.join(ROOT, module), encoding="utf-8") as f:
      for function, line, what in local_file_calls(f.read()):
        if (module, function) not in ALLOWED:
          bad.append(f"{module}:{line} {what} in {function}")
  assert not bad, "use odetransformer.runtime.fileio instead: " + "; ".join(bad)


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
  if request.param == "local":
    return str(tmp_path / "root")
  return f"{request.getfixturevalue('gcs_bucket')}/fileio-{os.getpid()}"


@pytest.mark.slow
def test_same_results_on_local_and_gs(root):
  fileio.write_text_atomic(fileio.join(root, "a", "b.txt"), "bé")
  fileio.write_bytes_atomic(fileio.join(root, "c.bin"), b"\0\1")
  assert fileio.read_text(fileio.join(root, "a", "b.txt")) == "bé"
  assert fileio.listdir(root) == ["a", "c.bin"]
  assert fileio.walk_files(root) == ["a/b.txt", "c.bin"]
  assert fileio.isdir(fileio.join(root, "a")) and fileio.isfile(fileio.join(root, "c.bin"))
  fileio.copy_tree(fileio.join(root, "a"), fileio.join(root, "d", "a"))
  fileio.move(fileio.join(root, "a"), fileio.join(root, "e", "a"))
  assert fileio.walk_files(root) == ["c.bin", "d/a/b.txt", "e/a/b.txt"]
  assert fileio.sha256(fileio.join(root, "c.bin")) == hashlib.sha256(b"\0\1").hexdigest()
  local = fileio.local_copy(fileio.join(root, "c.bin"))
  with open(local, "rb") as f:
    assert f.read() == b"\0\1"
  fileio.rmtree(fileio.join(root, "e"))
  fileio.remove(fileio.join(root, "c.bin"))
  assert fileio.walk_files(root) == ["d/a/b.txt"]
  assert fileio.listdir(fileio.join(root, "nothing")) == []
  assert not fileio.exists(fileio.join(root, "nothing"))


def test_emulator_variables_derive_from_storage_emulator_host(monkeypatch):
  for key in (
    "TENSORSTORE_GCS_HTTP_URL",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING",
    "CLOUD_STORAGE_EMULATOR_ENDPOINT",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
  ):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.delenv(fileio.EMULATOR_VAR, raising=False)
  assert fileio.configure_emulator() == ""
  assert "TENSORSTORE_GCS_HTTP_URL" not in os.environ
  monkeypatch.setenv(fileio.EMULATOR_VAR, "127.0.0.1:4443")
  monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "mine")  # the user's wins
  assert fileio.configure_emulator() == "http://127.0.0.1:4443"
  assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:4443"
  assert os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] == "http://127.0.0.1:4443"
  assert os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] == "mine"
  assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"


@pytest.mark.slow
@pytest.mark.parametrize(
  "command", [["main.py", "--config=configs/default.py"], ["-m", "odetransformer.tools.evaluate"]]
)
def test_undecodable_path_is_one_line_before_any_work(command, tmp_path):
  """A non-ASCII --workdir under LC_ALL=C with UTF-8 mode off reaches Python as lone
  surrogates, which tensorstore and SentencePiece cannot take: refused in one line
  naming the fix, exit 2, nothing created."""
  workdir = os.path.join(os.fsencode(tmp_path), "w\u00f6rk".encode("utf-8"))
  env = cpu_env(LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
  out = subprocess.run(
    [sys.executable, *command, b"--workdir=" + workdir],
    cwd=ROOT,
    env=env,
    capture_output=True,
    timeout=120,
  )
  text = out.stderr.decode("ascii", "replace")
  errors = [line for line in text.splitlines() if line.startswith("error:")]
  assert out.returncode == 2 and "Traceback" not in text, text[-3000:]
  assert len(errors) == 1 and "PYTHONUTF8=1" in errors[0], text[-3000:]
  assert not os.path.exists(workdir)
