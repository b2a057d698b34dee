"""Multi-host on one machine: 2 processes × 4 CPU devices on 127.0.0.1 (gloo).

The same tiny run three ways, each in fresh subprocesses (device counts and
`jax.distributed` are per process):

  ref     1 process × 8 devices, 4 steps uninterrupted;
  part1   2 processes × 4 devices, "preempted" after step 2 (checkpoint saved);
  part2   the same 2 processes again on the same workdir: resumes at step 2, runs to 4;
  sigterm 2 processes on a 1000-step run, a real SIGTERM sent to process 1 only.

Each process runs main.py's own entry point (flags, multi-host detection from
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, `jax.distributed`
initialisation, then `loop.train_and_evaluate`), recording its training batches and the
run's result. All runs split the data into 2 input shards (`data.input_shards`), so the
1-process reference sees the global batches of the 2-process runs. Checked: losses of
part1 + part2 equal ref's (1e-5), and at every step the two processes held disjoint
halves whose concatenation is ref's global batch (also after the resume); the processes'
document sources served disjoint documents; only process 0 logs progress and evaluation, and the TensorBoard scalars
and checkpoints are written once; the SIGTERM stops both processes at the same step,
with that step's checkpoint, exit 0.
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from odetransformer.train.checkpoint.paths import finalized_steps
from odetransformer.train import metrics as metrics_lib
from tiny import cpu_env

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = pytest.mark.xdist_group("test_multihost")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 240          # per group of processes; a hang is killed, not waited on

DRIVER = textwrap.dedent("""
    import json, os, sys
    sys.path[:0] = [os.environ["ODET_ROOT"], os.path.join(os.environ["ODET_ROOT"], "tests")]
    import time
    T0 = time.time()
    import main as main_lib
    from odetransformer import errors
    from odetransformer.train import steps, loop
    from odetransformer.train.checkpoint.manager import Checkpointer
    from tiny import config_flags, tiny_config

    c = tiny_config(os.environ["ODET_CACHE"], num_train_steps=int(os.environ.get("ODET_STEPS", 4)))
    c.eval_every_steps = 0          # only at the end
    c.checkpoint_every_steps = 0    # only at the end (or at the preemption)
    c.global_batch_size = c.eval_batch_size = 8
    c.data.eval_max_batches = 1
    c.data.input_shards = 2         # the 1-process reference reads both shards
    config_file, base = "configs/default.py", None
    if os.environ.get("ODET_INIT_FROM"):   # fine-tuning ('full', at the training K)
      from configs import finetune_default
      base = finetune_default.get_config()
      config_file = "configs/finetune_default.py"
      c.init_from = os.environ["ODET_INIT_FROM"]
      c.finetune = base.finetune.copy_and_resolve_references()
      c.finetune.method = "full"

    read = []                       # training documents this process's source served
    from input_pipeline import sources
    open_corpus = sources.open_corpus
    class Counting:
      def __init__(self, source):
        self.source = source
      def __len__(self):
        return len(self.source)
      def __getitem__(self, i):
        read.append(int(i))
        return self.source[i]
    def counting_corpus(*args):
      corpus = open_corpus(*args)
      return type(corpus)(**{**vars(corpus), "train": Counting(corpus.train)})
    sources.open_corpus = counting_corpus

    stop = int(os.environ.get("ODET_STOP_AT", "0"))
    if stop:   # a preemption noticed at step `stop` by every process
      Checkpointer.reached_preemption = lambda self, step: step == stop

    batches, result = [], {}
    local_batch = steps.local_batch
    def recording(batch, local_batch_size=None):
      out = local_batch(batch, local_batch_size)
      if local_batch_size is None:       # training batches only (eval passes a size)
        batches.append(out["inputs"].tolist())
      return out
    steps.local_batch = recording
    train_and_evaluate = loop.train_and_evaluate
    def recorded(config, workdir):
      result.update(train_and_evaluate(config, workdir))
      return result
    loop.train_and_evaluate = recorded

    sys.argv = ["main.py", f"--config={config_file}",
                f"--workdir={os.environ['ODET_WORKDIR']}", *config_flags(c, base)]
    try:
      errors.run_cli(main_lib._run)       # what `python main.py ...` runs
    except SystemExit as e:               # absl's app.run exits when main returns
      assert e.code in (None, 0), e.code
    import jax
    out = {"process_index": jax.process_index(), "process_count": jax.process_count(),
           "device_count": jax.device_count(), "local_devices": jax.local_device_count(),
           "start_step": result["start_step"], "step": result["step"],
           "losses": [[s, float(l)] for s, l in result["loss_history"]],
           "batches": batches, "documents_read": sorted(set(read))}
    if os.environ.get("ODET_EVALUATE"):   # then the evaluate command on the run, here
      import contextlib, io
      from absl import flags
      from odetransformer.tools import evaluate
      fv = evaluate.define_flags(flags.FlagValues())
      fv(["evaluate", f"--workdir={os.environ['ODET_WORKDIR']}", "--max_batches=1"])
      with contextlib.redirect_stdout(io.StringIO()) as printed:
        evaluate.main([], fv)
      out["evaluated"] = printed.getvalue()
    print(f"driver done in {time.time() - T0:.1f}s", file=sys.stderr)
    with open(os.environ["ODET_RESULT"], "w") as f:
      json.dump(out, f)
    """)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(tmp, devices, **extra):
  env = cpu_env(devices)
  env.update(ODET_ROOT=str(ROOT), ODET_CACHE=str(tmp / "cache"))   # + the session's compile cache
  for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
    env.pop(key, None)
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _start_group(tmp, name, envs):
  """Starts one driver process per env, its output going to <name>_<i>.log."""
  driver = tmp / "driver.py"
  driver.write_text(DRIVER)
  procs, logs = [], []
  for i, env in enumerate(envs):
    env["ODET_RESULT"] = str(tmp / f"{name}_{i}.json")
    log = open(tmp / f"{name}_{i}.log", "w")
    logs.append(log)
    procs.append(subprocess.Popen([sys.executable, str(driver)], env=env, cwd=str(ROOT),
                                  stdout=log, stderr=subprocess.STDOUT))
  return procs, logs


def _run_group(tmp, name, envs, started=None) -> list:
  """Starts (or takes `started`) one process per env, waits (bounded), kills all on
  failure; results."""
  procs, logs = started or _start_group(tmp, name, envs)
  deadline = time.monotonic() + TIMEOUT_S
  try:
    while any(p.poll() is None for p in procs):
      if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  codes = [p.returncode for p in procs]
  if codes != [0] * len(procs):
    tails = "\n".join(f"--- {name} process {i} (rc {c}) ---\n" +
                      (tmp / f"{name}_{i}.log").read_text()[-3000:]
                      for i, c in enumerate(codes))
    pytest.fail(f"{name}: processes exited with {codes} (killed after {TIMEOUT_S}s if "
                f"still running)\n{tails}")
  return [json.loads((tmp / f"{name}_{i}.json").read_text()) for i in range(len(procs))]


def _two_process_envs(tmp, workdir, **extra):
  port = _free_port()
  return [_env(tmp, 4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=2,
               JAX_PROCESS_ID=i, ODET_WORKDIR=workdir, **extra) for i in range(2)]


def _two_processes(tmp, name, workdir, **extra):
  return _run_group(tmp, name, _two_process_envs(tmp, workdir, **extra))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """The module's directory: the runs' shared tokenizer/data cache."""
  return tmp_path_factory.mktemp("multihost")


@pytest.fixture(scope="module")
def runs(base):
  tmp = base
  # The 1-process run first: it also trains and caches the tokenizer for the others.
  ref = _run_group(tmp, "ref", [_env(tmp, 8, ODET_WORKDIR=tmp / "ref")])[0]
  part1 = _two_processes(tmp, "part1", tmp / "multi", ODET_STOP_AT=2)
  part2 = _two_processes(tmp, "part2", tmp / "multi")
  return ref, part1, part2


def test_topology(runs):
  ref, part1, part2 = runs
  assert (ref["process_count"], ref["device_count"]) == (1, 8)
  for group in (part1, part2):
    assert [r["process_index"] for r in group] == [0, 1]
    for r in group:
      assert (r["process_count"], r["device_count"], r["local_devices"]) == (2, 8, 4)


def test_preempted_then_resumed(runs):
  _, part1, part2 = runs
  assert [(r["start_step"], r["step"]) for r in part1] == [(0, 2), (0, 2)]
  assert [(r["start_step"], r["step"]) for r in part2] == [(2, 4), (2, 4)]


def test_losses_equal_single_process(runs):
  ref, part1, part2 = runs
  expected = dict((s, l) for s, l in ref["losses"])
  assert sorted(expected) == [1, 2, 3, 4]
  for group, steps in ((part1, [1, 2]), (part2, [3, 4])):
    for r in group:
      got = dict((s, l) for s, l in r["losses"])
      assert sorted(got) == steps
      for s in steps:
        assert got[s] == pytest.approx(expected[s], abs=1e-5), (r["process_index"], s)


def test_each_process_reads_a_disjoint_half(runs):
  ref, part1, part2 = runs
  assert len(ref["batches"]) == 4
  for group, offset in ((part1, 0), (part2, 2)):
    p0, p1 = group[0]["batches"], group[1]["batches"]
    assert len(p0) == len(p1) == 2
    for j in range(2):
      assert len(p0[j]) == len(p1[j]) == 4            # 8 rows / 2 processes
      rows0 = {tuple(r) for r in p0[j]}
      rows1 = {tuple(r) for r in p1[j]}
      assert not rows0 & rows1, f"step {offset + j + 1}: processes share rows"
      assert p0[j] + p1[j] == ref["batches"][offset + j], f"step {offset + j + 1}"


def test_each_process_reads_only_its_input_shard(runs):
  """Per-host input: the two processes' sources served disjoint documents (each its own
  half of the epoch's shuffled order)."""
  _, part1, part2 = runs
  for group in (part1, part2):
    read = [set(r["documents_read"]) for r in group]
    assert read[0] and read[1] and not read[0] & read[1]


