"""Input pipeline: batch layout, packing, determinism, exact resume, per-host input
shards, eval, errors; and, with real subprocesses, one preparer per cache, damaged caches
and full disks (main.py), and worker processes that die with their trainer.

A small synthetic corpus (written to a temp dir) keeps this fast: ~40 batches per
epoch at seq_len 32, batch 4, vocab 512.
"""

import collections
import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

from conftest import shared_data_path
import numpy as np
import pytest

from input_pipeline import (
  DataError,
  corpora,
  create_datasets,
  embedded,
  evaluation,
  local_text,
  packing,
  prepare,
  restore_iterator_state,
  sources,
)
from input_pipeline import config as config_lib
from input_pipeline import tokenizer as tokenizer_lib
from odetransformer.runtime import fileio
from odetransformer.train.checkpoint.paths import finalized_steps

from tiny import config_flags, cpu_env, tiny_config

# Under pytest-xdist this file runs on one worker: its module fixtures are made once.
pytestmark = pytest.mark.xdist_group("test_input_pipeline")

SEQ, BATCH, VOCAB = 32, 4, 512
KEYS = ("inputs", "targets", "segment_ids", "positions", "weights")


def _text(rng, n_paragraphs: int) -> str:
  syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vé", "zü", "an", "el", "or"]
  words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(150)]
  paragraphs = []
  for _ in range(n_paragraphs):
    sentences = [
      " ".join(rng.choice(words, size=rng.integers(4, 12))).capitalize() + "."
      for _ in range(rng.integers(1, 5))
    ]
    paragraphs.append(" ".join(sentences) + (" ✓ 42" if rng.random() < 0.2 else ""))
  return "\n\n".join(paragraphs) + "\n"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  for i in range(16):
    (d / f"train_{i:02d}.txt").write_text(_text(rng, 8), encoding="utf-8")
  (d / "train_long.txt").write_text(_text(rng, 60), encoding="utf-8")  # split into docs
  for i in range(3):
    (d / f"valid_{i}.txt").write_text(_text(rng, 12), encoding="utf-8")
  return d


def _cfg(corpus_dir, tmp_dir, **overrides):
  c = config_lib.get_config()
  c.source = "local"
  c.train_files = str(corpus_dir / "train_*.txt")
  c.eval_files = str(corpus_dir / "valid_*.txt")
  c.vocab_size = VOCAB
  c.shuffle_buffer = 8
  c.cache_dir = str(tmp_dir)
  for k, v in overrides.items():
    setattr(c, k, v)
  return c


def _create(cfg, seed=0, **kw):
  args = dict(seq_len=SEQ, global_batch_size=BATCH, eval_batch_size=BATCH, seed=seed, workdir=None)
  args.update(kw)
  return create_datasets(cfg, **args)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def ds(corpus_dir, cache):
  return _create(_cfg(corpus_dir, cache))


def _corpus(corpus_dir, cache):
  return sources.open_corpus(_cfg(corpus_dir, cache), str(cache))


def _take(it, n):
  return [next(it) for _ in range(n)]


def _equal(a, b):
  return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def _epoch_batches(ds, corpus_dir, cache) -> int:
  corpus = _corpus(corpus_dir, cache)
  n = sum(len(ds.tokenizer.encode(tokenizer_lib.as_text(d["text"]))) + 1 for d in corpus.train)
  return n // (BATCH * (SEQ + 1))


def _check_batch(b, local_batch=BATCH):
  assert set(b) == set(KEYS)
  for k in KEYS:
    assert b[k].shape == (local_batch, SEQ), k
    assert b[k].dtype == (np.float32 if k == "weights" else np.int32), k
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  seg, pos = b["segment_ids"], b["positions"]
  real = seg > 0
  # padding only at the end of a row; segment ids 1, 2, ... in order
  assert np.all(np.diff(real.astype(int), axis=1) <= 0)
  assert np.all(np.diff(seg, axis=1)[real[:, 1:]] >= 0)
  assert np.all(seg[:, 0][real[:, 0]] == 1)
  # positions restart at 0 exactly where a document starts, else count up by one
  starts = np.concatenate([real[:, :1], (seg[:, 1:] != seg[:, :-1]) & real[:, 1:]], axis=1)
  assert np.all(pos[starts] == 0)
  inner = real & ~starts
  assert np.all(pos[:, 1:][inner[:, 1:]] == pos[:, :-1][inner[:, 1:]] + 1)
  assert np.all(pos[~real] == 0) and np.all(b["inputs"][~real] == 0)
  # weights: 1 where the target is a real token; padding only where it is zero
  assert set(np.unique(b["weights"])) <= {0.0, 1.0}
  assert np.all(b["weights"][:, :-1] == real[:, 1:])


