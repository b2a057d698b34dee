"""KV-cache decoding and sampling: cached logits equal the full forward pass, sampling
restricts to the top-k / top-p set, greedy decoding equals a plain argmax loop; the
command line says what to expect of a model of its size."""

import functools

from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import _perturb_hypernet

from odetransformer.model.config import ModelConfig
from odetransformer.model.decode import Decoder
from odetransformer.model.transformer import create_model
from odetransformer.tools import generate
from odetransformer.train import loading
from odetransformer.train.run_config import RunConfig

VOCAB = 97
TOL = 1e-5


def tiny_model(**kw):
  """A float32 model whose logits are O(1–10) (scaled embeddings), so 1e-5 is tight.

  Models are cached per config and must not be modified: building one on CPU costs
  seconds of op-by-op compilation.
  """
  return _tiny_model(tuple(sorted(kw.items())))


@functools.cache
def _tiny_model(kw):
  base = dict(
    vocab_size=VOCAB,
    d_model=32,
    num_heads=2,
    mlp_dim=64,
    solver_steps=3,
    num_layers=3,
    max_len=32,
    time_embed_dim=8,
    time_sinusoids=8,
    remat_policy="none",
  )
  base.update(kw)
  perturb = base.pop("perturb", False)
  model = create_model(ModelConfig(**base), seed=0)
  if perturb:  # time-dependent weights that differ visibly between stage times
    _perturb_hypernet(model)
  model.embed[...] = model.embed[...] * 50.0
  return model


@functools.cache
def decoder_for(model, num_steps=None):
  return Decoder(model, num_steps)


@functools.cache
def _jitted_forward(model, num_steps):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, num_steps=num_steps))
  return functools.partial(fn, state)


def forward(model, toks, num_steps=None):
  """The model's full forward pass `model(toks, num_steps=...)`, jitted once per model
  (op-by-op dispatch would compile every op of every new shape)."""
  return _jitted_forward(model, num_steps)(jnp.asarray(toks))


def tokens(b, length, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, length), 0, VOCAB)


def cached_logits(decoder, toks, prefill):
  """Prefill `prefill` tokens in one chunk, then one token per call."""
  b, length = toks.shape
  cache = decoder.init_cache(b, length)
  outs = []
  if prefill:
    out, cache = decoder(toks[:, :prefill], cache, 0)
    outs.append(out)
  for i in range(prefill, length):
    out, cache = decoder(toks[:, i : i + 1], cache, i)
    outs.append(out)
  return jnp.concatenate(outs, axis=1)


# Every test decodes b=2 rows into a 12-token cache with chunks of 5 and 1 tokens, so each
# model's decode step compiles twice and its full forward pass once.
B, LEN, PREFILL = 2, 12, 5
CASES = {
  "diffeqformer-gpt": dict(kind="diffeqformer"),  # materialised, learned positions
  "diffeqformer-llama": dict(kind="diffeqformer", family="llama"),  # materialised, RoPE
  "gpt-gpt": dict(kind="transformer"),  # sequential GPT-2 blocks
  "gpt-llama": dict(kind="transformer", family="llama"),  # sequential Llama blocks
  # grouped-query attention (here multi-query: 1 key/value head for 2 query heads)
  "gpt-llama-gqa": dict(kind="transformer", family="llama", num_kv_heads=1),
  "diffeqformer-llama-gqa": dict(kind="diffeqformer", family="llama", num_kv_heads=1),
  # weight-sharing ODE with a 4-stage solver: not materialised, 4 cache slots per step
  "shared-rk4": dict(kind="shared", solver="rk4", family="llama"),
  # the reference's conventions: step-end times (materialised at (k+1)/N) and its
  # Llama block; midpoint at its 'end' nodes (not materialised)
  "diffeqformer-llama-reference-end": dict(
    kind="diffeqformer", family="llama", llama_block="reference", step_time="end", perturb=True
  ),
  "diffeqformer-midpoint-end": dict(
    kind="diffeqformer", solver="midpoint", step_time="end", perturb=True
  ),
  # DiffEqFormer with higher-order solvers: W(t) at the stage times, 2 / 4 slots per step
  "diffeqformer-midpoint": dict(kind="diffeqformer", solver="midpoint"),
  "diffeqformer-rk4": dict(kind="diffeqformer", solver="rk4", family="llama"),
  # split_euler (attention substep, then MLP substep): materialised as sequential blocks
  "diffeqformer-llama-gqa-split": dict(
    kind="diffeqformer", family="llama", num_kv_heads=1, solver="split_euler", perturb=True
  ),
  "diffeqformer-split-end": dict(
    kind="diffeqformer", solver="split_euler", step_time="end", perturb=True
  ),
}


