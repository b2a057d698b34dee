"""Importing a Hugging Face checkpoint (odetransformer/tools/hf_import.py): the model
computes what transformers computes on the same weights, export then import gives back
the same state, and what the model cannot hold is a one-line error."""

import json

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from odetransformer.errors import UserError
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import create_model
from odetransformer.tools import hf_convert, hf_import

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.matmul_precision("highest")

VOCAB, LENGTH = 97, 12


def _gpt2(tie: bool = True, vocab_size: int = VOCAB):
  return transformers.GPT2LMHeadModel(
    transformers.GPT2Config(
      vocab_size=vocab_size,
      n_embd=32,
      n_layer=2,
      n_head=4,
      n_inner=48,
      n_positions=16,
      activation_function="gelu_new",
      layer_norm_epsilon=1e-5,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
      tie_word_embeddings=tie,
    )
  )


def _llama(tie: bool = False, vocab_size: int = VOCAB, **kw):
  return transformers.LlamaForCausalLM(
    transformers.LlamaConfig(
      vocab_size=vocab_size,
      hidden_size=32,
      intermediate_size=40,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=kw.pop("num_key_value_heads", 4),
      max_position_embeddings=64,
      rms_norm_eps=1e-5,
      rope_theta=kw.pop("rope_theta", 100_000.0),
      tie_word_embeddings=tie,
      **kw,
    )
  )


def _saved(model, path, safe: bool = True):
  torch.manual_seed(0)
  for p in model.parameters():  # norms too: a test of their mapping needs non-unit scales
    torch.nn.init.normal_(p, std=0.2)
  model.eval()
  model.save_pretrained(path, safe_serialization=safe)
  return model


def _logits_both(model, path):
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH))
  with torch.no_grad():
    expected = model(torch.as_tensor(tokens)).logits.numpy()
  hf, weights = hf_import.read_hf_dir(str(path))
  ours = hf_import.model_from_hf(hf_import.model_config_from_hf(hf), weights)
  return np.asarray(ours(jnp.asarray(tokens, jnp.int32)), np.float32), expected


@pytest.mark.parametrize(
  "build, safe",
  [
    (lambda: _gpt2(tie=True), True),
    (lambda: _gpt2(tie=False), False),  # untied, and PyTorch's pytorch_model.bin
    (lambda: _llama(tie=False), True),
    (lambda: _llama(tie=True), True),
    (lambda: _llama(tie=True, num_key_value_heads=2), True),  # grouped-query attention
    (lambda: _llama(tie=False, num_key_value_heads=1), True),  # multi-query attention
  ],
  ids=["gpt2-tied", "gpt2-untied-bin", "llama-untied", "llama-tied", "llama-gqa", "llama-mqa"],
)
def test_imported_logits_equal_transformers(build, safe, tmp_path):
  model = _saved(build(), tmp_path, safe)
  ours, expected = _logits_both(model, tmp_path)
  scale = np.abs(expected).max()
  assert np.abs(ours - expected).max() <= 2e-6 * scale + 1e-6, np.abs(ours - expected).max()


def test_the_rope_base_and_norm_eps_come_from_the_checkpoint(tmp_path):
  hf = _saved(_llama(rope_theta=500.0), tmp_path)
  cfg = hf_import.model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
  assert (cfg.rope_base, cfg.norm_eps, cfg.family, cfg.kind) == (
    500.0,
    1e-5,
    "llama",
    "transformer",
  )
  ours, expected = _logits_both(hf, tmp_path)
  assert np.abs(ours - expected).max() <= 2e-6 * np.abs(expected).max() + 1e-6


@pytest.mark.parametrize("family, kv_heads", [("gpt2", None), ("llama", None), ("llama", 2)])
def test_export_then_import_gives_back_the_same_state(family, kv_heads, tmp_path):
  cfg = ModelConfig(
    kind="transformer",
    family=family,
    vocab_size=VOCAB,
    d_model=32,
    num_heads=4,
    num_kv_heads=kv_heads,
    mlp_dim=48,
    num_layers=2,
    max_len=16,
    tie_embeddings=family == "gpt2",
    rope_base=10000.0,
  )
  model = create_model(cfg, seed=3)
  hf = hf_convert.hf_config(cfg, context=16, dtype="float32", special={})
  back = hf_import.model_from_hf(
    hf_import.model_config_from_hf(hf), hf_convert.hf_state_dict(model)
  )
  a, b = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(back))
  flat = lambda d, p="": (
    {k2: v2 for k, v in d.items() for k2, v2 in flat(v, f"{p}/{k}").items()}
    if isinstance(d, dict)
    else {p: d}
  )
  a, b = flat(a), flat(b)
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


