"""Multi-host on one machine: 2 processes × 4 CPU devices on 127.0.0.1 (gloo), on a gs://
workdir (the GCS emulator).

One tiny run (a 1000-step run at a constant learning rate, stopped early) three ways, each
in fresh subprocesses (device counts and `jax.distributed` are per process):

  sigterm 2 processes × 4 devices; a real SIGTERM sent to process 1 only, once training
          runs: both stop at the same step S, with that step's checkpoint;
  part2   the same 2 processes again on the same workdir: resumes at S, "preempted"
          after S + 2 (evaluated and saved there);
  ref     1 process × 8 devices, S + 2 steps uninterrupted; then, in the same process,
          the 2-process checkpoint resumed on 1 process × 8 devices for one more step.

Each process runs main.py's own entry point (flags, multi-host detection from
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, `jax.distributed`
initialisation, then `loop.train_and_evaluate`), recording its training batches and the
run's result. All runs split the data into 2 input shards (`data.input_shards`), so the
1-process reference sees the global batches of the 2-process runs. Checked: losses of
sigterm + part2 and part2's evaluation equal ref's (1e-5), and at every step the two
processes held disjoint halves whose concatenation is ref's global batch (also after the
resume); the processes' document sources served disjoint documents; only process 0 logs
progress and evaluation, and the TensorBoard scalars and checkpoints are written once;
the SIGTERM stops both processes at the same step, exit status 75 (stopped early,
resumable: errors.EXIT_STOPPED_EARLY); the 1-process resume of the
2-process checkpoint continues its two input shards exactly.
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

from odetransformer import errors
from odetransformer.train import metrics as metrics_lib
from odetransformer.train.checkpoint.paths import finalized_steps

from tiny import cpu_env

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = [pytest.mark.xdist_group("test_multihost"), pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # per group of processes; a hang is killed, not waited on
STEPS = 1000  # the schedule's length: every run stops well before

DRIVER = f"STEPS = {STEPS}\n" + textwrap.dedent("""
    import json, os, sys
    import time
    T0 = time.time()
    from odetransformer.tools import train as main_lib
    from odetransformer import errors
    from odetransformer.train import steps, loop
    from odetransformer.train.checkpoint.manager import Checkpointer
    from tiny import (config_flags, every_process_writes_the_compile_cache,
                      reused_compiled_steps, tiny_config)
    every_process_writes_the_compile_cache()

    c = tiny_config(os.environ["ODET_CACHE"], num_train_steps=STEPS)
    c.eval_every_steps = int(os.environ.get("ODET_EVAL_AT", 0))   # 0: at step STEPS only
    c.checkpoint_every_steps = 0    # at the stop (preemption)
    c.optim.schedule, c.optim.warmup_frac = "constant", 0.0   # the full rate from step 1
    c.global_batch_size = c.eval_batch_size = 8
    c.data.eval_max_batches = 1
    c.data.input_shards = 2         # the 1-process reference reads both shards
    c.peak_flops_per_device = 1e11  # MFU's divisor given: no matmul benchmark per process

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
    from input_pipeline import tokenizer
    get_tokenizer = tokenizer.get_tokenizer
    def uncounted(**kwargs):        # (process 0 may train it: its sample is not its shard)
      n = len(read)
      out = get_tokenizer(**kwargs)
      del read[n:]
      return out
    tokenizer.get_tokenizer = uncounted

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

    sys.argv = ["main.py", "--config=configs/default.py",
                f"--workdir={os.environ['ODET_WORKDIR']}", *config_flags(c)]
    # The reference's second run (ODET_THEN_RESUME) has the first one's config and mesh: it
    # takes the steps that run jitted instead of tracing them again.
    with reused_compiled_steps():
      code = 0
      try:
        errors.run_cli(main_lib._run)       # what `python main.py ...` runs
      except SystemExit as e:               # absl's app.run exits with main's status
        code = e.code or 0
      import jax
      out = {"exit_status": code,
             "process_index": jax.process_index(), "process_count": jax.process_count(),
             "device_count": jax.device_count(), "local_devices": jax.local_device_count(),
             "start_step": result["start_step"], "step": result["step"],
             "losses": [[s, float(l)] for s, l in result["loss_history"]],
             "batches": list(batches), "documents_read": sorted(set(read)),
             "eval": {k: float(v) for k, v in result["eval"].items()}}
      if os.environ.get("ODET_THEN_RESUME"):   # then resume that workdir, here, one step
        r = train_and_evaluate(c, os.environ["ODET_THEN_RESUME"],
                               stop_at_step=int(os.environ["ODET_THEN_STOP_AT"]))
        out["then"] = {"start_step": r["start_step"], "step": r["step"]}
    print(f"driver done in {time.time() - T0:.1f}s", file=sys.stderr)
    with open(os.environ["ODET_RESULT"], "w") as f:
      json.dump(out, f)
    """)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(cache, devices, **extra):
  env = cpu_env(devices)
  env.update(ODET_ROOT=str(ROOT), ODET_CACHE=str(cache))  # + the session's compile cache
  for key in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
  ):
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
    procs.append(
      subprocess.Popen(
        [sys.executable, str(driver)], env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT
      )
    )
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
    tails = "\n".join(
      f"--- {name} process {i} (rc {c}) ---\n" + (tmp / f"{name}_{i}.log").read_text()[-3000:]
      for i, c in enumerate(codes)
    )
    pytest.fail(
      f"{name}: processes exited with {codes} (killed after {TIMEOUT_S}s if still running)\n{tails}"
    )
  return [json.loads((tmp / f"{name}_{i}.json").read_text()) for i in range(len(procs))]


def _two_process_envs(cache, workdir, **extra):
  port = _free_port()
  return [
    _env(
      cache,
      4,
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES=2,
      JAX_PROCESS_ID=i,
      ODET_WORKDIR=workdir,
      **extra,
    )
    for i in range(2)
  ]


def _two_processes(tmp, cache, name, workdir, **extra):
  return _run_group(tmp, name, _two_process_envs(cache, workdir, **extra))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """The module's directory: the processes' logs and results, the reference's workdir."""
  return tmp_path_factory.mktemp("multihost")