def test_train_batches_layout(ds):
  it = iter(ds.train)
  batches = _take(it, 60)  # more than one epoch
  for b in batches:
    _check_batch(b)
    assert b["weights"].all()  # the training stream is infinite: no padding
    assert b["inputs"].max() < ds.vocab_size
  assert ds.vocab_size == VOCAB == ds.tokenizer.get_piece_size()
  assert (
    ds.tokenizer.pad_id(),
    ds.tokenizer.unk_id(),
    ds.tokenizer.bos_id(),
    ds.tokenizer.eos_id(),
  ) == (0, 1, 2, 3)
  assert any((b["segment_ids"] > 1).any() for b in batches)  # documents were packed together
  assert any((b["inputs"] == 3).any() for b in batches)  # eos after each document


@pytest.mark.slow
def test_packing_loses_and_duplicates_no_token(ds, corpus_dir, cache):
  corpus = _corpus(corpus_dir, cache)
  proto = ds.tokenizer.serialized_model_proto()
  docs = [
    np.asarray(ds.tokenizer.encode(tokenizer_lib.as_text(d["text"])) + [3]) for d in corpus.train
  ]
  common = dict(seq_len=SEQ, text_key="text", seed=5, worker_count=0, num_epochs=1)
  # Without row shuffling the packed rows are exactly the shuffled documents, in order.
  rows = list(packing.packed_rows(corpus.train, proto, shuffle_buffer=0, **common))
  order = list(
    packing.tokenized_documents(
      corpus.train, proto, text_key="text", seed=5, num_epochs=1, worker_count=0
    )
  )
  packed = np.concatenate([r["tokens"][r["tokens_segment_ids"] > 0] for r in rows])
  np.testing.assert_array_equal(packed, np.concatenate([d["tokens"] for d in order]))
  assert sorted(map(tuple, (d["tokens"] for d in order))) == sorted(map(tuple, docs))
  # With row shuffling: the same multiset of tokens, as many as the tokenized corpus.
  rows = list(packing.packed_rows(corpus.train, proto, shuffle_buffer=8, **common))
  packed = np.concatenate([r["tokens"][r["tokens_segment_ids"] > 0] for r in rows])
  assert len(packed) == sum(map(len, docs))
  assert collections.Counter(packed.tolist()) == collections.Counter(np.concatenate(docs).tolist())


@pytest.mark.slow
def test_documents_reshuffled_every_epoch(ds, corpus_dir, cache):
  corpus = _corpus(corpus_dir, cache)
  docs = packing.tokenized_documents(
    corpus.train,
    ds.tokenizer.serialized_model_proto(),
    text_key="text",
    seed=0,
    num_epochs=2,
    worker_count=0,
  )
  docs = [tuple(d["tokens"]) for d in docs]
  n = len(corpus.train)
  assert len(docs) == 2 * n
  assert sorted(docs[:n]) == sorted(docs[n:]) and docs[:n] != docs[n:]


def test_seed_determinism(ds, corpus_dir, cache):
  first = _take(iter(ds.train), 10)
  again = _take(iter(_create(_cfg(corpus_dir, cache)).train), 10)
  other = _take(iter(_create(_cfg(corpus_dir, cache), seed=1).train), 10)
  assert _equal(first, again)
  assert not any(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))


def _states_and_next(it, stops, k=3):
  """Runs `it` to each n in `stops`; returns {n: (JSON-round-tripped state, next k batches)}."""
  out, done = {}, 0
  for n in stops:
    _take(it, n - done)
    state = json.loads(json.dumps(it.get_state()))
    out[n] = (state, _take(it, k))
    done = n + k
  return out


def test_resume_exact_after_json_round_trip(ds, corpus_dir, cache):
  epoch = _epoch_batches(ds, corpus_dir, cache)
  stops = (1, 7, epoch + 2)
  saved = _states_and_next(iter(ds.train), stops)
  fresh = _create(_cfg(corpus_dir, cache))  # as after a restart
  for n in stops:
    state, expected = saved[n]
    it = iter(fresh.train)
    restore_iterator_state(it, state)
    assert _equal(_take(it, 3), expected), n


def test_plain_set_state_after_json_is_the_grain_bug(ds):
  """Documents why restore_iterator_state exists (grain 0.2.18, STACK.md §4)."""
  it = iter(ds.train)
  _take(it, 1)
  state = json.loads(json.dumps(it.get_state()))
  expected = _take(it, 3)
  naive = iter(ds.train)
  naive.set_state(state)
  assert not _equal(_take(naive, 3), expected)


@pytest.mark.slow
def test_workers_same_stream_and_exact_resume(ds, corpus_dir, cache):
  epoch = _epoch_batches(ds, corpus_dir, cache)
  stops = (1, 7, epoch + 2)
  saved0 = _states_and_next(iter(ds.train), stops)  # no workers
  wds = _create(_cfg(corpus_dir, cache, worker_count=2))
  it = iter(wds.train)
  try:
    saved2 = _states_and_next(it, stops)
  finally:
    it.close()
  for n in stops:  # tokenizing in workers does not change the stream
    assert _equal(saved2[n][1], saved0[n][1]), n
  it = iter(wds.train)  # a fresh iterator, restored in turn to each saved state
  try:
    for n in stops:
      restore_iterator_state(it, saved2[n][0])
      assert _equal(_take(it, 3), saved2[n][1]), n
      restore_iterator_state(it, saved0[n][0])  # saved with worker_count=0
      assert _equal(_take(it, 3), saved0[n][1]), n
  finally:
    it.close()
  for n in stops:  # saved with 2 workers, resumed with none
    it = iter(ds.train)
    restore_iterator_state(it, saved2[n][0])
    assert _equal(_take(it, 3), saved2[n][1]), n