@pytest.mark.slow
@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("name", list(CASES))
def test_cached_decoding_matches_full_forward(name):
  model = tiny_model(**CASES[name])
  toks = tokens(B, LEN)
  full = forward(model, toks)
  scale = float(jnp.max(jnp.abs(full)))
  assert scale > 1.0  # the comparison is not trivially small
  decoder = decoder_for(model)
  # TOL, or 4 float32 ulps at the logits' scale where they are large (the perturbed
  # reference case reaches ~80, where one ulp is 7.6e-6): the cached and the full pass
  # sum in different orders, and how they round depends on the CPU's vector width.
  atol = max(TOL, 4 * float(jnp.finfo(jnp.float32).eps) * scale)
  np.testing.assert_allclose(cached_logits(decoder, toks, PREFILL), full, rtol=0, atol=atol)


@pytest.mark.slow
def test_cached_decoding_matches_full_forward_in_bfloat16():
  """bfloat16 compute (float32 ODE state): the cached logits equal the full forward's up
  to bfloat16 rounding; an error above that (a wrong cache slot or stage weight) fails.
  The rounding's scale: the full forward's own distance from the float32 model."""
  model = tiny_model(kind="diffeqformer", solver="midpoint", dtype="bfloat16")
  toks = tokens(B, LEN)
  full = forward(model, toks).astype(jnp.float32)
  cached = cached_logits(decoder_for(model), toks, PREFILL).astype(jnp.float32)
  bf16_error = float(
    jnp.max(jnp.abs(full - forward(tiny_model(kind="diffeqformer", solver="midpoint"), toks)))
  )
  assert 0 < bf16_error < 1.0
  np.testing.assert_allclose(cached, full, rtol=0, atol=bf16_error)


def test_decoding_beyond_the_cache_is_an_error():
  """A chunk that would run past the cache is refused (dynamic_update_slice would
  silently clamp the write onto the last positions)."""
  decoder = decoder_for(tiny_model(kind="diffeqformer", family="llama"))
  cache = decoder.init_cache(B, LEN)
  with pytest.raises(ValueError, match="overflows the cache of max_len=12"):
    decoder(tokens(B, PREFILL), cache, [0, LEN - 2])


def test_materialised_decoding_at_another_step_count():
  """An Euler ODE decoded at N != K (materialised) equals its N-step solve."""
  model = tiny_model(kind="diffeqformer", family="llama")
  toks = tokens(B, LEN)
  decoder = decoder_for(model, 5)
  assert decoder.model.config.kind == "parallel" and decoder.num_slots == 5
  np.testing.assert_allclose(
    cached_logits(decoder, toks, PREFILL), forward(model, toks, 5), rtol=0, atol=TOL
  )


def test_split_euler_decodes_as_sequential_blocks_at_another_step_count():
  """A split_euler ODE decoded at N != K is N materialised sequential (Llama) blocks, one
  cache slot each, and equals its N-step solve."""
  model = tiny_model(kind="diffeqformer", family="llama", solver="split_euler", perturb=True)
  toks = tokens(B, LEN)
  decoder = decoder_for(model, 5)
  assert decoder.model.config.kind == "transformer" and decoder.num_slots == 5
  full = forward(model, toks, 5)
  atol = max(TOL, 4 * float(jnp.finfo(jnp.float32).eps) * float(jnp.max(jnp.abs(full))))
  np.testing.assert_allclose(cached_logits(decoder, toks, PREFILL), full, rtol=0, atol=atol)


