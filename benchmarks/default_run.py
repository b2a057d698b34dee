"""The README's default run, run as the README says: does it print the lines the README
quotes under "The default run", with the same losses, perplexities and accuracies?

  python -m benchmarks.default_run [--workdir=DIR] [--through_step=N]

Runs `python main.py --config=configs/default.py --workdir=DIR` (a fresh temporary
directory by default) in the user's environment (no test XLA flags) and reads its stderr
as it comes. Each quoted line must be printed, in the README's order; a model figure
(loss, ppl, lr, grad_norm, perplexity, accuracy, tokens) must agree to the precision the
log prints it (within one unit of its last digit: another CPU type may round the last
digit the other way); wall-clock fields (tok/s, MFU, ETA, seconds) are not compared.
With `--through_step=N` only the quoted lines up to step N are checked and the run is
stopped there (the tests check the header and step 1 so; the whole run takes minutes on
a 2-core CPU). Last line: `default run: Q of Q quoted lines printed (through step S)`, or
exit status 1 naming the first line that was not printed.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

from odetransformer import cli_flags, errors

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_WORKDIR = "/tmp/odet_default"
# absl's prefix: `I1127 07:29:00.557297 139836877249408 metrics.py:388] ` (the README
# trims the thread id to …).
ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ (?:\d+|…) [\w.]+:\d+\] ")
MODEL_FIGURES = ("loss", "ppl", "lr", "grad_norm", "perplexity", "accuracy", "tokens")
STEP = re.compile(r"^(?:eval @ )?step (\d+)")


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
  try:
    value = float(p)
  except ValueError:
    return False
  if "e" in q:  # 5.673e-04: one unit of the mantissa's last digit
    mantissa, exponent = q.split("e")
    unit = 10.0 ** (int(exponent) - len(mantissa.partition(".")[2]))
  else:
    unit = 10.0 ** -len(q.partition(".")[2])
  return abs(float(q) - value) <= unit * (1 + 1e-9)


def matches(quoted: str, printed: str, workdir: str) -> bool:
  """Whether the printed line (absl's prefix removed) is the quoted one: a step or eval
  line by its head and model figures, any other line piece by piece around the README's
  '…' cuts, with the README's workdir read as `workdir`."""
  quoted = quoted.replace(README_WORKDIR, workdir)
  if quoted.startswith(("step ", "eval @ step ")):
    if printed.split(" | ")[0] != quoted.split(" | ")[0]:
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


def through(quoted: list, step: int) -> list:
  """The quoted lines up to the last one of step `step` (every line when no step line
  comes after it)."""
  last = len(quoted)
  for i, line in enumerate(quoted):
    m = STEP.match(line)
    if m and int(m.group(1)) > step:
      last = i
      break
  return quoted[:last]


def check_run(quoted: list, workdir: str, timeout: float = 3600) -> tuple:
  """Runs the README's command on `workdir`, reading stderr until every line of `quoted`
  was printed in order (then the run is stopped) or the run ends. Returns (the number of
  quoted lines printed, the first one not printed or None, whether it ran on a CPU)."""
  env = {  # the user's environment: no test XLA flags, JAX_PLATFORMS or huge pages of ours
    k: v
    for k, v in os.environ.items()
    if k not in ("XLA_FLAGS", "GLIBC_TUNABLES", "JAX_PLATFORMS", "ODET_HUGEPAGES")
  }
  command = [sys.executable, "main.py", "--config=configs/default.py", f"--workdir={workdir}"]
  proc = subprocess.Popen(
    command, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
  )
  done, on_cpu, deadline = 0, False, time.monotonic() + timeout
  try:
    for raw in proc.stderr:
      line = ABSL_PREFIX.sub("", raw.rstrip("\n"))
      on_cpu = on_cpu or "no GPU or TPU device found" in line
      if done < len(quoted) and matches(quoted[done], line, workdir):
        done += 1
      if done == len(quoted) or time.monotonic() > deadline:
        break
  finally:
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)  # the workdir is thrown away
    proc.wait()
  return done, (quoted[done] if done < len(quoted) else None), on_cpu


def define_flags(define) -> None:
  """This command's flags (cli_flags.parse_flags)."""
  define("string", "workdir", "", "Run directory (default: a fresh temporary one).")
  define("integer", "through_step", 0, "Check the quoted lines up to this step (0 = all).")


def main(argv=None) -> int:
  args = cli_flags.parse_flags(define_flags, argv, doc=__doc__)
  if args.through_step < 0:
    raise errors.UserError(f"--through_step={args.through_step} must be >= 0 (0 = all)")
  quoted = quoted_lines((ROOT / "README.md").read_text(encoding="utf-8"))
  if args.through_step:
    quoted = through(quoted, args.through_step)
  began = time.time()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = args.workdir or os.path.join(tmp, "odet_default")
    done, missing, on_cpu = check_run(quoted, workdir)
  if not on_cpu:
    print("main.py ran on an accelerator; the README quotes a CPU host's run")
    return 1
  last = max((int(m.group(1)) for q in quoted if (m := STEP.match(q))), default=0)
  print(f"wall time {time.time() - began:.0f} s")
  if missing is not None:
    print(f"not printed (after {done} quoted lines): {missing}")
    return 1
  print(f"default run: {done} of {len(quoted)} quoted lines printed (through step {last})")
  return 0


if __name__ == "__main__":
  sys.exit(errors.run_cli(main))