class _Counting:
  """A document source that records which documents were read."""

  def __init__(self, source):
    self._source, self.read = source, []

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    self.read.append(int(i))
    return self._source[i]


def _process_streams(ds, corpus_dir, cache, process_count, num_shards, n, num_epochs=None):
  """Each simulated process's first n batches (all, with `num_epochs`) and the documents
  its source served."""
  corpus = _corpus(corpus_dir, cache)
  out = []
  for p in range(process_count):
    src = _Counting(corpus.train)
    train = packing.train_dataset(
      src,
      ds.tokenizer.serialized_model_proto(),
      seq_len=SEQ,
      global_batch_size=BATCH,
      process_index=p,
      process_count=process_count,
      text_key="text",
      seed=0,
      shuffle_buffer=8,
      worker_count=0,
      num_shards=num_shards,
      num_epochs=num_epochs,
    )
    out.append((list(train) if num_epochs else _take(iter(train), n), src.read))
  return out


@pytest.mark.slow
def test_each_process_reads_and_tokenizes_only_its_shard(ds, corpus_dir, cache):
  n = 8
  ((whole, _),) = _process_streams(ds, corpus_dir, cache, 1, 2, n)
  (p0, _), (p1, _) = _process_streams(ds, corpus_dir, cache, 2, 2, n)
  for i in range(n):
    _check_batch(p0[i], local_batch=BATCH // 2)
    rows0 = {tuple(r) for r in p0[i]["inputs"]}
    assert not rows0 & {tuple(r) for r in p1[i]["inputs"]}
    for k in KEYS:  # the union is the 1-process run with the same shard count
      np.testing.assert_array_equal(np.concatenate([p0[i][k], p1[i][k]]), whole[i][k])
  # the public entry point gives the same stream
  mine = _take(iter(_create(_cfg(corpus_dir, cache), process_index=1, process_count=2).train), n)
  assert _equal(mine, p1)
  # Over one epoch, each process reads every document of its half once and nothing else
  # (the halves of the epoch's shuffled order): the documents are split, not repeated.
  docs = len(_corpus(corpus_dir, cache).train)
  (_, read0), (_, read1) = _process_streams(ds, corpus_dir, cache, 2, 2, 0, num_epochs=1)
  assert sorted(read0 + read1) == list(range(docs))
  assert len(read0) == (docs + 1) // 2 and len(read1) == docs // 2


def test_resume_per_process_and_on_another_process_count(ds, corpus_dir, cache):
  cfg = _cfg(corpus_dir, cache, input_shards=2)
  mk = lambda p, count, c=cfg: iter(_create(c, process_index=p, process_count=count).train)
  its = [mk(p, 2) for p in range(2)]
  for it in its:
    _take(it, 5)
  states = [json.loads(json.dumps(it.get_state())) for it in its]
  nxt = [_take(it, 3) for it in its]
  for p in range(2):  # each process resumes exactly from its own state
    it = mk(p, 2)
    restore_iterator_state(it, states[p])
    assert _equal(_take(it, 3), nxt[p]), p
  # 2 processes' states -> 1 process with the same 2 shards: the same global batches
  one = mk(0, 1)
  restore_iterator_state(one, states)
  got = _take(one, 3)
  for i in range(3):
    for k in KEYS:
      np.testing.assert_array_equal(got[i][k], np.concatenate([nxt[0][i][k], nxt[1][i][k]]))
  # and back: the 1-process state resumed by each of 2 processes
  state1 = json.loads(json.dumps(one.get_state()))
  after = _take(one, 2)
  for p in range(2):
    it = mk(p, 2)
    restore_iterator_state(it, [state1])
    for b, whole in zip(_take(it, 2), after):
      np.testing.assert_array_equal(b["inputs"], whole["inputs"][p * 2 : (p + 1) * 2])


@pytest.mark.slow
def test_resume_from_a_state_written_before_input_shards(ds, corpus_dir, cache):
  """Checkpoints of the earlier pipeline (every process held the state of one global
  stream: packed rows batched to the global batch) continue exactly on one process."""
  corpus = _corpus(corpus_dir, cache)
  old = iter(
    packing.packed_rows(
      corpus.train,
      ds.tokenizer.serialized_model_proto(),
      seq_len=SEQ,
      text_key="text",
      seed=0,
      shuffle_buffer=8,
      worker_count=0,
    ).batch(BATCH)
  )
  _take(old, 3)
  state = json.loads(json.dumps(old.get_state()))
  expected = [packing.to_model_batch(b) for b in _take(old, 3)]
  it = iter(ds.train)
  restore_iterator_state(it, state)
  assert _equal(_take(it, 3), expected)


@pytest.mark.slow
def test_resume_with_another_shard_count_starts_the_next_epoch(ds, corpus_dir, cache, caplog):
  """Another shard count is another stream: the resumed run starts at the next epoch
  (the first batch of 2 shards is within epoch 0), skipping the rest of epoch 0."""
  cfg = _cfg(corpus_dir, cache, shuffle_buffer=0)  # rows in packing order
  its = [iter(_create(cfg, process_index=p, process_count=2).train) for p in range(2)]
  states = []
  for it in its:
    next(it)
    states.append(json.loads(json.dumps(it.get_state())))
  one = iter(_create(cfg).train)  # 1 process, 1 shard
  with caplog.at_level(logging.WARNING):
    restore_iterator_state(one, states)
  assert "continues at the start of epoch 1" in caplog.text and "input_shards=2" in caplog.text
  corpus = _corpus(corpus_dir, cache)
  docs = packing.tokenized_documents(
    corpus.train,
    ds.tokenizer.serialized_model_proto(),
    text_key="text",
    seed=0,
    num_epochs=2,
    worker_count=0,
  )
  epoch1 = np.concatenate([d["tokens"] for d in list(docs)[len(corpus.train) :]])
  b = next(one)
  np.testing.assert_array_equal(b["inputs"].ravel()[:SEQ], epoch1[:SEQ])


def _eval_docs(ds, corpus_dir, cache):
  corpus = _corpus(corpus_dir, cache)
  return [ds.tokenizer.encode(tokenizer_lib.as_text(d["text"])) + [3] for d in corpus.eval]


def test_eval_scores_every_token_once(ds, corpus_dir, cache):
  batches = list(ds.eval_batches())
  for b in batches:
    _check_batch(b)
  docs = _eval_docs(ds, corpus_dir, cache)
  n_tokens = sum(map(len, docs))
  assert sum(b["weights"].sum() for b in batches) == n_tokens
  # the scored targets, in order, are exactly the eval split's tokens: nothing dropped
  scored = np.concatenate([b["targets"][b["weights"] > 0] for b in batches])
  np.testing.assert_array_equal(scored, np.concatenate(docs))
  assert n_tokens % (BATCH * SEQ) != 0 and batches[-1]["weights"].sum() < BATCH * SEQ  # padded tail
  assert _equal(batches, list(ds.eval_batches()))  # deterministic, fresh pass each call


def test_eval_processes_and_max_batches(ds, corpus_dir, cache):
  whole = list(ds.eval_batches())
  parts = [
    list(_create(_cfg(corpus_dir, cache), process_index=p, process_count=2).eval_batches())
    for p in range(2)
  ]
  assert len(parts[0]) == len(parts[1]) == len(whole)
  for i, b in enumerate(whole):
    for k in KEYS:
      np.testing.assert_array_equal(np.concatenate([parts[0][i][k], parts[1][i][k]]), b[k])
  limited = list(_create(_cfg(corpus_dir, cache, eval_max_batches=2)).eval_batches())
  assert _equal(limited, whole[:2])


def test_eval_rows_segments_and_positions():
  docs = [np.array([10, 11, 12]), np.array([20]), np.array([30, 31, 32, 33, 34, 35])]
  rows = list(evaluation.eval_rows(docs, seq_len=4, eos_id=3))
  stream = np.concatenate([[3]] + docs)
  assert len(rows) == 3  # 10 targets / 4 per row, tail padded
  np.testing.assert_array_equal(rows[0]["inputs"], [3, 10, 11, 12])
  np.testing.assert_array_equal(rows[0]["segment_ids"], [1, 2, 2, 2])
  np.testing.assert_array_equal(rows[0]["positions"], [0, 0, 1, 2])
  np.testing.assert_array_equal(rows[1]["inputs"], [20, 30, 31, 32])  # 12 was the last target
  np.testing.assert_array_equal(rows[1]["segment_ids"], [1, 2, 2, 2])
  np.testing.assert_array_equal(rows[2]["inputs"], [33, 34, 35, 0])
  np.testing.assert_array_equal(rows[2]["targets"], [34, 35, 0, 0])
  np.testing.assert_array_equal(rows[2]["segment_ids"], [1, 1, 1, 0])
  np.testing.assert_array_equal(rows[2]["weights"], [1, 1, 0, 0])
  scored = np.concatenate([r["targets"][r["weights"] > 0] for r in rows])
  np.testing.assert_array_equal(scored, stream[1:])


@pytest.mark.parametrize("name", ["wikitext-2/valid.txt", "tinyshakespeare/input.txt"])
def test_tokenizer_round_trip_on_real_text(name, tmp_path):
  text = shared_data_path(*name.split("/")).read_text(encoding="utf-8")
  docs = local_text.split_documents(text)
  sp, path = tokenizer_lib.get_tokenizer(
    tokenizer_path="",
    vocab_size=1024,
    cache_dir=str(tmp_path),
    fingerprint=f"test:{name}",
    source=[{"text": d.encode()} for d in docs],
    text_key="text",
    sample_bytes=300_000,
  )
  assert sp.decode(sp.encode(text)) == text
  odd = "import os\nprint('héllo wörld ✓')\n\n\tx  =  1  # 数学 🚀\r\n"
  assert sp.decode(sp.encode(odd)) == odd
  assert len(sp.encode(text)) < len(text.encode()) / 2  # it learned real pieces
  meta = json.loads(open(path.replace(".model", ".json")).read())
  assert meta["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
  assert meta["vocab_size"] == 1024 and meta["sample_bytes"] == 300_000


def test_tokenizer_cache_key_and_reuse(tmp_path, monkeypatch):
  source = [{"text": _text(np.random.default_rng(i), 20).encode()} for i in range(5)]
  kw = dict(tokenizer_path="", cache_dir=str(tmp_path), source=source, text_key="text")
  sp, path = tokenizer_lib.get_tokenizer(vocab_size=400, fingerprint="a", sample_bytes=10**6, **kw)
  monkeypatch.setattr(
    tokenizer_lib, "train", lambda *a: pytest.fail("retrained a cached tokenizer")
  )
  sp2, path2 = tokenizer_lib.get_tokenizer(
    vocab_size=400, fingerprint="a", sample_bytes=10**6, **kw
  )
  assert path2 == path and sp2.serialized_model_proto() == sp.serialized_model_proto()
  others = {
    str(tokenizer_lib.cache_path(str(tmp_path), *args))
    for args in [("b", "text", 400, 10**6), ("a", "text", 512, 10**6), ("a", "text", 400, 10**5)]
  }
  assert path not in others and len(others) == 3
  # given explicitly, the same file loads; with a wrong vocab size it is a clear error
  assert tokenizer_lib.load(path, 400).get_piece_size() == 400


def _assert_data_error(fn, *fragments):
  with pytest.raises(DataError) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg and "fix" in msg, msg
  for f in fragments:
    assert f in msg, msg


def test_bad_inputs_raise_clear_data_errors(ds, corpus_dir, cache, tmp_path):
  mk = lambda **o: lambda: _create(_cfg(corpus_dir, cache, **o))
  _assert_data_error(mk(train_files=str(tmp_path / "nope" / "*.txt")), "no file matches", "nope")
  _assert_data_error(mk(eval_files=""), "data.eval_files is empty")
  (tmp_path / "empty.txt").write_text("\n  \n\n")
  _assert_data_error(mk(train_files=str(tmp_path / "empty.txt")), "contain no text")
  _assert_data_error(mk(source="nonsense"), "unknown data.source", "'nonsense'")
  _assert_data_error(mk(source="tfds:no_such_dataset_xyz"), "unknown TFDS dataset")
  _assert_data_error(
    mk(source="tfds:tiny_shakespeare", data_dir=str(tmp_path / "tfds")),
    "not prepared",
    "input_pipeline.prepare --dataset=tfds:tiny_shakespeare",
  )
  _assert_data_error(
    mk(source="openwebtext", data_dir=str(tmp_path / "tfds")),
    "not prepared",
    "input_pipeline.prepare --dataset=openwebtext",
  )
  _assert_data_error(
    mk(tokenizer_path=ds.tokenizer_path, vocab_size=VOCAB * 2),
    f"has {VOCAB} pieces but data.vocab_size={VOCAB * 2}",
    f"vocab_size={VOCAB}",
  )
  _assert_data_error(mk(tokenizer_path=str(tmp_path / "missing.model")), "does not exist")
  _assert_data_error(mk(text_key="content"), "no feature 'content'")
  _assert_data_error(mk(vocab_size=100), "too small")
  _assert_data_error(
    lambda: _create(_cfg(corpus_dir, cache), process_count=3),
    "global_batch_size=4",
    "multiple of 3",
  )
  _assert_data_error(
    mk(cache_dir="gs://bucket/cache"),
    "data.cache_dir=gs://bucket/cache",
    "local-file writer",
    "set data.cache_dir to a local directory",
  )
  assert not os.path.exists("gs:")  # nothing written to a local directory 'gs:'
  _assert_data_error(
    mk(input_shards=3), "global_batch_size=4 is not a multiple of data.input_shards=3"
  )
  _assert_data_error(
    lambda: _create(_cfg(corpus_dir, cache, input_shards=3), process_count=2),
    "data.input_shards=3",
    "multiple of 2",
  )


def test_content_hash_is_the_prepared_files_sha256(ds, corpus_dir, cache, tmp_path):
  (data_path,) = cache.glob("prepared/local-*/local_text/1.0.0")
  files = sorted(data_path.glob("*.array_record-*"))
  assert len(files) == 2  # train, validation
  digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
  blob = json.dumps(digests, sort_keys=True).encode()
  assert ds.content_hash == hashlib.sha256(blob).hexdigest()
  again = tmp_path / "again"  # prepared again from the same files
  shutil.copytree(cache, again)
  shutil.rmtree(next(again.glob("prepared/local-*")))
  assert _create(_cfg(corpus_dir, again)).content_hash == ds.content_hash
  other = tmp_path / "other"
  shutil.copytree(corpus_dir, other)
  with open(other / "train_00.txt", "a", encoding="utf-8") as f:
    f.write("One more paragraph.\n")
  assert _create(_cfg(other, tmp_path / "cache")).content_hash != ds.content_hash


def test_split_documents_bounded_and_lossless():
  text = _text(np.random.default_rng(3), 80) + "x" * 9000 + "\n"
  docs = local_text.split_documents(text, max_chars=1000)
  assert all(0 < len(d) <= 1000 for d in docs)
  assert "".join(docs).replace("\n", "") == text.replace("\n", "")
  assert len(docs) > 10 and all(d.strip() == d.strip("\n").strip() for d in docs)
  assert local_text.split_documents("\n \n") == []


def test_preparing_local_text_is_one_quiet_log_line(tmp_path, capfd, caplog):
  """No TFDS download banner, no progress bars (escape codes in a log file), no warning:
  one log line of its own, and nothing at all when the prepared data is reused."""
  (tmp_path / "a.txt").write_text("first paragraph\n\nsecond one\n")
  files = {"train": [str(tmp_path / "a.txt")], "validation": [str(tmp_path / "a.txt")]}
  for run in (1, 2):
    caplog.clear()
    with caplog.at_level(logging.INFO):
      srcs, _, _ = local_text.prepare(files, tmp_path / "prepared")
    out, err = capfd.readouterr()
    assert len(srcs["train"]) == 1
    assert (out, err) == ("", ""), (run, out + err)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    ours = [r.getMessage() for r in caplog.records if r.pathname == local_text.__file__]
    prepared = tmp_path / "prepared"
    assert ours == (
      [
        f"preparing 1 text file as array_record in {prepared}/local-"
        f"{local_text.fingerprint(files)}/local_text/1.0.0 (once; later runs "
        "reuse it)"
      ]
      if run == 1
      else []
    )


def test_embedded_corpus_is_offline_and_deterministic(tmp_path):
  files = embedded.corpus_files()
  assert files == embedded.corpus_files()
  assert files["train"] and files["validation"]
  assert not set(files["train"]) & set(files["validation"])
  total = sum(os.path.getsize(f) for f in files["train"] + files["validation"])
  assert total <= embedded.MAX_TOTAL_BYTES
  c = config_lib.get_config()  # the default: source='embedded'
  c.vocab_size, c.tokenizer_sample_bytes = VOCAB, 500_000
  d = create_datasets(
    c, seq_len=SEQ, global_batch_size=BATCH, eval_batch_size=BATCH, seed=0, workdir=str(tmp_path)
  )
  _check_batch(next(iter(d.train)))
  assert os.path.isdir(tmp_path / "data_cache" / "tokenizers")
  assert "def " in d.tokenizer.decode(next(iter(d.eval_batches()))["inputs"].ravel().tolist())


def test_openwebtext_holdout_is_deterministic():
  held = [i for i in range(200_000) if corpora.is_heldout(i)]
  assert held == [i for i in range(200_000) if corpora.is_heldout(i)]
  assert 60 <= len(held) <= 140  # 0.05% of 200k = 100


def test_openwebtext_prepare_path_on_fake_documents(tmp_path):
  docs = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(300)]
  builder = corpora.Openwebtext(
    data_dir=str(tmp_path),
    file_format="array_record",
    raw_documents=lambda: iter(docs),
    test_fraction=0.1,
  )
  builder.download_and_prepare()
  srcs = builder.as_data_source()
  train = {tokenizer_lib.as_text(x["text"]) for x in srcs["train"]}
  test = {tokenizer_lib.as_text(x["text"]) for x in srcs["test"]}
  assert test == {d for i, d in enumerate(docs) if corpora.is_heldout(i, 0.1)}
  assert train == set(docs) - test and 10 < len(test) < 60
  # the pipeline then reads it like any prepared corpus
  corpus = sources.open_corpus(_cfg_for("openwebtext", tmp_path), str(tmp_path))
  assert corpus.eval_split == "test" and len(corpus.eval) == len(test)


@pytest.mark.slow
def test_prepared_corpus_reads_from_gs(tmp_path, gcs_bucket):
  """A TFDS (array_record) corpus under a gs:// data_dir: TFDS finds it through epath,
  array_record's own GCS reader reads it (at the emulator fileio points it to); the same
  records as the local copy it was copied from."""
  docs = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(100)]
  corpora.Openwebtext(
    data_dir=str(tmp_path / "tfds"),
    file_format="array_record",
    raw_documents=lambda: iter(docs),
    test_fraction=0.1,
  ).download_and_prepare()
  remote = f"{gcs_bucket}/tfds-{tmp_path.name}"
  fileio.copy_tree(tmp_path / "tfds", remote)
  local, gs = (
    sources.open_corpus(_cfg_for("openwebtext", d), str(tmp_path / "cache"))
    for d in (tmp_path / "tfds", remote)
  )
  assert gs.fingerprint == local.fingerprint
  for split in ("train", "eval"):
    texts = [
      [src[i]["text"] for i in range(len(src))]
      for src in (getattr(gs, split), getattr(local, split))
    ]
    assert texts[0] == texts[1] and texts[0], split


