"""The model against the authors' code (SDML-KU/qkvflow, MIT): a float64 numpy forward
pass written from that code's equations, not from ours, loaded with our model's weights.

GPT family: qkvflow `nn/dynamic.py` (`SinusoidalPosEmb`, `TemporalLinear`,
`TemporalLayerNorm`, `Block`, `NeuralOdeTransformer`: Euler with x + dt·block(t_k, x)
at t_k = (k+1)·dt, `Gpt2Embeddings` tied to the head). Llama family:
`nn/dynamic_llama.py` (`LlamaRMSNorm` with a time-dependent weight and bias at eps
1e-6, `LlamaDecoderLayer`: the MLP reads post_attention_layernorm(input_layernorm(x)),
`LlamaRMSNorm_` final norm, an untied head). Levanter's attention scales scores by
1/√head_size; its RoPE is the rotate-half form.

Our model matches at `model.step_time='end'` (and `llama_block='reference'`), and does
not at our own conventions, so the comparison can tell them apart.
"""

import dataclasses
import math

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import TINY, _np, _perturb_hypernet, tokens

from odetransformer.model.transformer import create_model


# ------------------------------------------------------- qkvflow's equations in numpy
def sinusoidal_pos_emb(t, num_sinusoids):
  """qkvflow SinusoidalPosEmb: [t, sin(1000·t·ω_i), cos(…)], ω_i = exp(-ln(1e4)·i/S).
  The reference forms t and the arguments in the activations' dtype; at float32 that
  is what both models compute (an argument of 1000 rad is only known to ~6e-5 rad in
  float32), so they are formed in float32 here and everything after in float64."""
  x = np.float32(t) * np.float32(1000.0)
  freqs = np.exp(
    np.float32(-math.log(10000.0))
    * np.arange(num_sinusoids, dtype=np.float32)
    / np.float32(num_sinusoids)
  )
  args = (x * freqs.astype(np.float32)).astype(np.float64)
  return np.concatenate([[np.float64(x / np.float32(1000.0))], np.sin(args), np.cos(args)])


def time_mlp(mod, e):
  """lin1 (2S+1 -> d_t), silu, lin2 (d_t -> d_t): every Temporal* module's own MLP."""
  h = e @ mod["lin1_w"] + mod["lin1_b"]
  h = h / (1.0 + np.exp(-h))
  return h @ mod["lin2_w"] + mod["lin2_b"]


def temporal_linear(mod, e, x, n_in):
  """TemporalLinear: W = f_W(h) (a Linear d_t -> In + Out with bias), x·W over the In
  axes, plus h·f_b when the module has a bias."""
  h = time_mlp(mod, e)
  w = np.tensordot(h, mod["f_W"], 1) + mod["f_W_bias"]
  out = np.tensordot(x, w, n_in)
  if "f_b" in mod:
    out = out + np.tensordot(h, mod["f_b"], 1)
  return out


def temporal_norm(mod, e, x, eps, rms):
  """TemporalLayerNorm (mean, var) or LlamaRMSNorm (mean of squares): weight
  h·f_weight + 1, bias h·f_bias."""
  h = time_mlp(mod, e)
  if rms:
    out = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
  else:
    mean = x.mean(-1, keepdims=True)
    out = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
  return out * (h @ mod["f_weight"] + 1.0) + h @ mod["f_bias"]


def causal_attention(q, k, v):
  """Levanter's dot_product_attention on [pos, heads, head_size], causal."""
  scores = np.einsum("inh,jnh->nij", q / math.sqrt(q.shape[-1]), k)
  length = q.shape[0]
  scores = np.where(np.tril(np.ones((length, length), bool))[None], scores, -np.inf)
  prob = np.exp(scores - scores.max(-1, keepdims=True))
  prob /= prob.sum(-1, keepdims=True)
  return np.einsum("nij,jnh->inh", prob, v)


