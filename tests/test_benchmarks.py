"""Every benchmark runs end to end (at seconds size) and prints what it claims.

The measurements themselves are the benchmarks' job; these runs keep the scripts from
rotting between the occasions they are run for real (the GPU command of the README
included) and check that each reported figure is the one its own lines imply.
"""

import ast
import contextlib
import importlib
import io
import json
import math
import pathlib
import re
import subprocess
import sys
import types

from absl import flags as absl_flags
from absl import logging as absl_logging
from conftest import shared_data_path, shared_reference_path
import jax
import pytest

from benchmarks import any_n, common, quality
from benchmarks.adaptive_finetune import cli as adaptive_finetune
from benchmarks.single_epoch import cli as single_epoch
from input_pipeline import local_text, pipeline
from odetransformer import errors
from odetransformer.errors import UserError, describe
from odetransformer.model import config as config_lib
from odetransformer.tools import evaluate

from tiny import cpu_env, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM = r"([0-9][0-9,]*\.?[0-9]*)"
# The throughput tests' (and test_pipeline_speed's) sequence length: not the tiny preset's
# 32, so that each run shows it took --seq_len; short, so that nanoGPT's eager steps are.
SEQ = 16


def _launch(module, *args, timeout=600) -> subprocess.CompletedProcess:
  """`python -m benchmarks.<module> args...` from the repository root, as the README says
  (with the 'rbg' PRNG, as the in-process tests: what these runs check does not depend
  on the random numbers)."""
  return subprocess.run(
    [sys.executable, "-m", f"benchmarks.{module}", *args],
    cwd=str(ROOT),
    env=cpu_env(JAX_DEFAULT_PRNG_IMPL="rbg"),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def _run(module, *args, timeout=600) -> str:
  """stdout of a benchmark run that must succeed."""
  r = _launch(module, *args, timeout=timeout)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  return r.stdout


# The jax settings a benchmark's main may change (adaptive_finetune: its persistent cache
# and PRNG), restored after a run in this process.
_JAX_SETTINGS = (
  "jax_default_prng_impl",
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_persistent_cache_min_entry_size_bytes",
)


def _program(module):
  """What `python -m benchmarks.<module>` runs: the module, or a benchmark package's `cli`
  (its `__main__` runs `cli.main`)."""
  program = importlib.import_module(f"benchmarks.{module}")
  return program if hasattr(program, "main") else importlib.import_module(f"{program.__name__}.cli")


def _run_here(module, argv, monkeypatch, capsys) -> str:
  """stdout of `python -m benchmarks.<module> argv...` run in this process (no start-up of
  its own), with the 'rbg' PRNG as `_launch`; absl's verbosity, which the benchmarks
  lower, and the jax settings of `_JAX_SETTINGS` are restored after. For benchmarks that
  change no other global state."""
  main = _program(module).main
  monkeypatch.setattr(sys, "argv", [module, *argv])
  settings = {name: getattr(jax.config, name) for name in _JAX_SETTINGS}
  verbosity = absl_logging.get_verbosity()
  jax.config.update("jax_default_prng_impl", "rbg")
  try:
    main()
  finally:
    for name, value in settings.items():
      jax.config.update(name, value)
    absl_logging.set_verbosity(verbosity)
  return capsys.readouterr().out


def _num(text):
  return float(text.replace(",", ""))


def _find(pattern, out):
  m = re.search(pattern, out, re.MULTILINE)
  assert m, f"no line matching {pattern!r} in:\n{out}"
  return m


def _assert_printed_ratio(ratio, num, den, unit=0.01, ratio_unit=0.001, context=()):
  """`ratio`, printed to `ratio_unit`, is num / den of two values printed to `unit`: it
  lies within what the three roundings allow. (The quotient of the printed values,
  rounded again, can differ from it in the last digit: 507.74 / 500.97 prints as 1.014,
  the unrounded quotient as 1.013.)"""
  low = (num - unit / 2) / (den + unit / 2)
  high = (num + unit / 2) / max(den - unit / 2, 1e-9)
  assert low - ratio_unit / 2 <= ratio <= high + ratio_unit / 2, (ratio, num, den, *context)


def test_benchmarks_are_a_package_of_modules_named_apart_from_the_code():
  """Each runs as `python -m benchmarks.NAME` without patching sys.path: a module, or a
  package of its parts whose `__main__` runs `cli.main` and whose `__init__` imports
  nothing (`python -m` imports it before `__main__`, and common.py's huge-pages re-exec
  must see the program). No module or package is named like a package or module of the
  code it measures (a script run by path would import itself instead of it)."""
  bench = ROOT / "benchmarks"
  assert (bench / "__init__.py").is_file()
  packages = [p for p in bench.iterdir() if (p / "__init__.py").is_file()]
  assert {p.name for p in packages} >= {"single_epoch", "adaptive_finetune"}
  for package in packages:
    assert (package / "__main__.py").is_file() and (package / "cli.py").is_file(), package
    tree = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)], package
  files = [p for p in bench.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
  for path in files:
    assert "sys.path" not in path.read_text(encoding="utf-8"), path
  measured = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
  measured |= {
    p.stem for pkg in ("odetransformer", "input_pipeline") for p in (ROOT / pkg).rglob("*.py")
  }
  assert "memory" in measured and "input_pipeline" in measured
  assert not ({p.stem for p in files} | {p.name for p in packages}) & measured


@pytest.mark.slow
@pytest.mark.xdist_group("throughput")
def test_memory_vs_steps(monkeypatch, capsys):
  """At the throughput tests' dtype, length and remat (what is checked does not depend on
  them): its K = 2 train steps (batch 2) are then
  test_throughput_against_nanogpt_with_profile's second batch's (and test_pipeline_speed's
  DiffEqFormer step): each compiled once for all of them, through the persistent cache,
  on the same worker. The steps are lowered against the abstract state: no init runs."""
  out = _run_here(
    "memory_vs_steps",
    [
      "--preset=tiny",
      "--steps=2,4",
      "--dtype=bfloat16",
      f"--seq_len={SEQ}",
      "--remat=dots_saveable",
    ],
    monkeypatch,
    capsys,
  )
  rows = {
    (m.group(1), int(m.group(2))): (_num(m.group(3)), _num(m.group(4)))
    for m in re.finditer(
      rf"^(diffeqformer|transformer)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}$", out, re.MULTILINE
    )
  }
  assert set(rows) == {(k, n) for k in ("diffeqformer", "transformer") for n in (2, 4)}, out
  # The ODE's parameters (and so its arguments) do not depend on K; GPT's grow with L.
  assert rows["diffeqformer", 2][0] == rows["diffeqformer", 4][0]
  assert rows["transformer", 4][0] > rows["transformer", 2][0]
  _find(rf"^ode temp growth per step / scan carry: {NUM} \(gpt: {NUM}\)$", out)


@pytest.mark.slow
@pytest.mark.xdist_group("throughput")
def test_pipeline_speed(monkeypatch, capsys):
  """At bf16 and the throughput tests' length: its train step is then their tiny
  DiffEqFormer step at batch 2 (one compile, through the persistent cache, on the same
  worker). Run in this process (no process property is checked; the absl flags it marks
  parsed for grain's workers are unmarked after); 4 batches: the lines and their ratio
  are the same code at any count."""
  data = shared_data_path("wikitext-2", "valid.txt").parent
  parsed = absl_flags.FLAGS.is_parsed()
  try:
    out = _run_here(
      "pipeline_speed",
      [
        "--preset=tiny",
        "--dtype=bfloat16",
        f"--seq_len={SEQ}",
        "--batches=4",
        "--scaling_batch=4",
        f"--data_dir={data}",
      ],
      monkeypatch,
      capsys,
    )
  finally:
    if not parsed:
      absl_flags.FLAGS.unparse_flags()
  pipe = [
    _num(m.group(2))
    for m in re.finditer(
      rf"^pipeline workers=(0|2): {NUM} tokens/s \(4 batches of 2x{SEQ}", out, re.MULTILINE
    )
  ]
  assert len(pipe) == 2, out
  train = _num(_find(rf"^train step \(tiny DiffEqFormer, cpu\): {NUM} tokens/s", out).group(1))
  ratio = _num(_find(rf"^pipeline/train tokens/s ratio: {NUM}$", out).group(1))
  assert ratio == pytest.approx(min(pipe) / train, rel=0.01, abs=0.06)


@pytest.mark.slow
@pytest.mark.xdist_group("d32_runs")
def test_quality(tmp_path, monkeypatch, capsys):
  """One seed of both models on a user's own text files: the seed's ratio is its two
  perplexities' ratio, and the last line is the seeds' mean. (Its DiffEqFormer is
  test_any_n's 'fixed' run's model, optimizer and batch, and both models are
  test_adaptive_finetune's pre-training runs': those tests, on the same worker, read their
  programs from the persistent compilation cache.)"""
  text = pathlib.Path(shared_data_path("wikitext-2", "test.txt")).read_text(encoding="utf-8")
  (tmp_path / "train.txt").write_text(text[:150_000], encoding="utf-8")  # 2 steps of 2 × 32
  (tmp_path / "eval.txt").write_text(text[150_000:190_000], encoding="utf-8")
  out = _run_here(
    "quality",
    [
      "--seeds=1",
      "--steps=2",
      "--eval_batches=1",
      "--batch=2",
      "--seq_len=32",
      "--d_model=32",
      "--num_heads=4",  # adaptive_finetune's (fixed there): test_adaptive_finetune's model
      "--depth=2",
      "--time_embed_dim=8",
      "--vocab=512",
      f"--train_text={tmp_path / 'train.txt'}",
      f"--eval_text={tmp_path / 'eval.txt'}",
      f"--workdir={tmp_path / 'runs'}",
    ],
    monkeypatch,
    capsys,
  )
  ratios = []
  for seed in (0,):
    ppl = {}
    for kind in ("diffeqformer", "transformer"):
      m = _find(
        rf"^seed {seed} {kind}\s+gpt2\s+params\s+{NUM} \| train loss {NUM} -> {NUM} \| "
        rf"test loss {NUM} \| test ppl {NUM} \|",
        out,
      )
      loss, ppl[kind] = _num(m.group(4)), _num(m.group(5))
      assert ppl[kind] == pytest.approx(math.exp(loss), rel=1e-3)
    ratio = _num(
      _find(rf"^seed {seed} diffeqformer/gpt test perplexity ratio: {NUM}$", out).group(1)
    )
    assert ratio == pytest.approx(ppl["diffeqformer"] / ppl["transformer"], abs=0.002)
    ratios.append(ratio)
  last = re.fullmatch(
    rf"diffeqformer/gpt test perplexity ratio: {NUM} \(mean of 1 seeds, "
    r"steps 2\)",
    out.strip().splitlines()[-1],
  )
  assert last and _num(last.group(1)) == pytest.approx(sum(ratios) / len(ratios), abs=0.002)


@pytest.mark.slow
@pytest.mark.xdist_group("d32_runs")
def test_adaptive_finetune(tmp_path, monkeypatch, capsys):
  """The discrete methods only: 'continuous' runs the same lines of the benchmark (the
  loop's continuous fine-tuning: test_finetune). Run in this process (no process
  property is checked; the jax settings it changes are restored). Its pre-training runs
  are test_quality's two models and optimizer (heads and mlp width are fixed here: that
  test takes them), so their programs come from the persistent compilation cache."""
  data = shared_data_path("tinyshakespeare", "input.txt").parents[1]
  shared_data_path("wikitext-2", "test.txt")
  out = _run_here(
    "adaptive_finetune",
    [
      f"--data_dir={data}",
      f"--out={tmp_path}",
      "--seeds=1",
      "--k=2",
      "--steps=2",
      "--d_model=32",
      "--time_embed_dim=8",  # d_t, S and b2: test_quality's DiffEqFormer and optimizer
      "--time_sinusoids=128",
      "--b2=0.95",
      "--gpt_layers=2",  # test_quality's GPT (the default, round(4K/3), is checked below)
      "--seq_len=32",
      "--batch=2",
      "--vocab=512",
      "--pretrain_steps=2",
      "--finetune_steps=2",
      "--eval_batches=1",
      "--pretrain_grids=fixed",  # a second grid repeats the same code: minutes of CPU
      "--methods=full,lora",
    ],
    monkeypatch,
    capsys,
  )
  table = (tmp_path / "adaptive_finetune.md").read_text()
  assert (tmp_path / "adaptive_finetune.png").stat().st_size > 0
  assert "GPT 2 layers" in table and "LoRA r 6 alpha 8" in table  # --gpt_layers, 200·d/1024
  # Without --gpt_layers, the GPT has round(4K/3) layers (the paper's 24 vs K = 18).
  assert adaptive_finetune.parse_args([f"--data_dir={data}", "--k=2"]).gpt_layers == 3
  ode = {
    (m.group(1), m.group(2)): [_num(v) for v in m.group(3).split(" | ")]
    for m in re.finditer(r"^\| DiffEqFormer (\S+) (\S+) \| (.*) \|$", table, re.MULTILINE)
  }
  gpt = {
    m.group(1): _num(m.group(2))
    for m in re.finditer(rf"^\| GPT \(2 layers\) (\S+) \| {NUM} \|$", table, re.MULTILINE)
  }
  grids, methods = ("fixed",), ("before", "full", "lora")
  assert sorted(ode) == sorted((g, m) for g in grids for m in methods), table
  assert sorted(gpt) == ["before", "full", "lora"], table
  assert all(len(v) == 1 for v in ode.values()), table  # N = K only (--steps=2)
  assert all(math.isfinite(v) and v > 1 for v in sum(ode.values(), []) + list(gpt.values()))
  m = _find(
    rf"^diffeqformer/gpt fine-tuned perplexity ratio at N=2: fixed: full {NUM}, "
    rf"lora {NUM} \(mean of 1 seeds\)$",
    out,
  )
  for i, (grid, method) in enumerate([(g, m) for g in grids for m in ("full", "lora")], 1):
    assert _num(m.group(i)) == pytest.approx(ode[grid, method][0] / gpt[method], abs=0.002)


def _usage_error(module, argv, monkeypatch, capsys) -> str:
  """The error line of a benchmark given `argv`, run in this process: the flag check
  raises a UserError before anything is built, which `errors.run_cli` prints as this
  one stderr line (exit 2)."""
  with pytest.raises(UserError) as e:
    _run_here(module, argv, monkeypatch, capsys)
  return f"error: {describe(e.value)}"


def test_adaptive_finetune_needs_its_texts(tmp_path, monkeypatch, capsys):
  assert _usage_error("adaptive_finetune", [f"--out={tmp_path}"], monkeypatch, capsys).endswith(
    "error: --pretrain_train='' is not a file; pass it, or --data_dir=DIR with "
    "wikitext-2/valid.txt in DIR"
  )


def _check_train_lines(block, kinds, batch, seq, rounds) -> tuple:
  """Checks one batch's lines of `benchmarks.throughput` (each kind's train line, each
  --also kind's ratio, the per-round spread of ode/gpt); returns kind -> tokens/s and
  the spread's (lowest, highest) ratio."""
  tps = {}
  for kind in kinds:
    m = _find(rf"^{kind}\s+train:\s+{NUM} ms/step\s+{NUM} tokens/s MFU\s+{NUM}%", block)
    ms, tps[kind] = _num(m.group(1)), _num(m.group(2))
    # ms is printed to 0.1, tokens/s to 1: tokens/s = batch·seq / s within that rounding.
    tokens = batch * seq
    assert tokens / ((ms + 0.05) / 1e3) - 1 <= tps[kind] <= tokens / ((ms - 0.05) / 1e3) + 1
    assert 0 < _num(m.group(3)) < 100
  for kind in kinds[2:]:  # the --also kinds
    m = _find(rf"^{kind}/gpt train tokens/s ratio: {NUM} \(per round: median", block)
    assert _num(m.group(1)) == pytest.approx(tps[kind] / tps["transformer"], abs=0.006)
  # Elementwise gpt_i >= r_min * ode_i keeps the medians' ratio inside the per-round range.
  spread = _find(
    rf"^ode/gpt train ratio per round: median {NUM}, quartiles {NUM}–{NUM}, "
    rf"range {NUM}–{NUM} over {rounds} rounds$",
    block,
  )
  lo, q1, q2, q3, hi = (_num(spread.group(i)) for i in (4, 2, 1, 3, 5))
  assert lo <= q1 <= q2 <= q3 <= hi
  return tps, (lo, hi)


def _check_forward_lines(out):
  fwd = {
    name: _num(_find(rf"^{name}\s+forward:\s+{NUM} ms\s+{NUM} tokens/s", out).group(2))
    for name in ("materialised", "transformer")
  }
  ratio = _num(_find(rf"^materialised/gpt forward tokens/s ratio: {NUM}$", out).group(1))
  assert ratio == pytest.approx(fwd["materialised"] / fwd["transformer"], abs=0.006)


@pytest.mark.slow
@pytest.mark.xdist_group("throughput")
def test_throughput_against_nanogpt_with_profile(monkeypatch, capsys):
  """The GPU comparison's flags at toy size (bf16, as the README's GPU commands): two
  batches, nanoGPT's own step (its model.py from the shared reference checkout, eager on
  CPU, 2 timed rounds of 1 step) timed in the same run, each ratio what the lines
  beside it imply, and a profile per model and batch whose parts add up. (At
  test_throughput's length, 16 tokens: its batch is this run's first, whose programs one
  of the two compiles for both; this run's second batch's are test_memory_vs_steps' K = 2
  train steps: on the same worker, through the persistent compilation cache.)"""
  nanogpt = shared_reference_path("nanogpt")
  pytest.importorskip("torch")
  kinds, batches, seq = ("diffeqformer", "transformer"), (1, 2), SEQ
  out = _run_here(
    "throughput",
    [
      "--preset=tiny",
      "--rounds=2",
      "--dtype=bfloat16",
      f"--seq_len={seq}",
      "--batches=1,2",
      f"--nanogpt={nanogpt}",
      "--nanogpt_rounds=2",
      "--nanogpt_steps_per_round=1",
      "--profile",
      "--profile_steps=2",
    ],
    monkeypatch,
    capsys,
  )
  blocks = re.split(r"^-- ", out, flags=re.MULTILINE)[1:]
  assert [b.split(",")[:2] for b in blocks] == [
    [f"batch {b} × seq {seq}", " bfloat16"] for b in batches
  ]
  _check_forward_lines(blocks[0])  # timed once, at the first batch
  headline = {}
  for b, block in zip(batches, blocks):
    tps, (lo, hi) = _check_train_lines(block, kinds, b, seq, rounds=2)
    tps["nanogpt"] = _num(
      _find(rf"^nanogpt\s+train:\s+{NUM} ms/step\s+{NUM} tokens/s", block).group(2)
    )
    assert "(torch " in _find(r"^nanogpt\s+train:.*$", block).group(0)
    for kind in ("diffeqformer", "transformer"):
      ratio = _num(_find(rf"^{kind}/nanogpt train tokens/s ratio: {NUM}$", block).group(1))
      # tokens/s are printed to 1 (±0.5: slow eager steps print small numbers), the ratio
      # to 0.01: it lies between the ratios the printed values' ends allow.
      low = (tps[kind] - 0.5) / (tps["nanogpt"] + 0.5)
      high = (tps[kind] + 0.5) / (tps["nanogpt"] - 0.5)
      assert low - 0.005 <= ratio <= high + 0.005
      m = _find(
        rf"^profile {kind} {b}×{seq}: step {NUM} ms = matmul {NUM} ms \({NUM}%\) \| "
        rf"attention {NUM} ms \({NUM}%\) \| other fusions {NUM} ms \({NUM}%\) \| "
        rf"copies {NUM} ms \({NUM}%\) \| idle {NUM} ms \({NUM}%\)$",
        block,
      )
      step, idle = _num(m.group(1)), _num(m.group(10))
      busy = _num(
        _find(
          rf"^profile {kind} {b}×{seq}: {NUM} copies per step, {NUM} of them "
          rf"≥ 1 MiB; device busy {NUM} ms$",
          block,
        ).group(3)
      )
      assert _num(m.group(2)) > 0  # the model's dots were found
      assert idle == pytest.approx(max(0.0, step - busy), abs=0.02)
    headline[b] = tps["diffeqformer"] / tps["transformer"]
    assert lo - 0.006 <= headline[b] <= hi + 0.006
  last = out.strip().splitlines()[-1]
  m = re.fullmatch(rf"ode/gpt train tokens/s ratio: {NUM} \(batch 1\), {NUM} \(batch 2\)", last)
  assert m, last
  assert [_num(m.group(1)), _num(m.group(2))] == pytest.approx(
    [headline[1], headline[2]], abs=0.006
  )


@pytest.mark.slow
@pytest.mark.xdist_group("throughput")
def test_throughput(monkeypatch, capsys):
  """The README's GPU command's flags (bf16, its batch and length), plus a baseline kind.
  (Its length, 16, is not the preset's; test_throughput_against_nanogpt_with_profile's
  first batch is this shape, whose programs are compiled once for both.)"""
  batch, seq, dtype = 1, SEQ, "bfloat16"
  out = _run_here(
    "throughput",
    [
      "--preset=tiny",
      "--rounds=2",
      "--also=shared",
      f"--dtype={dtype}",
      f"--seq_len={seq}",
      f"--batch={batch}",
    ],
    monkeypatch,
    capsys,
  )
  assert f"batch {batch} × seq {seq}, {dtype}" in out
  kinds = ("diffeqformer", "transformer", "shared")
  tps, (lo, hi) = _check_train_lines(out, kinds, batch, seq, rounds=2)
  _check_forward_lines(out)
  last = out.strip().splitlines()[-1]
  m = re.fullmatch(rf"ode/gpt train tokens/s ratio: {NUM}", last)
  assert m, last
  headline = _num(m.group(1))
  assert headline == pytest.approx(tps["diffeqformer"] / tps["transformer"], abs=0.006)
  assert lo - 0.006 <= headline <= hi + 0.006


def test_throughput_rejects_a_missing_nanogpt(tmp_path, monkeypatch, capsys):
  assert _usage_error(
    "throughput", ["--preset=tiny", f"--nanogpt={tmp_path}"], monkeypatch, capsys
  ).endswith(f"error: --nanogpt={tmp_path} holds no model.py; pass a checkout of karpathy/nanoGPT")


def test_throughput_rejects_an_unknown_kind(monkeypatch, capsys):
  assert _usage_error(
    "throughput", ["--preset=tiny", "--also=parallel,gtp"], monkeypatch, capsys
  ).endswith("error: --also=gtp: choose from parallel, shared")


@pytest.mark.slow
@pytest.mark.xdist_group("d32_runs")
def test_any_n(tmp_path, monkeypatch, capsys):
  """One tiny seed of today's default and one candidate: the table's means are the
  seed's rows, each ratio is what the table implies, both were timed, the PNG is
  written, and the last line is the chosen candidate's ratio. Run in this process (no
  process property is checked)."""
  out = _run_here(
    "any_n",
    [
      "--seeds=1",
      "--steps=2",
      "--solver_steps=2",
      "--d_model=32",
      "--num_heads=4",  # and S the config's: test_quality's and test_adaptive_finetune's model
      "--time_embed_dim=8",
      "--seq_len=32",
      "--batch=2",
      "--vocab=512",
      "--tokenizer_sample_bytes=300000",
      "--eval_batches=1",
      "--rounds=1",
      "--candidates=shift_half",
      f"--workdir={tmp_path}",
    ],
    monkeypatch,
    capsys,
  )
  counts = (1, 2, 4, 8, 16)  # K/2, K, 2K, 4K, 8K for K = 2
  rows = {}
  for c in ("fixed", "shift_half"):
    m = _find(
      rf"^seed 0 {c}\s+train loss {NUM} -> {NUM} \| ppl "
      + r" \| ".join(rf"N={n} {NUM}" for n in counts)
      + rf" \| max ratio {NUM} \|",
      out,
    )
    seed_row = [_num(m.group(i)) for i in range(3, 8)]
    cells = r" \| ".join([rf"{NUM} ± {NUM}"] * 5)
    m = _find(rf"^\| {c} \| {cells} \| {NUM} \| {NUM} \| {NUM} \| {NUM} \| (met|not met) \|$", out)
    g = [_num(m.group(i)) for i in range(1, 15)]
    row, std = g[0:10:2], g[1:10:2]
    assert row == pytest.approx(seed_row, abs=0.006) and std == [0.0] * 5  # one seed
    finer, half, k_cost, step = g[10:14]
    assert finer == pytest.approx(max(row[2], row[3]) / row[1], abs=2e-3)
    assert half == pytest.approx(row[0] / row[1], abs=2e-3)
    rows[c] = (row, finer, k_cost, step)
    assert all(math.isfinite(v) and v > 1 for v in row)
  assert rows["fixed"][2] == 1.0 and rows["fixed"][3] == 1.0
  assert rows["shift_half"][2] == pytest.approx(
    rows["shift_half"][0][1] / rows["fixed"][0][1], abs=2e-4
  )
  m = _find(
    rf"^train step seconds \(median of 1 interleaved rounds\): fixed {NUM} ms, "
    rf"shift_half {NUM} ms$",
    out,
  )
  assert rows["shift_half"][3] == pytest.approx(_num(m.group(2)) / _num(m.group(1)), abs=0.02)
  assert (tmp_path / "any_n.png").stat().st_size > 0
  last = re.fullmatch(
    rf"any-N: chosen (fixed|shift_half): max\(ppl\(2K\), ppl\(4K\)\) / ppl\(K\) = {NUM}",
    out.strip().splitlines()[-1],
  )
  assert last and _num(last.group(2)) == pytest.approx(rows[last.group(1)][1], abs=6e-4)


def test_any_n_times_each_candidate_on_its_own_fields(tmp_path, monkeypatch):
  """Every candidate is BASE with its own changes, in its runs and in its timing, whatever
  configs/default.py sets and whichever candidate's config the timing is given (the last
  run's): 'fixed' is timed without the penalty another candidate's config carries."""
  timed = {}

  class FakeTrainer:
    def __init__(self, cfg, seed):
      self.cfg = cfg

    def batch(self, b, length):
      return None

    def step(self, batch):
      return None

  def fake_alternating(fns, rounds):
    return {c: 1.0 for c in fns}

  monkeypatch.setattr(common, "Trainer", FakeTrainer)
  monkeypatch.setattr(common, "time_alternating", fake_alternating)
  monkeypatch.setattr(
    any_n.default, "get_config", _with_model(any_n.default.get_config, local_error_weight=5.0)
  )
  args = any_n.parse_args(["--steps=4", "--solver_steps=2"])
  names = ["fixed", "random_shift", "local_error_3000"]
  config = any_n.make_config(args, "local_error_3000", 0, str(tmp_path / "cache"))
  real_trainer = FakeTrainer.__init__

  def record(self, cfg, seed):
    real_trainer(self, cfg, seed)
    timed[len(timed)] = cfg

  monkeypatch.setattr(FakeTrainer, "__init__", record)
  any_n.step_seconds(config, 1, names)
  for name, cfg in zip(names, timed.values()):
    want = {**any_n.BASE, **any_n.CANDIDATES[name]}
    assert {k: getattr(cfg, k) for k in want} == want, name
    run = any_n.make_config(args, name, 0, str(tmp_path / "cache")).model
    assert {k: run[k] for k in want} == want, name


def _with_model(get_config, **fields):
  def patched():
    c = get_config()
    for k, v in fields.items():
      setattr(c.model, k, v)
    return c

  return patched


def test_any_n_chooses_the_candidate_that_meets_every_target():
  """The lowest ppl(K) among the candidates within every target; today's default when
  none is."""

  def rows(k, half, finer):
    return [{"K/2": k * half, "K": k, "2K": k * finer, "4K": k, "8K": k * 2}]

  seconds = {"fixed": 1.0, "a": 1.05, "b": 1.05, "c": 1.2, "d": 1.0}
  ppl = {
    "fixed": rows(100.0, 1.0, 1.5),
    "a": rows(100.9, 1.05, 1.02),  # meets every target
    "b": rows(100.5, 1.05, 1.02),  # meets them too, lower ppl(K): chosen
    "c": rows(99.0, 1.0, 1.0),  # too slow a step
    "d": rows(101.5, 1.0, 1.0),  # costs more than 1% at K
  }
  summary = any_n.summarise(ppl, seconds)
  assert [c for c, s in summary.items() if s["meets"]] == ["a", "b"]
  assert summary["fixed"]["ratios"]["finer"] == 1.5
  assert any_n.choose(summary) == "b"
  del ppl["a"], ppl["b"]
  assert any_n.choose(any_n.summarise(ppl, seconds)) == "fixed"


@pytest.mark.slow
def test_checkpoint_integrity(monkeypatch, capsys):
  """Run in this process: each ratio is what the printed seconds imply, in any process."""
  out = _run_here("checkpoint_integrity", ["--gib=0.004", "--repeats=1"], monkeypatch, capsys)
  rows = {}
  for what in ("save", "restore"):
    for kind in ("wall", "cpu"):
      m = _find(rf"^{what} {kind} s\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}×\s+{NUM}×$", out)
      base, integrity, _, ratio, _ = map(_num, m.groups())
      # The seconds and the ratio are printed to 0.01.
      _assert_printed_ratio(ratio, integrity, base, ratio_unit=0.01, context=(what, kind, out))
      rows[what, kind] = ratio
  m = _find(
    rf"^integrity overhead: save {NUM}×, restore {NUM}× wall; save {NUM}×, "
    rf"restore {NUM}× CPU",
    out,
  )
  assert tuple(map(_num, m.groups())) == tuple(
    rows[k] for k in (("save", "wall"), ("restore", "wall"), ("save", "cpu"), ("restore", "cpu"))
  )


def test_step_time_and_llama_block_flags_reach_the_runs(tmp_path):
  """quality's --step_time/--llama_block set the DiffEqFormer's model fields (the
  baseline keeps the standard block); any_n's --step_time sets both modes'."""
  text = tmp_path / "t.txt"
  text.write_text("x", encoding="utf-8")
  files = [f"--train_text={text}", f"--eval_text={text}"]
  args = quality.parse_args(
    ["--family=llama", "--llama_block=reference", "--step_time=end"] + files
  )
  ode = config_lib.model_config(quality.make_config(args, "diffeqformer", 0, "c"))
  assert (ode.llama_block, ode.step_time) == ("reference", "end")
  assert (
    config_lib.model_config(quality.make_config(args, "transformer", 0, "c")).llama_block == "paper"
  )
  # Runs of hours resume: checkpoints every --checkpoint_every steps (default 100).
  assert quality.make_config(args, "diffeqformer", 0, "c").checkpoint_every_steps == 100
  args = quality.parse_args(["--checkpoint_every=7"] + files)
  assert quality.make_config(args, "transformer", 0, "c").checkpoint_every_steps == 7
  with pytest.raises(UserError, match=r"^--llama_block=reference needs --family=llama; "):
    quality.parse_args(["--llama_block=reference"] + files)  # family gpt
  args = any_n.parse_args(["--candidates=smooth_t_shift_half", "--step_time=end"])
  assert args.candidates == ["fixed", "smooth_t_shift_half"]
  for c, (grid, fraction, scale) in zip(
    args.candidates, [("fixed", 1.0, 1000.0), ("random_shift", 0.5, 10.0)]
  ):
    cfg = config_lib.model_config(any_n.make_config(args, c, 0, "c"))
    assert (cfg.train_time_grid, cfg.train_time_grid_fraction, cfg.time_scale) == (
      grid,
      fraction,
      scale,
    )
    assert cfg.step_time == "end"


def test_code_version_is_a_hash_of_the_sources(tmp_path):
  """The same .py files (anywhere) give the same version; a one-byte edit of any of them,
  or a new one, another; other files do not count."""
  trees = [tmp_path / "a", tmp_path / "b"]
  for root in trees:
    for tree in common.CODE_TREES:
      (root / tree / "sub").mkdir(parents=True)
      (root / tree / "sub" / "m.py").write_text(f"X = '{tree}'\n")
  a, b = (common.code_version.__wrapped__(str(root)) for root in trees)
  assert a == b and re.fullmatch(r"[0-9a-f]{12}", a)
  (trees[1] / "configs" / "notes.md").write_text("not code")
  assert common.code_version.__wrapped__(str(trees[1])) == a
  (trees[1] / "benchmarks" / "sub" / "m.py").write_text("X = 'benchmarkz'\n")
  edited = common.code_version.__wrapped__(str(trees[1]))
  (trees[0] / "input_pipeline" / "new.py").write_text("")
  assert len({a, edited, common.code_version.__wrapped__(str(trees[0]))}) == 3
  assert re.fullmatch(r"[0-9a-f]{12}", common.code_version())  # this repository's


def _fake_training(monkeypatch, calls):
  """train.train_and_evaluate as the benchmarks see it, without training: a 'checkpoint'
  file holds the step a run reached; a call resumes from it and trains to the end."""

  def fake(config, workdir, stop_at_step=0):
    del stop_at_step
    ckpt, signal = pathlib.Path(workdir, "ckpt"), pathlib.Path(f"{workdir}.sigterm_at")
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    step = config.num_train_steps
    if signal.exists():  # SIGTERM arrives at this step: saved there, stopped
      step = int(signal.read_text())
      signal.unlink()
    ckpt.write_text(str(step))
    calls.append((workdir, start))
    hist = [(s, 5.0 - s) for s in range(start + 1, step + 1)]
    return {
      "start_step": start,
      "step": step,
      "loss_history": hist,
      "eval": {"perplexity": 100.0 + start},
      "preempted": step < config.num_train_steps,
    }

  monkeypatch.setattr(common.loop, "train_and_evaluate", fake)


def test_keyed_run_reuses_a_workdir_only_under_the_same_code_and_config(
  tmp_path, monkeypatch, capsys
):
  calls = []
  _fake_training(monkeypatch, calls)
  wd, code = str(tmp_path / "run"), common.code_version()
  config = tiny_config(tmp_path / "cache", 4)
  assert common.keyed_run(config, wd)[1] == ""  # trained now
  assert json.loads((tmp_path / "run" / common.RUN_KEY_FILE).read_text()) == common.run_key(config)
  _, note = common.keyed_run(config, wd)  # finished: reused
  assert note == f"read back from {wd} (code {code}, trained earlier: 4 steps)"
  (tmp_path / "run" / "ckpt").write_text("2")  # interrupted at 2
  assert common.keyed_run(config, wd)[1] == f"resumed at step 2 of 4 from {wd} (code {code})"
  assert [start for _, start in calls] == [0, 4, 2]
  # Another config (here the schedule's length): moved aside, trained afresh.
  longer = tiny_config(tmp_path / "cache", 6)
  assert common.keyed_run(longer, wd)[1] == "" and calls[-1] == (wd, 0)
  assert (tmp_path / f"run.stale-{code}" / "ckpt").read_text() == "4"  # kept, not deleted
  assert (
    f"{wd} was made under another config: moved to {wd}.stale-{code}, training afresh (code {code})"
  ) in capsys.readouterr().out
  # Other code (the same config): moved aside too.
  monkeypatch.setattr(common, "code_version", lambda: "0123456789ab")
  assert common.keyed_run(longer, wd)[1] == "" and calls[-1] == (wd, 0)
  assert (tmp_path / f"run.stale-{code}-1" / "ckpt").read_text() == "6"
  assert f"made under code {code}: moved" in capsys.readouterr().out
  # A run from before keys (no key file) is not trusted either.
  (tmp_path / "run" / common.RUN_KEY_FILE).unlink()
  assert common.keyed_run(longer, wd)[1] == "" and calls[-1] == (wd, 0)
  assert (tmp_path / "run.stale-unkeyed" / "ckpt").exists()
  # A fine-tuning run's key holds its init run's key: a retrained init changes it.
  ft = tiny_config(tmp_path / "cache", 2)
  ft.init_from = wd
  assert common.run_key(ft)["init_from"] == common.run_key(longer)


def _any_n_without_training(tmp_path, monkeypatch):
  """(calls, scored, config): any_n's 'fixed' run of 4 steps at K = 2 with training and
  scoring faked; `calls` the training calls (workdir, start step), `scored` the scored
  workdirs."""
  calls, scored = [], []
  _fake_training(monkeypatch, calls)

  def fake_evaluate(workdir, counts, max_batches):
    scored.append(workdir)
    return [types.SimpleNamespace(perplexity=50.0 + n, num_tokens=1000) for n in counts]

  monkeypatch.setattr(any_n.evaluation, "evaluate", fake_evaluate)
  args = any_n.parse_args(["--steps=4", "--solver_steps=2", "--rounds=0"])
  return calls, scored, any_n.make_config(args, "fixed", 0, str(tmp_path / "cache"))


def test_a_stopped_run_ends_the_benchmark_unscored_and_resumes(tmp_path, monkeypatch, capsys):
  """A run that SIGTERM stops mid-way (its checkpoint saved) is not scored as if trained:
  the benchmark ends with status 75 (as main.py), and the same command resumes it."""
  calls, scored, config = _any_n_without_training(tmp_path, monkeypatch)
  wd, code = tmp_path / "fixed_seed0", common.code_version()
  (tmp_path / "fixed_seed0.sigterm_at").write_text("1")
  with pytest.raises(SystemExit) as stopped:
    any_n.train_and_score(config, str(wd), 16)
  assert stopped.value.code == errors.EXIT_STOPPED_EARLY and scored == []
  assert f"{wd}: stopped at step 1 of 4 (SIGTERM or Ctrl-C)" in capsys.readouterr().out
  assert not (wd / "any_n_scores.json").exists()
  _, line = any_n.train_and_score(config, str(wd), 16)
  assert calls == [(str(wd), 0), (str(wd), 1)] and scored == [str(wd)]
  assert line.startswith(f"resumed at step 1 of 4 from {wd} (code {code}), scored now | ppl N=1")


def test_any_n_scores_are_read_back_only_for_the_same_code(tmp_path, monkeypatch):
  calls, scored, config = _any_n_without_training(tmp_path, monkeypatch)
  wd, code = str(tmp_path / "fixed_seed0"), common.code_version()
  row, line = any_n.train_and_score(config, wd, 16)
  assert (
    line.startswith("train loss 4.000 -> 1.000 | ppl N=1 51.00 | N=2 52.00") and len(scored) == 1
  )
  again, line = any_n.train_and_score(config, wd, 16)
  assert again == row and len(scored) == 1
  assert line.startswith(
    f"read back from {wd}/any_n_scores.json (code {code}, trained earlier: 4 steps) | ppl N=1 51.00"
  )
  _, line = any_n.train_and_score(config, wd, 8)  # other eval batches
  assert len(scored) == 2 and line.startswith(
    f"read back from {wd} (code {code}, trained earlier: 4 steps), scored now | ppl"
  )
  monkeypatch.setattr(common, "code_version", lambda: "0123456789ab")
  _, line = any_n.train_and_score(config, wd, 8)  # other code: afresh
  assert len(scored) == 3 and calls[-1] == (wd, 0) and line.startswith("train loss")


def test_any_n_tables_the_seeds_of_several_workdirs_as_one_run(tmp_path, monkeypatch, capsys):
  """Seeds trained in two workdirs (processes or machines) and tabulated with --rows give
  the table one process training every seed gives, without training again; a row of
  other code or another config, or a missing seed, is refused by name."""
  calls = []
  _fake_training(monkeypatch, calls)

  def fake_evaluate(workdir, counts, max_batches):  # a seed's and a candidate's own row
    seed = int(workdir.rsplit("seed", 1)[1])
    shift = 7.0 if "random_shift" in workdir else 0.0
    return [
      types.SimpleNamespace(perplexity=50.0 + n + 3.0 * seed**2 + shift, num_tokens=1000)
      for n in counts
    ]

  monkeypatch.setattr(any_n.evaluation, "evaluate", fake_evaluate)
  flags = ["--steps=4", "--solver_steps=2", "--rounds=0", "--candidates=random_shift"]

  def run(name, *more):
    any_n.main([*flags, f"--workdir={tmp_path / name}", *more])
    out = capsys.readouterr().out
    return out, [line for line in out.splitlines() if line.startswith("| ")]

  _, whole = run("all", "--seeds=3")
  assert len(calls) == 6
  run("a", "--seeds=2")
  run("b", "--seeds=1", "--first_seed=2")
  del calls[:]
  rows = f"--rows={tmp_path / 'a' / any_n.ROWS_FILE},{tmp_path / 'b' / any_n.ROWS_FILE}"
  out, merged = run("c", "--seeds=0", rows)
  assert merged == whole and calls == []
  assert "perplexity, mean ± std of seed(s) 0, 1, 2;" in out
  # The merged workdir's own rows file holds every row: it alone tabulates them again.
  _, again = run("d", "--seeds=0", f"--rows={tmp_path / 'c' / any_n.ROWS_FILE}")
  assert again == whole
  # --seeds=3 with the rows of seeds 0-1: only seed 2 is trained.
  out, table = run("e", "--seeds=3", f"--rows={tmp_path / 'a' / any_n.ROWS_FILE}")
  assert table == whole and sorted(w for w, _ in calls) == [
    str(tmp_path / "e" / f"{c}_seed2") for c in ("fixed", "random_shift")
  ]
  assert "seed 1 random_shift         read from --rows: ppl N=1 " in out
  with pytest.raises(
    UserError, match=r"no row for shift_half seed 0, shift_half seed 1, shift_half seed 2: "
  ):
    run("f", "--seeds=0", rows, "--candidates=random_shift,shift_half")
  with pytest.raises(UserError, match=r"x.json is not an any_n rows file"):
    run("f", "--seeds=0", f"--rows={tmp_path / 'x.json'}")
  with pytest.raises(
    UserError,
    match=r"a/any_n_rows.json's fixed seed 0 was made under "
    r"another run: config.num_train_steps 4 \(file\) != 6 \(this command\)",
  ):
    any_n.main([*flags[1:], "--steps=6", f"--workdir={tmp_path / 'f'}", "--seeds=0", rows])
  monkeypatch.setattr(common, "code_version", lambda: "0123456789ab")
  with pytest.raises(UserError, match=r"another run: code '.{12}' \(file\) != '0123456789ab'"):
    run("f", "--seeds=0", rows)


def _single_epoch_text(tmp_path):
  """A small wikipedia-2015 layout: two training files, valid and test."""
  wiki = shared_data_path("wikipedia-2015")
  data = tmp_path / "data"
  data.mkdir()
  for name, chars in (
    ("train-00.txt", 30_000),
    ("train-01.txt", 30_000),
    ("valid.txt", 6_000),
    ("test.txt", 6_000),
  ):
    text = (wiki / name).read_text(encoding="utf-8")[:chars]
    (data / name).write_text(text, encoding="utf-8")
  return data


@pytest.fixture(scope="module")
def single_epoch_runs(tmp_path_factory):
  """Tiny single-epoch runs of both models, 4 steps (not a real run's hundreds: the same
  code paths in seconds), scored and checkpointed every 2: one command stopped at step 2
  (--stop_after), then the same command without it, which continues. Both the resume
  test and the any-N / fine-tuning stages (which start from these runs' checkpoints)
  read them: the runs are trained once per module, not once per test."""
  tmp = tmp_path_factory.mktemp("single_epoch")
  data = _single_epoch_text(tmp)
  flags = [
    f"--data_dir={data}",
    f"--workdir={tmp / 'runs'}",
    "--preset=tiny",
    "--steps=4",
    "--eval_every=2",
    "--checkpoint_every=2",
    "--eval_batches=1",
    "--curve_batches=1",
    "--log_every=2",
  ]
  outs = []
  for argv in (flags + ["--stop_after=2"], flags):
    with contextlib.redirect_stdout(io.StringIO()) as out:
      single_epoch.main(argv)
    outs.append(out.getvalue())
  return types.SimpleNamespace(
    tmp=tmp, data=data, runs=tmp / "runs", flags=flags, first=outs[0], out=outs[1]
  )


@pytest.mark.slow
@pytest.mark.xdist_group("single_epoch")
def test_single_epoch_resumes_and_serves_no_token_twice(single_epoch_runs):
  """Tiny shape, 4 steps (not a real run's hundreds: the same code paths in seconds), scored
  every 2: a run stopped at step 2 continues there (its step-2 scores read back, not
  retrained), the table and the last line are the scored lines', and a step count past
  one epoch is refused at exactly the count the run announced."""
  data, flags, runs = single_epoch_runs.data, single_epoch_runs.flags, single_epoch_runs.runs
  first, out = single_epoch_runs.first, single_epoch_runs.out
  assert "stopped after step 2 (--stop_after)" in first and "step      4" not in first
  ppl = {}
  for kind in ("diffeqformer", "transformer"):
    for step in (2, 4):
      pattern = (
        rf"^seed 0 step\s+{step} {kind}\s+\| valid ppl\s+{NUM} \| test ppl\s+{NUM} "
        r"\| 64 test tokens \| (.*)$"
      )
      m = _find(pattern, out)
      ppl[kind, step] = (_num(m.group(1)), _num(m.group(2)))
      if step == 2:  # trained before the stop, read back now
        assert (
          m.group(3).startswith("read back from")
          and m.group(0).split("|")[1:3] == _find(pattern, first).group(0).split("|")[1:3]
        )
      else:  # continued from the step-2 checkpoint
        assert m.group(3).startswith(f"resumed at step 2 of 4 from {runs}")
  # The final DiffEqFormer is also scored on test at N = 2K and 4K (K = 2), as ratios of K's.
  m = _find(
    rf"^seed 0 step\s+4 diffeqformer\s+\| test ppl at other N: N=4 {NUM} \({NUM} of K's\), "
    rf"N=8 {NUM} \({NUM} of K's\)$",
    out,
  )
  for ppl_n, ratio in ((m.group(1), m.group(2)), (m.group(3), m.group(4))):
    assert _num(ratio) == pytest.approx(_num(ppl_n) / ppl["diffeqformer", 4][1], abs=2e-3)
  assert "step      4 transformer   | test ppl at other N" not in out
  table_ratio = {}
  for step in (2, 4):
    (ov, ot), (gv, gt) = ppl["diffeqformer", step], ppl["transformer", step]
    m = _find(
      rf"^\| {step} \| {step * 64} \| {ov:.2f} \| {ot:.2f} \| {gv:.2f} \| {gt:.2f} \| "
      rf"{NUM} \| 64 \|$",
      out,
    )
    table_ratio[step] = m.group(1)
    _assert_printed_ratio(_num(m.group(1)), ot, gt)
  docs = sum(
    len(local_text.split_documents(p.read_text(encoding="utf-8")))
    for p in sorted(data.glob("train-*.txt"))
  )
  m = _find(
    rf"^tokens seen per model: 256 \(4 steps x 2 rows x 32 targets\); documents "
    rf"read {NUM} of {docs} \({NUM} tokens\): single epoch, no token position of the "
    r"training text served twice$",
    out,
  )
  assert 1 <= _num(m.group(1)) <= docs
  n_ode, n_gpt = map(
    _num,
    _find(
      rf"^parameters: diffeqformer {NUM} \| gpt {NUM}: the "
      rf"DiffEqFormer holds {NUM}x",
      out,
    ).group(1, 2),
  )
  assert f"holds {n_ode / n_gpt:.1f}x GPT's parameters" in out
  # The last line is the table's step-4 ratio (both from the stored perplexities).
  assert out.strip().splitlines()[-1] == (
    f"single-epoch diffeqformer/gpt test perplexity ratio: {table_ratio[4]} (steps 4, tokens 256)"
  )
  assert (runs / "single_epoch.png").stat().st_size > 0
  most = int(_num(_find(rf"one epoch holds {NUM} steps of 64 tokens$", out).group(1)))
  with pytest.raises(UserError, match=rf"^--steps={most + 1} needs a second epoch"):
    single_epoch.main(flags[:2] + ["--preset=tiny", f"--steps={most + 1}"])
  with pytest.raises(UserError, match=rf"^--seed_steps={most + 1} needs a second epoch"):
    single_epoch.main(flags[:4] + ["--seeds=2", f"--seed_steps={most + 1}"])


@pytest.mark.slow
@pytest.mark.xdist_group("single_epoch")
def test_any_n_and_finetuning_from_single_epoch_runs(
  single_epoch_runs, tmp_path, monkeypatch, capsys
):
  """The any-N and Fig. 5 stages start from the scale run's checkpoints without
  training them again: any_n --runs scores the DiffEqFormer at every N (at N = K the
  single-epoch benchmark's own test perplexity), adaptive_finetune --pretrained_* takes
  K, depth, width and tokenizer from the runs, and its 'before' row is the pre-trained
  model's perplexity on the fine-tuning text. (The runs: the resume test's, at 4 steps;
  both stages run in this process: no process property is checked.)"""
  data, runs = single_epoch_runs.data, single_epoch_runs.runs
  test_ppl = _num(
    _find(
      rf"^seed 0 step\s+4 diffeqformer\s+\| valid ppl\s+{NUM} \| test ppl"
      rf"\s+{NUM}",
      single_epoch_runs.out,
    ).group(2)
  )
  ode, gpt = runs / "diffeqformer_seed0_steps4", runs / "transformer_seed0_steps4"
  keys = {d: (d / "benchmark_run_key.json").read_text() for d in (ode, gpt)}

  out = _run_here(
    "any_n",
    [f"--runs={ode}", f"--data=local:{data / 'test.txt'}", "--eval_batches=1"],
    monkeypatch,
    capsys,
  )
  m = _find(r"^fixed grid, step_time start\s+" + r"\s+".join([NUM] * 6) + "$", out)
  row = [_num(m.group(i)) for i in range(1, 7)]
  assert row[1] == pytest.approx(test_ppl, abs=0.006)  # N = K = 2 (then 2K, 4K, 8K)
  assert row[5] == pytest.approx(max(row[2], row[3]) / row[1], abs=2e-3)
  assert out.strip().splitlines()[-1] == (
    f"any-N (fixed grid, step_time start): max(ppl(2K), ppl(4K)) / ppl(K) = {row[5]:.3f}"
  )

  shakespeare = shared_data_path("tinyshakespeare", "input.txt")
  out = _run_here(
    "adaptive_finetune",
    [
      f"--finetune_text={shakespeare}",
      f"--out={tmp_path / 'ft'}",
      f"--pretrained_diffeqformer={ode}",
      f"--pretrained_gpt={gpt}",
      "--seeds=1",
      "--steps=2",
      "--finetune_steps=4",  # with b2: the runs' schedule, so GPT's full step is theirs
      "--b2=0.95",
      "--eval_batches=1",
      "--methods=full,lora",
    ],
    monkeypatch,
    capsys,
  )
  table = (tmp_path / "ft" / "adaptive_finetune.md").read_text()
  assert (
    "after 4 pre-training steps; DiffEqFormer K = 2, GPT 2 layers; d 32, LoRA r 6 alpha 8"
  ) in table
  before = _num(_find(rf"^\| DiffEqFormer fixed before \| {NUM} \|$", table).group(1))
  [expected] = evaluate.evaluate(
    str(ode), [2], max_batches=1, data=f"local:{tmp_path / 'ft' / 'finetune_valid.txt'}"
  )
  assert before == pytest.approx(expected.perplexity, abs=0.006)
  m = _find(
    rf"^diffeqformer/gpt fine-tuned perplexity ratio at N=2: fixed: full {NUM}, "
    rf"lora {NUM} \(mean of 1 seeds\)$",
    out,
  )
  for i, method in enumerate(("full", "lora"), 1):
    ode_ppl = _num(_find(rf"^\| DiffEqFormer fixed {method} \| {NUM} \|$", table).group(1))
    gpt_ppl = _num(_find(rf"^\| GPT \(2 layers\) {method} \| {NUM} \|$", table).group(1))
    assert _num(m.group(i)) == pytest.approx(ode_ppl / gpt_ppl, abs=0.002)
  # A DiffEqFormer of another grid trains beside them, alone, here from seed 1 (the
  # spread's first seed, for a paired comparison); nothing else is touched.
  single_epoch.main(
    single_epoch_runs.flags[:3]
    + ["--steps=2", "--eval_every=2", "--eval_batches=1", "--curve_batches=1"]
    + ["--ode_grid=random_shift", "--kinds=diffeqformer", "--first_seed=1"]
  )
  out = capsys.readouterr().out
  _find(r"^seed 1 step\s+2 diffeqformer\s+\| valid ppl .* \| trained now$", out)
  assert "transformer" not in out and "ratio" not in out and "seed 0" not in out
  shifted = json.loads(
    (runs / "diffeqformer_random_shift_seed1_steps2" / "config.json").read_text()
  )
  assert (shifted["model"]["train_time_grid"], shifted["seed"]) == ("random_shift", 1)
  # Neither pre-trained run was trained again, nor re-keyed.
  assert {d: (d / "benchmark_run_key.json").read_text() for d in (ode, gpt)} == keys
  assert not list(runs.glob("*.stale-*"))


def test_pretrained_and_kinds_flags_are_checked(tmp_path, monkeypatch, capsys):
  shakespeare = shared_data_path("tinyshakespeare", "input.txt")
  assert _usage_error(
    "adaptive_finetune",
    [f"--finetune_text={shakespeare}", f"--pretrained_diffeqformer={tmp_path}"],
    monkeypatch,
    capsys,
  ).endswith(
    f"error: --pretrained_diffeqformer={str(tmp_path)!r} is not a training workdir "
    "(config.json missing); pass both --pretrained_diffeqformer and --pretrained_gpt"
  )
  data = _single_epoch_text(tmp_path)
  assert _usage_error(
    "single_epoch", [f"--data_dir={data}", "--kinds=gpt"], monkeypatch, capsys
  ).endswith("error: --kinds=gpt: choose diffeqformer and/or transformer, comma-separated")
  assert _usage_error("any_n", ["--data=local:x.txt"], monkeypatch, capsys).endswith(
    "error: --data applies to --runs only; the trained runs score on their eval split"
  )
  assert _usage_error("any_n", ["--runs=a", "--rows=b.json"], monkeypatch, capsys).endswith(
    "error: --rows applies to trained candidates, not --runs; pass one of the two"
  )
  assert _usage_error("any_n", ["--seeds=0"], monkeypatch, capsys).endswith(
    "error: --seeds=0 must be at least 1 (0 only with --rows); pass --seeds=1 or more"
  )


@pytest.mark.slow
def test_single_epoch_detects_a_second_epoch(tmp_path):
  """The documents-read check on the real pipeline: within the first epoch it counts
  fewer documents than the corpus holds; a stream read past it is refused."""
  args = single_epoch.parse_args([f"--data_dir={_single_epoch_text(tmp_path)}", "--preset=tiny"])
  config = single_epoch.make_config(args, "transformer", 0, 4, str(tmp_path))
  text = single_epoch.TrainingText(config, str(tmp_path))
  train = pipeline.train_dataset(
    text.documents,
    text.tokenizer.serialized_model_proto(),
    seq_len=config.seq_len,
    global_batch_size=2,
    process_index=0,
    process_count=1,
    text_key=config.data.text_key,
    seed=0,
    shuffle_buffer=config.data.shuffle_buffer,
    worker_count=0,
  )
  it = iter(train)
  epoch, steps = text.epoch, 0
  while steps * 2 * (config.seq_len + 1) <= epoch["tokens"]:  # one epoch's rows, and more
    next(it)
    steps += 1
    if steps == 4:
      read = text.documents_read(it.get_state(), 0)
      assert 1 <= read < epoch["documents"]
      single_epoch.single_epoch_check(config, epoch, steps, read)
  read = text.documents_read(it.get_state(), 0)
  assert read > epoch["documents"]
  with pytest.raises(UserError, match="served twice"):
    single_epoch.single_epoch_check(config, epoch, steps, read)


@pytest.mark.slow
def test_the_gpu_scripts_test_step_fails_when_a_test_fails(tmp_path):
  """`speed.sh tests` ends with pytest's status (it used to end 0 whatever the tests
  did), after printing the log's tail. Here pytest is a stand-in that fails."""
  python = tmp_path / "python"
  python.write_text(
    '#!/bin/sh\nif [ "$1 $2" = "-m pytest" ]; then echo "1 failed, 2 passed"; exit 3; fi\n'
  )
  python.chmod(0o755)
  r = subprocess.run(
    ["bash", "benchmarks/gpu/speed.sh", "tests"],
    cwd=ROOT,
    env=dict(cpu_env(), PYTHON=str(python), OUT=str(tmp_path / "out")),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 3, (r.stdout, r.stderr)
  assert "1 failed, 2 passed" in r.stdout