def test_discrete_model_rejects_other_depths():
  with pytest.raises(ValueError, match="layers"):
    Decoder(tiny_model(kind="transformer"), num_steps=5)


def test_rows_of_different_lengths_share_a_cache():
  """Right-padded prompts of different lengths: each row's logits equal its own
  forward pass; the padding tail is overwritten before it is ever attended."""
  model = tiny_model(kind="diffeqformer", family="llama")
  decoder = decoder_for(model)
  toks = np.asarray(tokens(B, LEN))
  lengths = np.array([2, PREFILL])
  prompt = np.where(np.arange(PREFILL)[None] < lengths[:, None], toks[:, :PREFILL], 7)
  cache = decoder.init_cache(B, LEN)
  first, cache = decoder(prompt, cache, 0)
  steps = []
  for j in range(4):  # each row's next real tokens, at its own positions
    out, cache = decoder(toks[np.arange(B), lengths + j][:, None], cache, lengths + j)
    steps.append(out[:, 0])
  full = forward(model, toks)  # causal: row r's first n logits are those of its n-prefix
  for r in range(B):
    np.testing.assert_allclose(first[r, : lengths[r]], full[r, : lengths[r]], rtol=0, atol=TOL)
    for j in range(4):
      np.testing.assert_allclose(steps[j][r], full[r, lengths[r] + j], rtol=0, atol=TOL)


# --------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------
def allowed_set(logits_v, top_k, top_p):
  """The top-k / nucleus set, computed with numpy in float64 (the reference)."""
  logits = np.asarray(logits_v, np.float64)
  order = np.argsort(-logits, kind="stable")
  if top_k > 0:
    order = order[:top_k]
  p = np.exp(logits[order] - logits[order].max())
  p /= p.sum()
  if top_p < 1.0:
    before = np.cumsum(p) - p
    order = order[(before < top_p) | (np.arange(len(order)) == 0)]  # the top token stays
  return set(int(i) for i in order)


# As the sampler calls them (inside its jitted loop, top-k, top-p and temperature traced):
# one program per shape for all the cases below, not op-by-op dispatch.
filter_logits = jax.jit(generate.filter_logits)
sample_logits = jax.jit(generate.sample_logits)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.5), (20, 0.8), (1, 1.0), (0, 0.0)])
def test_sampling_stays_in_the_allowed_set(top_k, top_p):
  logits = jax.random.normal(jax.random.key(0), (4, VOCAB)) * 3.0
  for row in range(4):
    allowed = allowed_set(logits[row], top_k, top_p)
    filtered = filter_logits(logits[row : row + 1], top_k, top_p)[0]
    assert set(np.flatnonzero(np.isfinite(np.asarray(filtered)))) == allowed
    rows = jnp.broadcast_to(logits[row], (512, VOCAB))
    sampled = sample_logits(rows, jax.random.key(row), 1.0, top_k, top_p)
    seen = set(np.asarray(sampled).tolist())
    assert seen <= allowed
    if len(allowed) > 1 and top_k != 1:
      assert len(seen) > 1  # it does sample, not just take the argmax


def test_temperature_zero_is_greedy_and_deterministic():
  logits = jax.random.normal(jax.random.key(3), (8, VOCAB))
  expected = np.argmax(np.asarray(logits), axis=-1)
  for seed in range(3):
    got = sample_logits(logits, jax.random.key(seed), 0.0, 0, 1.0)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", ["diffeqformer-gpt", "gpt-llama"])
def test_greedy_generation_equals_an_argmax_loop(name):
  model = tiny_model(**CASES[name])
  sampler = generate.Sampler(decoder_for(model))
  prompts = [[5, 17, 3, 44], [9, 2]]
  out = sampler(prompts, 6, temperature=0.0, prompt_len=PREFILL)
  seqs = [list(p) for p in prompts]
  for _ in range(6):  # reference: full forward passes over the growing sequences
    padded = np.zeros((B, LEN), np.int32)  # padded at the end: causal attention ignores it
    for r, seq in enumerate(seqs):
      padded[r, : len(seq)] = seq
    logits = forward(model, padded)
    for r, seq in enumerate(seqs):
      seq.append(int(jnp.argmax(logits[r, len(seq) - 1])))
  for p, seq, row in zip(prompts, seqs, out):
    assert row.tolist() == seq[len(p) :]
  again = sampler(prompts, 6, rng=jax.random.key(7), temperature=0.0, prompt_len=PREFILL)
  np.testing.assert_array_equal(out, again)