def _cfg_for(source, data_dir):
  c = config_lib.get_config()
  c.source, c.data_dir, c.vocab_size = source, str(data_dir), VOCAB
  return c


def test_wikitext103_articles_and_prepare_command(tmp_path):
  raw = tmp_path / "raw"
  raw.mkdir()
  article = lambda t: (
    f" = {t} = \n \n Some text about {t} . \n \n = = Section = = \n \n More . \n \n"
  )
  for name, titles in (("train", ["A", "B", "C"]), ("valid", ["D"]), ("test", ["E", "F"])):
    (raw / f"wiki.{name}.raw").write_text(" \n" + "".join(article(t) for t in titles))
  arts = list(corpora.split_wikitext_articles(open(raw / "wiki.train.raw")))
  assert len(arts) == 3 and arts[1].startswith(" = B = ") and "= = Section = =" in arts[1]
  summary = prepare.prepare(
    "wikitext103", str(tmp_path / "tfds"), raw_dir=str(raw), vocab_size=300, sample_bytes=10_000
  )
  assert "'train': 3" in summary and "'validation': 1" in summary and "tokenizer" in summary
  c = _cfg_for("wikitext103", tmp_path / "tfds")
  c.vocab_size, c.tokenizer_sample_bytes = 300, 10_000
  d = create_datasets(c, seq_len=8, global_batch_size=2, eval_batch_size=2, seed=0, workdir=None)
  _ = next(iter(d.train))
  assert d.tokenizer_path == summary.split("tokenizer ")[1]  # prepared once, reused