@pytest.fixture(scope="module")
def runs(base, gcs_bucket, shared_data_cache):
  """The three groups (module docstring), on the session's tokenizer and data cache;
  returns (ref, sigterm, part2, the gs:// workdir, the step S the SIGTERM stopped at)."""
  tmp, cache = base, shared_data_cache
  workdir = f"{gcs_bucket}/multi-{os.getpid()}"
  envs = _two_process_envs(cache, workdir)
  procs, logs = _start_group(tmp, "sigterm", envs)
  log0 = tmp / "sigterm_0.log"
  deadline = time.monotonic() + TIMEOUT_S
  while "first train step" not in log0.read_text() and time.monotonic() < deadline:
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)
  sigterm = _run_group(tmp, "sigterm", envs, started=(procs, logs))
  stopped = sigterm[0]["step"]
  part2 = _two_processes(
    tmp, cache, "part2", workdir, ODET_STOP_AT=stopped + 2, ODET_EVAL_AT=stopped + 2
  )
  ref = _run_group(
    tmp,
    "ref",
    [
      _env(
        cache,
        8,
        ODET_WORKDIR=tmp / "ref",
        ODET_STOP_AT=stopped + 2,
        ODET_EVAL_AT=stopped + 2,
        ODET_THEN_RESUME=workdir,
        ODET_THEN_STOP_AT=stopped + 3,
      )
    ],
  )[0]
  return ref, sigterm, part2, workdir, stopped


def test_topology(runs):
  ref, sigterm, part2, _, _ = runs
  assert (ref["process_count"], ref["device_count"]) == (1, 8)
  for group in (sigterm, part2):
    assert [r["process_index"] for r in group] == [0, 1]
    for r in group:
      assert (r["process_count"], r["device_count"], r["local_devices"]) == (2, 8, 4)


def test_sigterm_to_one_process_stops_both_at_the_same_step(runs, base):
  """A real preemption notice (SIGTERM) reaching only process 1 of 2: through JAX's
  preemption-sync service both processes stop at the same step, the checkpoint of that
  step is written (to gs://), and both end with the stopped-early status (75, main.py's
  for a run to resume) — no process is left waiting in a collective."""
  _, sigterm, _, workdir, stopped = runs
  assert [(r["start_step"], r["step"]) for r in sigterm] == [(0, stopped)] * 2
  assert [r["exit_status"] for r in sigterm] == [errors.EXIT_STOPPED_EARLY] * 2
  assert 1 <= stopped < STEPS
  assert stopped in finalized_steps(workdir)
  assert f"stopping at step {stopped} after preemption" in (base / "sigterm_0.log").read_text()