def rotary(x, base):
  """LlamaRotaryEmbedding + _apply_rotary_pos_emb: x·cos + rotate_half(x)·sin."""
  length, _, size = x.shape
  inv_freq = 1.0 / base ** (np.arange(0, size, 2) / size)
  freqs = np.arange(length)[:, None] * inv_freq[None]
  emb = np.concatenate([freqs, freqs], -1)[:, None]
  half = np.concatenate([-x[..., size // 2 :], x[..., : size // 2]], -1)
  return x * np.cos(emb) + half * np.sin(emb)


def gpt_block(ref, e, x):
  """dynamic.py Block: attn(attn_ln(x)) + mlp(mlp_ln(x)), gelu_new."""
  qkv = temporal_linear(ref["c_attn"], e, temporal_norm(ref["attn_ln"], e, x, 1e-5, False), 1)
  attn = causal_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2])
  attn = temporal_linear(ref["attn_c_proj"], e, attn, 2)
  u = temporal_linear(ref["c_fc"], e, temporal_norm(ref["mlp_ln"], e, x, 1e-5, False), 1)
  u = 0.5 * u * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))
  return attn + temporal_linear(ref["mlp_c_proj"], e, u, 1)


def llama_block(ref, e, x, rope_base):
  """dynamic_llama.py LlamaDecoderLayer: x = ln1(x); attn(x); x = ln2(x); mlp(x)."""
  x = temporal_norm(ref["input_layernorm"], e, x, 1e-6, True)
  q = rotary(temporal_linear(ref["q_proj"], e, x, 1), rope_base)
  k = rotary(temporal_linear(ref["k_proj"], e, x, 1), rope_base)
  v = temporal_linear(ref["v_proj"], e, x, 1)
  attn = temporal_linear(ref["o_proj"], e, causal_attention(q, k, v), 2)
  x = temporal_norm(ref["post_attention_layernorm"], e, x, 1e-6, True)
  gate = temporal_linear(ref["gate_proj"], e, x, 1)
  hidden = gate / (1.0 + np.exp(-gate)) * temporal_linear(ref["up_proj"], e, x, 1)
  return attn + temporal_linear(ref["down_proj"], e, hidden, 1)


def reference_logits(ref, toks, num_layers, family, num_sinusoids, rope_base):
  """NeuralOdeLMHeadModel / LlamaLMHeadModel: embed, Euler x + dt·block(t_k, x) at
  t_k = (k+1)·dt, final norm, head; one row of tokens at a time."""
  dt = np.float32(1.0 / num_layers)
  ts = (np.arange(num_layers, dtype=np.float32) + np.float32(1.0)) * dt  # generate_t
  out = []
  for row in np.asarray(toks):
    x = ref["token_embeddings"][row]
    if family == "gpt2":
      x = x + ref["position_embeddings"][np.arange(len(row))]
    for t in ts:
      e = sinusoidal_pos_emb(t, num_sinusoids)
      f = gpt_block(ref, e, x) if family == "gpt2" else llama_block(ref, e, x, rope_base)
      x = x + f * np.float64(dt)
    if family == "gpt2":  # hnn.LayerNorm, eps 1e-5, tied unembedding
      mean = x.mean(-1, keepdims=True)
      x = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
      out.append((x * ref["ln_f_w"] + ref["ln_f_b"]) @ ref["token_embeddings"].T)
    else:  # LlamaRMSNorm_, eps 1e-5, no bias; lm_head
      x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
      out.append((x * ref["ln_f_w"]) @ ref["lm_head"])
  return np.stack(out)


# ------------------------------------------------- our weights in the reference's shape
def _module(model, group, gens):
  """A reference module dict: the time MLP of `group`, and f_W/f_W_bias/f_b/f_weight/
  f_bias from our generators (P [*shape, d_t] -> [d_t, *shape]; P0 -> the Linear's bias)."""
  mlp = model.stack.mlps[group]
  mod = {
    "lin1_w": _np(mlp.fc1.kernel[...]),
    "lin1_b": _np(mlp.fc1.bias[...]),
    "lin2_w": _np(mlp.fc2.kernel[...]),
    "lin2_b": _np(mlp.fc2.bias[...]),
  }
  for key, name in gens.items():
    gen = model.stack.gens[name]
    mod[key] = np.moveaxis(_np(gen.proj[...]), -1, 0)
    if key == "f_W":
      mod["f_W_bias"] = _np(gen.base[...])
  return mod