# --------------------------------------------------------------------------------------
# Preparation by one job, damaged caches and full disks, worker processes (subprocesses)
# --------------------------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[1]

PREPARE_DRIVER = textwrap.dedent("""
    import os, pathlib, sys, time
    import test_input_pipeline as t
    from input_pipeline import local_text, tokenizer
    for cls, name in ((local_text.LocalText, "download_and_prepare"), (tokenizer, "train")):
      original = getattr(cls, name)
      def counted(*a, _original=original, _name=name, **kw):
        print("RAN", _name, flush=True)
        time.sleep(1.0)          # long enough that an unserialised second job would overlap
        return _original(*a, **kw)
      setattr(cls, name, counted)
    corpus, cache = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    pathlib.Path(sys.argv[3]).touch()                     # ready
    while not pathlib.Path(sys.argv[4]).exists():         # both start together
      time.sleep(0.01)
    ds = t._create(t._cfg(corpus, cache))
    print("BATCH", next(iter(ds.train))["inputs"].sum(), flush=True)
    """)


@pytest.mark.slow
def test_two_jobs_preparing_one_new_cache_prepare_it_once(corpus_dir, tmp_path):
  cache = tmp_path / "cache"
  files = {
    "train": sources.expand_globs(str(corpus_dir / "train_*.txt"), "train_files"),
    "validation": sources.expand_globs(str(corpus_dir / "valid_*.txt"), "eval_files"),
  }
  leftover = (
    cache
    / "prepared"
    / f"local-{local_text.fingerprint(files)}"
    / "local_text"
    / "incomplete.KILLED_1.0.0"
  )
  leftover.mkdir(parents=True)  # what a killed preparation leaves
  (leftover / "local_text-train.array_record-00000-of-00001").write_bytes(b"partial")
  driver = tmp_path / "driver.py"
  driver.write_text(PREPARE_DRIVER)
  go = tmp_path / "go"
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(driver),
        str(corpus_dir),
        str(cache),
        str(tmp_path / f"ready{i}"),
        str(go),
      ],
      env=dict(os.environ, ODET_ROOT=str(ROOT), JAX_PLATFORMS="cpu"),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  deadline = time.monotonic() + 60
  while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
    time.sleep(0.01)
  go.touch()
  outs = [p.communicate(timeout=60)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  ran = "".join(outs)
  assert ran.count("RAN download_and_prepare") == 1 and ran.count("RAN train") == 1, outs
  batches = {line for out in outs for line in out.splitlines() if line.startswith("BATCH")}
  assert len(batches) == 1, outs  # both read the same prepared data
  assert not leftover.exists()


def _main(workdir, cache, corpus_dir, *flags, timeout=60):
  """main.py on the test corpus (tiny model): (exit status, stderr)."""
  c = tiny_config(cache)
  c.data.source = "local"
  c.data.train_files = str(corpus_dir / "train_*.txt")
  c.data.eval_files = str(corpus_dir / "valid_*.txt")
  proc = subprocess.run(
    [
      sys.executable,
      "main.py",
      "--config=configs/default.py",
      f"--workdir={workdir}",
      *config_flags(c),
      *flags,
    ],
    cwd=ROOT,
    env=cpu_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return proc.returncode, proc.stderr


def _error_line(code: int, err: str) -> str:
  """The one error line of a run that failed on bad input (exit 2, no traceback)."""
  errors = [l for l in err.splitlines() if l.startswith("error: ")]
  assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
  assert err.rstrip().endswith(errors[0]), err[-3000:]
  return errors[0]


@pytest.mark.slow
def test_damaged_cache_is_one_line_naming_the_directory_to_delete(ds, corpus_dir, cache, tmp_path):
  del ds  # prepared the cache
  damaged = tmp_path / "cache"
  shutil.copytree(cache, damaged)
  (train_file,) = damaged.glob("prepared/local-*/local_text/1.0.0/*train.array_record*")
  with open(train_file, "r+b") as f:
    f.truncate(os.path.getsize(train_file) // 2)
  code, err = _main(tmp_path / "run", damaged, corpus_dir)
  prepared = train_file.parents[2]
  line = _error_line(code, err)
  assert "is damaged" in line and f"fix: delete {prepared} (it is prepared again" in line, line
  shutil.rmtree(prepared)  # the fix works: prepared again, then read
  _check_batch(next(iter(_create(_cfg(corpus_dir, damaged)).train)))


@pytest.mark.slow
def test_full_disk_while_preparing_is_one_line_with_the_space_needed(corpus_dir, tmp_path):
  small = tmp_path / "small"
  small.mkdir()
  mounted = (
    subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True
    ).returncode
    == 0
  )
  if not mounted:  # not root: the same error, raised where the disk would fill
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(
        local_text.LocalText,
        "download_and_prepare",
        lambda self: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
      )
      _assert_data_error(
        lambda: _create(_cfg(corpus_dir, small)), "no space left on device", "free about"
      )
    return
  try:
    code, err = _main(tmp_path / "run", small, corpus_dir)
  finally:
    subprocess.run(["umount", str(small)], check=True)
  line = _error_line(code, err)
  assert f"no space left on device while preparing data in {small}/prepared/local-" in line, line
  assert "fix: free about 1 MiB there" in line, line


def _descendants(pid: int) -> dict:
  """{pid: start time} of the processes below `pid` (from /proc)."""
  children, starts = collections.defaultdict(list), {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
      except OSError:
        continue
      fields = stat.rsplit(")", 1)[1].split()
      children[int(fields[1])].append(int(entry))
      starts[int(entry)] = fields[19]
  out, todo = {}, [pid]
  while todo:
    for child in children[todo.pop()]:
      out[child] = starts[child]
      todo.append(child)
  return out


def _alive(pid: int, start: str) -> bool:
  try:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except OSError:
    return False
  return fields[19] == start and fields[0] != "Z"  # the same process, not a zombie


@pytest.mark.slow
def test_worker_processes_die_with_a_killed_trainer(ds, corpus_dir, cache, tmp_path):
  del ds  # prepared the cache
  c = tiny_config(cache, num_train_steps=100_000)
  c.data.source = "local"
  c.data.train_files = str(corpus_dir / "train_*.txt")
  c.data.eval_files = str(corpus_dir / "valid_*.txt")
  c.data.worker_count = 2
  proc = subprocess.Popen(
    [
      sys.executable,
      "main.py",
      "--config=configs/default.py",
      f"--workdir={tmp_path / 'run'}",
      *config_flags(c),
    ],
    cwd=ROOT,
    env=cpu_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    deadline = time.monotonic() + 60
    workers = {}
    while len(workers) < 2:  # grain's workers: children running multiprocessing's spawn
      assert proc.poll() is None and time.monotonic() < deadline, "no workers started"
      time.sleep(0.2)
      workers = {
        p: s
        for p, s in _descendants(proc.pid).items()
        if b"spawn_main" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()
      }
    # Killed once training has used batches from both workers (a checkpoint at step 2):
    # each has then run its init function, which starts its exit watcher. (A worker still
    # importing when its trainer dies exits only once it reaches that function: seconds
    # later under load, which once outlasted the 10 s below.)
    while not finalized_steps(str(tmp_path / "run")):
      assert proc.poll() is None and time.monotonic() < deadline + 120, "no checkpoint written"
      time.sleep(0.2)
    family = _descendants(proc.pid)
  finally:
    proc.kill()
    proc.wait()
  deadline = time.monotonic() + 10
  while any(_alive(p, s) for p, s in family.items()) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert len(family) >= 2 and not [p for p, s in family.items() if _alive(p, s)]


@pytest.mark.slow
def test_tokenizer_cached_on_and_read_from_gcs(tmp_path, monkeypatch, gcs_bucket):
  """`data.cache_dir` / `data.tokenizer_path` on gs:// (a GCS emulator): the tokenizer is
  written as an object and read back; nothing goes to a local directory named 'gs:'."""
  monkeypatch.chdir(tmp_path)
  cache = f"{gcs_bucket}/tokenizer-cache-{os.getpid()}"
  source = [{"text": _text(np.random.default_rng(i), 20).encode()} for i in range(5)]
  kw = dict(vocab_size=400, fingerprint="a", source=source, text_key="text", sample_bytes=10**6)
  sp, path = tokenizer_lib.get_tokenizer(tokenizer_path="", cache_dir=cache, **kw)
  assert path.startswith(f"{cache}/tokenizers/spm_a_v400_")
  again, _ = tokenizer_lib.get_tokenizer(tokenizer_path=path, cache_dir="unused", **kw)
  assert again.serialized_model_proto() == sp.serialized_model_proto()
  assert not os.path.exists("gs:") and not os.listdir(tmp_path)
