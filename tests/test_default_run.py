"""The README's default run: `benchmarks.default_run` reads the lines the README quotes
and checks a fresh run prints them (its whole run, 500 steps, takes minutes on 2 cores and
is a benchmark: benchmarks/README.md, "Quality"). Here: how it reads and compares lines,
and one real run of the README's command through step 1 (the environment, mesh, data,
tokenizer, parameter count and first loss quoted)."""

import re

import pytest

from benchmarks import default_run

README = (default_run.ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_quotes_a_whole_run_with_its_workdir():
  quoted = default_run.quoted_lines(README)
  assert f"--workdir={default_run.README_WORKDIR}" in README
  assert quoted[0].startswith("no GPU or TPU device found")
  assert not any(line.startswith(("I1", "W1")) for line in quoted)  # absl's prefix gone
  assert [line.split(" | ")[0] for line in quoted if line.startswith("eval @ ")] == [
    "eval @ step 250",
    "eval @ step 500",
  ]
  first = default_run.through(quoted, 1)
  assert first[-1].startswith("step 1/500 | ") and len(first) == quoted.index(first[-1]) + 1
  assert default_run.through(quoted, 500) == quoted


def test_the_quoted_run_is_one_run_of_a_few_minutes():
  """The quoted lines' timestamps are one run's, in order, and span a few minutes (what
  the README says of the default run), not the half hour a busier machine once took."""
  section = README.split("## The default run\n", 1)[1].split("\n## ", 1)[0]
  stamps = re.findall(r"^    [IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ", section, re.M)
  seconds = [int(h) * 3600 + int(m) * 60 + float(s) for h, m, s in stamps]
  assert len(seconds) == len(default_run.quoted_lines(README))
  assert seconds == sorted(seconds)
  assert 60 < seconds[-1] - seconds[0] < 10 * 60, seconds[-1] - seconds[0]
  assert "a few minutes" in " ".join(README.split())


@pytest.mark.parametrize(
  "quoted, printed, same",
  [
    ("4.5658", "4.5659", True),  # one unit of the last digit: another CPU's rounding
    ("4.5658", "4.5660", False),
    ("5.673e-04", "5.674e-04", True),
    ("5.673e-04", "5.675e-04", False),
    ("32,768", "32,768", True),
    ("32,768", "32,770", False),
    ("96.14", "nan", False),
  ],
)
def test_a_figure_agrees_to_its_last_printed_digit(quoted, printed, same):
  assert default_run.agrees(quoted, printed) is same


def test_lines_match_by_head_and_figures_or_around_the_cuts():
  step = "step 250/500 | loss 4.8167 | ppl 123.56 | lr 5.673e-04 | grad_norm 0.659 | tok/s 530"
  assert default_run.matches(step, step.replace("tok/s 530", "tok/s 9999"), "/w")
  assert not default_run.matches(step, step.replace("loss 4.8167", "loss 4.8170"), "/w")
  assert not default_run.matches(step, step.replace("step 250/", "step 251/"), "/w")
  assert not default_run.matches(step, step.replace(" | grad_norm 0.659", ""), "/w")
  cut = "preparing 150 text files in /tmp/odet_default/data_cache/… (once; later runs reuse it)"
  printed = "preparing 150 text files in /w/data_cache/ab12 (once; later runs reuse it)"
  assert default_run.matches(cut, printed, "/w")
  assert not default_run.matches(cut, "x " + printed, "/w")
  assert not default_run.matches(cut, printed.replace("150", "151"), "/w")


@pytest.mark.slow
def test_a_fresh_run_prints_the_quoted_lines_through_step_1(capsys):
  assert default_run.main(["--through_step=1"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[-1] == "default run: 7 of 7 quoted lines printed (through step 1)", out