def test_process_0_alone_logs_and_writes_scalars(runs, base):
  """Every process reports its place in the job; progress, evaluation, TensorBoard
  scalars and the checkpoints of the two-process run are written once."""
  del runs
  log = lambda name, i: (base / f"{name}_{i}.log").read_text()
  assert "JAX process 0/1, 8 local / 8 global devices" in log("ref", 0)
  for name in ("part1", "part2"):
    for i in range(2):
      assert f"JAX process {i}/2, 4 local / 8 global devices" in log(name, i)
  assert "step 2/4 | loss" in log("part1", 0) and "step 4/4 | loss" in log("part2", 0)
  assert "eval @ step 4 | loss" in log("part2", 0)
  for name in ("part1", "part2"):
    assert " | loss" not in log(name, 1)
  scalars = metrics_lib.read_scalars(str(base / "multi" / "tensorboard"))
  assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
  assert [s for s, _ in scalars["eval/loss"]] == [4]
  assert finalized_steps(str(base / "multi")) == [2, 4]


@pytest.fixture(scope="module")
def pod(runs, base, gcs_bucket):
  """A simulated pod on object storage: 2 processes × 4 devices train on a gs:// workdir
  (the GCS emulator) until a SIGTERM reaches process 1 only; the run resumes on 1 process
  × 8 devices; a fine-tuning run starts from it (`init_from=gs://…`) and the evaluate
  command (its flags and main, in the fine-tuning process) reads that one. Returns (workdir, the stopped step, the
  resumed run's result, the fine-tuning run's result, evaluate's output)."""
  del runs                       # run after it: its tokenizer and compilations are cached
  tmp = base
  workdir = f"{gcs_bucket}/pod-{os.getpid()}"
  envs = _two_process_envs(tmp, workdir, ODET_STEPS=1000)
  procs, logs = _start_group(tmp, "sigterm", envs)
  log0 = tmp / "sigterm_0.log"
  deadline = time.monotonic() + TIMEOUT_S
  while "first train step" not in log0.read_text() and time.monotonic() < deadline:
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)
  group = _run_group(tmp, "sigterm", envs, started=(procs, logs))
  steps = [r["step"] for r in group]
  assert steps[0] == steps[1] and 1 <= steps[0] < 1000, steps
  stopped = steps[0]
  resumed = _run_group(tmp, "pod_resume", [_env(tmp, 8, ODET_WORKDIR=workdir,
                                                ODET_STEPS=stopped + 1)])[0]
  finetune = f"{workdir}-ft"
  tuned = _run_group(tmp, "pod_ft", [_env(tmp, 8, ODET_WORKDIR=finetune, ODET_STEPS=1,
                                          ODET_INIT_FROM=workdir,
                                          ODET_EVALUATE=1)])[0]
  return workdir, stopped, resumed, tuned, tuned["evaluated"]