@pytest.mark.parametrize(
  "change, message",
  [
    (
      {"architectures": ["MistralForCausalLM"]},
      "architecture 'MistralForCausalLM' is not supported",
    ),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
  ],
)
def test_what_the_model_cannot_hold_is_one_line(change, message, tmp_path):
  _saved(_llama(), tmp_path)
  hf = {**json.loads((tmp_path / "config.json").read_text()), **change}
  with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
    hf_import.model_config_from_hf(hf)
  assert "\n" not in str(e.value)


def test_weights_that_do_not_match_the_config_are_one_line(tmp_path):
  _saved(_llama(), tmp_path)
  hf, weights = hf_import.read_hf_dir(str(tmp_path))
  cfg = hf_import.model_config_from_hf(hf)
  short = dict(weights)
  del short["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(UserError, match="no 'model.layers.1.mlp.up_proj.weight'"):
    hf_import.model_from_hf(cfg, short)
  wide = dict(weights)
  for i in (0, 1):
    wide[f"model.layers.{i}.mlp.up_proj.weight"] = np.zeros((41, 32), np.float32)
  with pytest.raises(UserError, match=r"weight /stack/params/w3 has shape \(2, 32, 41\)"):
    hf_import.model_from_hf(cfg, wide)
  with pytest.raises(UserError, match="holds no config.json"):
    hf_import.read_hf_dir(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("kind", ["transformer", "diffeqformer"])
def test_grouped_query_attention_is_attention_with_repeated_key_value_heads(kind):
  """A model with 2 key/value heads for 4 query heads computes what the same model with
  4 computes when its W_K, W_V repeat each head for the query heads that read it (head i
  reads i // 2), for the baseline and for an ODE's generated weights alike."""
  base = dict(kind=kind, family="llama", vocab_size=VOCAB, d_model=32, num_heads=4, mlp_dim=48)
  depth = {"num_layers": 2} if kind == "transformer" else {"solver_steps": 2}
  gqa = create_model(ModelConfig(**base, **depth, num_kv_heads=2), seed=1)
  mha_cfg = ModelConfig(**base, **depth)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, LENGTH)), jnp.int32)
  if kind == "transformer":
    layers = dict(gqa.layer_weights())
    assert layers["wk"].shape == layers["wv"].shape == (2, 32, 2, 8)  # [L, d, kv heads, h]
    layers["wk"], layers["wv"] = (jnp.repeat(layers[k], 2, axis=2) for k in ("wk", "wv"))
    mha = gqa.with_layers(mha_cfg, layers)
  else:  # the hypernetwork's generators of W_K, W_V: each output head's columns repeated
    state = nnx.to_pure_dict(nnx.state(gqa))
    mha = create_model(mha_cfg, seed=1)
    target = nnx.to_pure_dict(nnx.state(mha))
    _repeat_kv_generators(state, target, heads=4, kv_heads=2)
    nnx.update(mha, nnx.State(state))
  np.testing.assert_allclose(np.asarray(gqa(tokens)), np.asarray(mha(tokens)), rtol=1e-5, atol=1e-5)


def _repeat_kv_generators(state, target, heads, kv_heads):
  """Every leaf of `state` (a GQA model's) under a 'wk' or 'wv' path given the shape of
  `target`'s (an MHA model's), by repeating along the one axis that differs."""
  for key, value in state.items():
    if isinstance(value, dict):
      _repeat_kv_generators(value, target[key], heads, kv_heads)
    elif value.shape != target[key].shape:
      axis = next(i for i, (a, b) in enumerate(zip(value.shape, target[key].shape)) if a != b)
      group = target[key].shape[axis] // value.shape[axis]
      # A flattened (heads × head_dim) axis repeats in blocks of head_dim.
      head_dim = value.shape[axis] // kv_heads
      blocks = value.reshape(value.shape[:axis] + (kv_heads, head_dim) + value.shape[axis + 1 :])
      state[key] = jnp.repeat(blocks, group, axis=axis).reshape(target[key].shape)