def reference_params(model):
  cfg = model.config
  ref = {"token_embeddings": _np(model.embed[...]), "ln_f_w": _np(model.final_norm_scale[...])}
  norms = {
    "norm1": "attn_ln" if cfg.family == "gpt2" else "input_layernorm",
    "norm2": "mlp_ln" if cfg.family == "gpt2" else "post_attention_layernorm",
  }
  for ours, theirs in norms.items():
    ref[theirs] = _module(model, ours, {"f_weight": f"{ours}_scale", "f_bias": f"{ours}_shift"})
  if cfg.family == "gpt2":
    ref["position_embeddings"] = _np(model.pos_embed[...])
    ref["ln_f_b"] = _np(model.final_norm_shift[...])
    # c_attn is one TemporalLinear (one time MLP) with Out = (qkv, heads, head_size).
    qkv = [_module(model, p, {"f_W": f"w{p}", "f_b": f"b{p}"}) for p in "qkv"]
    ref["c_attn"] = dict(
      qkv[0],
      f_W=np.stack([m["f_W"] for m in qkv], 2),
      f_W_bias=np.stack([m["f_W_bias"] for m in qkv], 1),
      f_b=np.stack([m["f_b"] for m in qkv], 1),
    )
    ref["attn_c_proj"] = _module(model, "o", {"f_W": "wo", "f_b": "bo"})
    ref["c_fc"] = _module(model, "fc1", {"f_W": "w1", "f_b": "b1"})
    ref["mlp_c_proj"] = _module(model, "fc2", {"f_W": "w2", "f_b": "b2"})
  else:
    ref["lm_head"] = _np(model.head[...])
    for theirs, ours, group in (
      ("q_proj", "wq", "q"),
      ("k_proj", "wk", "k"),
      ("v_proj", "wv", "v"),
      ("o_proj", "wo", "o"),
      ("gate_proj", "w1", "fc1"),
      ("up_proj", "w3", "fc3"),
      ("down_proj", "w2", "fc2"),
    ):
      ref[theirs] = _module(model, group, {"f_W": ours})
  return ref


def _reference_expressible(model):
  """Perturbed weights the reference can hold: its norms' weight is h·f_weight + 1 and
  every bias h·f_b (no static part), and GPT's q, k, v share one time MLP."""
  _perturb_hypernet(model, scale=0.5)
  for name, spec in model.stack.specs.items():
    if spec.role in ("norm_scale", "norm_shift", "bias", "out_bias"):
      base = model.stack.gens[name].base
      base[...] = jnp.full_like(base[...], 1.0 if spec.role == "norm_scale" else 0.0)
  if model.config.family == "gpt2":
    for p in "kv":
      nnx.update(model.stack.mlps[p], nnx.state(model.stack.mlps["q"]))


CASES = {
  "gpt2": dict(family="gpt2"),
  "llama": dict(family="llama", llama_block="reference", tie_embeddings=False),
}


@pytest.mark.slow
@pytest.mark.matmul_precision("highest")
@pytest.mark.parametrize("name", list(CASES))
def test_end_step_time_is_the_reference_forward(name):
  """Max |ours - reference| / max |reference| below 1e-5 at step_time='end' (float32
  model, float64 reference); our own conventions ('start', the paper's Llama block)
  are other functions of the same weights, well outside that."""
  cfg = dataclasses.replace(TINY, time_hidden=0, step_time="end", **CASES[name])
  model = create_model(cfg, seed=5)
  _reference_expressible(model)
  toks = tokens(2, b=2, length=12)
  want = reference_logits(
    reference_params(model), toks, cfg.depth, cfg.family, cfg.time_sinusoids, cfg.rope_base
  )
  scale = np.abs(want).max()

  def error(config):
    graphdef, state = nnx.split(model)
    other = nnx.merge(nnx.graphdef(create_model(config, seed=0)), state)
    return np.abs(np.asarray(other(toks), np.float64) - want).max() / scale

  assert scale > 0.5  # logits well away from 0, so the relative error means something
  err = error(cfg)
  assert err < 1e-5, err
  assert error(dataclasses.replace(cfg, step_time="start")) > 100 * max(err, 1e-7)
  if cfg.family == "llama":
    paper = dataclasses.replace(cfg, llama_block="paper")
    paper_model = create_model(paper, seed=0)
    nnx.update(
      paper_model,
      nnx.state(model).filter(lambda path, _: not any(str(p).endswith("_shift") for p in path)),
    )
    got = np.asarray(paper_model(toks), np.float64)
    assert np.abs(got - want).max() / scale > 100 * max(err, 1e-7)