def test_preempted_then_resumed(runs):
  _, _, part2, _, stopped = runs
  assert [(r["start_step"], r["step"]) for r in part2] == [(stopped, stopped + 2)] * 2
  assert [r["exit_status"] for r in part2] == [errors.EXIT_STOPPED_EARLY] * 2


def test_losses_and_evaluation_equal_single_process(runs):
  ref, sigterm, part2, _, stopped = runs
  expected = dict((s, l) for s, l in ref["losses"])
  assert sorted(expected) == list(range(1, stopped + 3))
  for group, steps in ((sigterm, range(1, stopped + 1)), (part2, [stopped + 1, stopped + 2])):
    for r in group:
      got = dict((s, l) for s, l in r["losses"])
      assert sorted(got) == list(steps)
      for s in steps:
        assert got[s] == pytest.approx(expected[s], abs=1e-5), (r["process_index"], s)
  for r in part2:  # evaluated at step S + 2
    assert r["eval"]["loss"] == pytest.approx(ref["eval"]["loss"], abs=1e-5)
    assert r["eval"]["num_tokens"] == ref["eval"]["num_tokens"] > 0


def test_each_process_reads_a_disjoint_half(runs):
  ref, sigterm, part2, _, stopped = runs
  assert len(ref["batches"]) == stopped + 2
  for group, offset, count in ((sigterm, 0, stopped), (part2, stopped, 2)):
    p0, p1 = group[0]["batches"], group[1]["batches"]
    assert len(p0) == len(p1) == count
    for j in range(count):
      assert len(p0[j]) == len(p1[j]) == 4  # 8 rows / 2 processes
      rows0 = {tuple(r) for r in p0[j]}
      rows1 = {tuple(r) for r in p1[j]}
      assert not rows0 & rows1, f"step {offset + j + 1}: processes share rows"
      assert p0[j] + p1[j] == ref["batches"][offset + j], f"step {offset + j + 1}"


def test_each_process_reads_only_its_input_shard(runs):
  """Per-host input: the two processes' sources served disjoint documents (each its own
  half of the epoch's shuffled order)."""
  _, sigterm, part2, _, _ = runs
  for group in (sigterm, part2):
    read = [set(r["documents_read"]) for r in group]
    assert read[0] and read[1] and not read[0] & read[1]


def test_process_0_alone_logs_and_writes_scalars(runs, base):
  """Every process reports its place in the job; progress, evaluation, TensorBoard
  scalars and the checkpoints of the two-process run are written once."""
  _, _, _, workdir, stopped = runs
  log = lambda name, i: (base / f"{name}_{i}.log").read_text()
  assert "JAX process 0/1, 8 local / 8 global devices" in log("ref", 0)
  for name in ("sigterm", "part2"):
    for i in range(2):
      assert f"JAX process {i}/2, 4 local / 8 global devices" in log(name, i)
  assert f"step {stopped}/{STEPS} | loss" in log("sigterm", 0)
  assert f"step {stopped + 2}/{STEPS} | loss" in log("part2", 0)
  assert f"eval @ step {stopped + 2} | loss" in log("part2", 0)
  for name in ("sigterm", "part2"):
    assert " | loss" not in log(name, 1)
  scalars = metrics_lib.read_scalars(f"{workdir}/tensorboard")
  # (step S + 3: the 1-process resume's)
  assert [s for s, _ in scalars["train/loss"]] == list(range(1, stopped + 4))
  assert [s for s, _ in scalars["eval/loss"]] == [stopped + 2]
  assert finalized_steps(workdir) == [stopped, stopped + 2, stopped + 3]


def test_two_process_checkpoint_resumes_on_one_process(runs, base):
  """The 2-process checkpoint on gs:// resumes on 1 process × 8 devices (its two input
  shards continue exactly), and no local directory named 'gs:' appears anywhere."""
  ref, _, _, workdir, stopped = runs
  assert ref["then"] == {"start_step": stopped + 2, "step": stopped + 3}
  assert finalized_steps(workdir)[-1] == stopped + 3
  assert "input shards, this run" not in (base / "ref_0.log").read_text()  # exact
  for root in {pathlib.Path.cwd(), ROOT, base}:
    assert not (root / "gs:").exists(), root