def _write_gguf(model, path, architecture="llama", embeddings_as=None):
  """A llama GGUF file of a transformers Llama, as llama.cpp's converter writes one:
  float32 tensors under its names, each head's W_Q and W_K rows permuted to interleave
  the halves RoPE rotates (reshape (heads, 2, half, in), swap the middle axes).
  `embeddings_as`: a quantisation type whose (zero) blocks stand for the embeddings."""
  gguf = pytest.importorskip("gguf")
  c = model.config
  writer = gguf.GGUFWriter(str(path), architecture)
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_vocab_size(c.vocab_size)

  def permute(w, heads):
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

  names = {v.format(i="{i}"): k for k, v in hf_import._GGUF_NAMES.items()}
  for name, tensor in model.state_dict().items():
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue
    w = tensor.detach().numpy().astype(np.float32)
    parts = name.split(".")
    key = ".".join(parts[:2] + ["{i}"] + parts[3:]) if name.startswith("model.layers.") else name
    gguf_name = names[key].format(i=parts[2] if "{i}" in key else "")
    if ".attn_q." in gguf_name:
      w = permute(w, c.num_attention_heads)
    elif ".attn_k." in gguf_name:
      w = permute(w, c.num_key_value_heads)
    if embeddings_as is not None and gguf_name == "token_embd.weight":
      block, size = gguf.constants.GGML_QUANT_SIZES[embeddings_as]
      raw = np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8)
      writer.add_tensor(gguf_name, raw, raw_dtype=embeddings_as)
      continue
    writer.add_tensor(gguf_name, np.ascontiguousarray(w))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("tie", [True, False])
def test_a_llama_gguf_file_imports_to_transformers_logits(tie, tmp_path):
  """A GGUF file written as llama.cpp writes one (permuted W_Q, W_K rows, grouped-query
  attention) reads back to the transformers model's weights and logits."""
  model = _saved(_llama(tie=tie, num_key_value_heads=2, rope_theta=5_000.0), tmp_path)
  _write_gguf(model, tmp_path / "model.gguf")
  hf, weights = hf_import.read_gguf(str(tmp_path / "model.gguf"))
  expected_weights = {k: v.numpy() for k, v in model.state_dict().items()}
  if tie:
    del expected_weights["lm_head.weight"]
  assert weights.keys() == expected_weights.keys()
  for name, w in weights.items():
    np.testing.assert_array_equal(w, expected_weights[name], err_msg=name)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH))
  with torch.no_grad():
    expected = model(torch.as_tensor(tokens)).logits.numpy()
  ours = hf_import.model_from_hf(hf_import.model_config_from_hf(hf), weights)
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)), np.float32)
  assert np.abs(got - expected).max() <= 2e-6 * np.abs(expected).max() + 1e-6


def test_a_gguf_file_of_another_architecture_is_one_line(tmp_path):
  _write_gguf(_saved(_llama(), tmp_path), tmp_path / "model.gguf", architecture="gpt2")
  with pytest.raises(UserError, match="GGUF architecture 'gpt2' is not supported") as e:
    hf_import.read_gguf(str(tmp_path / "model.gguf"))
  assert "\n" not in str(e.value)
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
  with pytest.raises(UserError, match="is not a readable GGUF file"):
    hf_import.read_gguf(str(tmp_path / "junk.gguf"))


def test_a_quantisation_the_reader_cannot_dequantise_is_one_line(tmp_path):
  """Q8_1 (llama.cpp's intermediate type, which the gguf package does not dequantise)."""
  gguf = pytest.importorskip("gguf")
  q8_1 = gguf.GGMLQuantizationType.Q8_1
  _write_gguf(_saved(_llama(), tmp_path), tmp_path / "model.gguf", embeddings_as=q8_1)
  with pytest.raises(UserError, match="token_embd.weight is Q8_1, a type the gguf reader") as e:
    hf_import.read_gguf(str(tmp_path / "model.gguf"))
  assert "\n" not in str(e.value) and "Q8_0" in str(e.value)