def test_sigterm_to_one_process_stops_both_at_the_same_step(pod, base):
  """A real preemption notice (SIGTERM) reaching only process 1 of 2: through JAX's
  preemption-sync service both processes stop at the same step, the checkpoint of that
  step is written (to gs://), and both exit 0 — no process is left waiting in a
  collective."""
  workdir, stopped, _, _, _ = pod
  assert stopped in finalized_steps(workdir)
  assert f"stopping at step {stopped} after preemption" in (base / "sigterm_0.log").read_text()


def test_pod_resumes_on_one_process_then_finetunes_and_evaluates_from_gs(pod, base):
  """The 2-process checkpoint on gs:// resumes on 1 process × 8 devices (its two input
  shards continue), a fine-tuning run loads it from gs://, evaluate reads that run from
  gs://, and no local directory named 'gs:' appears anywhere."""
  workdir, stopped, resumed, tuned, printed = pod
  assert (resumed["process_count"], resumed["device_count"]) == (1, 8)
  assert (resumed["start_step"], resumed["step"]) == (stopped, stopped + 1)
  assert finalized_steps(workdir)[-1] == stopped + 1
  assert "input shards, this run" not in (base / "pod_resume_0.log").read_text()   # exact
  assert (tuned["start_step"], tuned["step"]) == (0, 1)
  assert f"from {workdir}: loaded" in (base / "pod_ft_0.log").read_text()
  assert f"of {workdir}-ft:" in printed and "perplexity" in printed
  for root in {pathlib.Path.cwd(), ROOT, base}:
    assert not (root / "gs:").exists(), root
