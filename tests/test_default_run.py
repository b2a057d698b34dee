"""The README's default run, run as the README says: it prints the lines the README
quotes under "The default run", with the same losses, perplexities and accuracies.

Slow: 500 training steps of configs/default.py (minutes on a 2-core CPU). Wall-clock
fields (tok/s, MFU, ETA, seconds) are not compared; a figure of the model's (loss, ppl,
lr, grad_norm, perplexity, accuracy) must agree to the precision the log prints it
(within one unit of its last digit: another CPU type may round the last digit the
other way).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[1]
README_WORKDIR = "/tmp/odet_default"
# absl's prefix: `I1127 07:29:00.557297 139836877249408 metrics.py:388] ` (the README
# trims the thread id to …).
ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ (?:\d+|…) [\w.]+:\d+\] ")
MODEL_FIGURES = ("loss", "ppl", "lr", "grad_norm", "perplexity", "accuracy", "tokens")


def quoted_lines(readme: str) -> list:
  """The log lines of the first indented block under "## The default run", without
  absl's prefix; '…' alone is a gap (lines left out)."""
  section = readme.split("## The default run\n", 1)[1].split("\n## ", 1)[0]
  lines, seen = [], False
  for line in section.splitlines():
    if line.startswith("    "):
      seen = True
      lines.append(ABSL_PREFIX.sub("", line[4:]))
    elif seen and line.strip():
      break
  return [line for line in lines if line != "…"]


def fields(line: str) -> dict:
  """{'loss': '4.6534', …} of a `step …` or `eval @ step …` line's ` | `-separated
  fields."""
  out = {}
  for part in line.split(" | ")[1:]:
    name, _, value = part.partition(" ")
    out[name] = value
  return out


def agrees(quoted: str, printed: str) -> bool:
  """Equal to within one unit of the quoted value's last printed digit."""
  q, p = quoted.replace(",", ""), printed.replace(",", "")
  if "e" in q:  # 5.673e-04: one unit of the mantissa's last digit
    mantissa, exponent = q.split("e")
    unit = 10.0 ** (int(exponent) - len(mantissa.partition(".")[2]))
  else:
    unit = 10.0 ** -len(q.partition(".")[2])
  return abs(float(q) - float(p)) <= unit * (1 + 1e-9)


def matches(quoted: str, printed: str, workdir: str) -> bool:
  quoted = quoted.replace(README_WORKDIR, workdir)
  if quoted.startswith(("step ", "eval @ step ")):
    head = quoted.split(" | ")[0]
    if printed.split(" | ")[0] != head:
      return False
    want, got = fields(quoted), fields(printed)
    return all(
      name in got and agrees(want[name], got[name]) for name in MODEL_FIGURES if name in want
    )
  pieces = quoted.split("…")  # the README trims long lines with …
  at = 0
  for i, piece in enumerate(pieces):
    found = printed.find(piece, at)
    if found < 0 or (i == 0 and found != 0):
      return False
    at = found + len(piece)
  return pieces[-1] == "" or printed.endswith(pieces[-1])


def test_readme_quotes_what_the_default_run_prints(tmp_path):
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  quoted = quoted_lines(readme)
  assert len(quoted) >= 8 and any(q.startswith("eval @ step 500 ") for q in quoted)
  assert f"--workdir={README_WORKDIR}" in readme
  workdir = str(tmp_path / "odet_default")
  # The user's environment: no test XLA flags, JAX_PLATFORMS or huge pages of ours.
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("XLA_FLAGS", "GLIBC_TUNABLES", "JAX_PLATFORMS", "ODET_HUGEPAGES")
  }
  proc = subprocess.run(
    [sys.executable, "main.py", "--config=configs/default.py", f"--workdir={workdir}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=3600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  if "no GPU or TPU device found" not in proc.stderr:
    pytest.skip("main.py ran on an accelerator; the README quotes a CPU host's run")
  printed = [ABSL_PREFIX.sub("", line) for line in proc.stderr.splitlines()]
  at = 0
  for line in quoted:  # in the README's order
    found = next((i for i in range(at, len(printed)) if matches(line, printed[i], workdir)), None)
    assert found is not None, f"not printed (after line {at}): {line}\n" + "\n".join(
      l for l in printed if l.startswith(line[:12])
    )
    at = found + 1