def test_sampler_stops_rows_at_eos():
  decoder = decoder_for(tiny_model(**CASES["gpt-llama"]))
  prompts = [[5, 17, 3, 44], [9, 2]]
  greedy = generate.Sampler(decoder)(prompts, 6, temperature=0.0, prompt_len=PREFILL)
  eos = int(greedy[0, 2])  # pretend row 0's third greedy token is eos
  out = generate.Sampler(decoder, eos_id=eos)(prompts, 6, temperature=0.0, prompt_len=PREFILL)
  for g, o in zip(greedy.tolist(), out.tolist()):
    if eos in g:
      first = g.index(eos)
      assert o == g[: first + 1] + [generate.PAD_ID] * (5 - first)
      assert generate.strip_after_eos(o, eos) == g[:first]
    else:
      assert o == g


def test_sampler_checks_learned_positions():
  sampler = generate.Sampler(decoder_for(tiny_model(**CASES["gpt-gpt"])))  # max_len 32
  with pytest.raises(ValueError, match="learned positions"):
    sampler([[1] * 30], 8)


# --------------------------------------------------------------------------------------
# What to expect
# --------------------------------------------------------------------------------------
def test_what_to_expect_depends_on_size_and_training():
  default_run = generate.what_to_expect(6_847_104, 500, 500 * 16 * 128)  # configs/default.py
  assert default_run == (
    "What to expect: a 6.8 M-parameter model trained for 500 steps (1.0 M tokens) writes "
    "locally plausible but incoherent text; coherent text needs a paper-sized config (e.g. "
    "configs/owt_small.py, ~10 B tokens) and hours of GPU/TPU time."
  )
  paper = generate.what_to_expect(729_100_000, 20_000, 20_000 * 512 * 1024)  # owt_small
  assert paper.startswith(
    "What to expect: a 729.1 M-parameter model trained for 20,000 "
    "steps (10.5 B tokens) is at the paper's scale"
  )
  assert "incoherent" not in paper
  for params, steps, tokens in (
    (729_100_000, 100, 100 * 512 * 1024),  # big, barely trained
    (5_000_000, 20_000, 10**10),  # small, trained long
    (729_100_000, 20_000, None),
  ):  # tokens unknown
    assert "incoherent" in generate.what_to_expect(params, steps, tokens)


class _CharTokenizer:
  eos_id = staticmethod(lambda: 3)
  encode = staticmethod(lambda text: [4 + ord(c) % (VOCAB - 4) for c in text])
  decode = staticmethod(lambda ids: "".join(chr(ord("a") + i % 26) for i in ids))


def test_command_line_says_what_to_expect(monkeypatch, capsys):
  """The sentence for this model's parameter count and training is printed before the
  samples."""
  model = tiny_model(**CASES["gpt-gpt"])
  run_config = RunConfig.from_config({"global_batch_size": 4, "seq_len": 16}, recorded=True)
  loaded = loading.Loaded(model=model, model_config=model.config, config=run_config, step=7)
  monkeypatch.setattr(loading, "load_run_config", lambda workdir: run_config)
  monkeypatch.setattr(loading, "load_model", lambda workdir, step=None, **_: loaded)
  monkeypatch.setattr(loading, "load_tokenizer", lambda workdir, config: _CharTokenizer())
  fv = generate.define_flags(flags.FlagValues())
  fv(["generate", "--workdir=W", "--prompt=ab", "--max_new_tokens=4", "--temperature=0"])
  generate.main([], fv)
  lines = capsys.readouterr().out.splitlines()
  num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  expected = generate.what_to_expect(num_params, 7, 7 * 4 * 16)
  assert "incoherent" in expected and f"{num_params / 1e3:.1f} k-parameter" in expected
  assert lines.index(expected) < lines.index("-" * 60) < len(lines) - 2  # before the samples
