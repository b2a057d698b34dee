"""A Hugging Face model directory as one of this project's models: the inverse of
`hf_convert` (export).

    hf, weights = read_hf_dir(path)          # config.json, safetensors or PyTorch weights
    hf, weights = read_gguf(path)            # or a GGUF file (llama), dequantised
    cfg = model_config_from_hf(hf)           # the matching baseline: kind 'transformer'
    model = model_from_hf(cfg, weights)      # a LanguageModel with those weights

`GPT2LMHeadModel` becomes the gpt2 family (LayerNorm, tanh GELU, learned positions) and
`LlamaForCausalLM` the llama family (RMSNorm, SwiGLU, RoPE with the checkpoint's base,
grouped-query attention with its key/value heads),
both with the checkpoint's norm eps and tied or untied embeddings. What the model cannot
hold (another architecture, biases on Llama's projections, an
activation other than GPT-2's) is a one-line UserError naming it and what is supported.
The weights arrive in float32; the model computes what transformers computes on them
(tests/test_hf_import.py: equal logits to float32 rounding).
"""

import json
import os

from flax import nnx
import jax.numpy as jnp
import numpy as np

from odetransformer.errors import UserError
from odetransformer.model.config import ModelConfig
from odetransformer.model.transformer import LanguageModel, abstract_model
from odetransformer.tools.hf_convert import LLAMA_LAYER_NAMES

SUPPORTED = ("GPT2LMHeadModel", "LlamaForCausalLM")
# Buffers some checkpoints carry beside their parameters: recomputed, never loaded.
_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def read_hf_dir(path: str) -> tuple:
  """(config.json as a dict, {parameter name: float32 numpy array}) of a transformers
  model directory: model.safetensors, its sharded index, or pytorch_model.bin."""
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise UserError(
      f"{path} holds no config.json; pass a Hugging Face model directory "
      "(config.json with model.safetensors or pytorch_model.bin)"
    )
  with open(config_path, encoding="utf-8") as f:
    hf = json.load(f)
  files = _weight_files(path)
  weights = {}
  for name in files:
    weights.update(_read_weights(os.path.join(path, name)))
  return hf, {k: v for k, v in weights.items() if not k.endswith(_BUFFERS)}


# GGUF tensor names (llama.cpp's) -> transformers' (`{i}`: the layer).
_GGUF_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
  "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
  "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
  "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
  "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
  "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
  "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
  "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
  "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
  "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def read_gguf(path: str) -> tuple:
  """(a transformers-style config dict, {transformers name: float32 array}) of a llama
  GGUF file, every tensor dequantised (the `gguf` package: requirements-import.txt).

  llama.cpp stores each head's rows of W_Q and W_K with the two halves RoPE rotates
  interleaved (its converter's permutation); they are put back in Hugging Face's order."""
  try:
    import gguf  # lazy: requirements-import.txt
  except ImportError as e:
    raise UserError(
      "reading a GGUF file needs the gguf package: pip install -r requirements-import.txt"
    ) from e
  if not os.path.isfile(path):
    raise UserError(f"{path} is not a file; pass a .gguf file or a model directory")
  try:
    reader = gguf.GGUFReader(path)
  except (ValueError, OSError) as e:
    raise UserError(f"{path} is not a readable GGUF file ({e})") from e
  meta = {
    name: field.contents()
    for name, field in reader.fields.items()
    if not name.startswith("tokenizer.ggml.")
  }
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise UserError(
      f"GGUF architecture {arch!r} is not supported; the import reads llama GGUF files "
      "(and GPT-2 or Llama model directories)"
    )
  key = lambda name: meta[f"llama.{name}"]
  heads, kv_heads = int(key("attention.head_count")), int(key("attention.head_count_kv"))
  names = {t.name for t in reader.tensors}
  hf = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": int(
      meta.get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    ),
    "hidden_size": int(key("embedding_length")),
    "intermediate_size": int(key("feed_forward_length")),
    "num_hidden_layers": int(key("block_count")),
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
    "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
    "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
    "tie_word_embeddings": "output.weight" not in names,
  }
  patterns = {}
  for gguf_name, hf_name in _GGUF_NAMES.items():
    for i in range(hf["num_hidden_layers"]) if "{i}" in gguf_name else [None]:
      patterns[gguf_name.format(i=i)] = hf_name.format(i=i)
  weights = {}
  for tensor in reader.tensors:
    if tensor.name not in patterns:
      raise UserError(f"GGUF tensor {tensor.name!r} has no place in a llama model")
    try:
      w = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    except (NotImplementedError, gguf.quants.QuantError) as e:
      raise UserError(
        f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, a type the gguf reader "
        f"does not dequantise ({e}); re-quantise the file to a supported type, e.g. Q8_0"
      ) from e
    w = w.reshape(tuple(int(n) for n in reversed(tensor.shape)))  # rows: [out, in]
    if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
      w = _unpermute_rope_rows(w, heads if ".attn_q." in tensor.name else kv_heads)
    weights[patterns[tensor.name]] = w
  return hf, weights


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's W_Q / W_K rows [heads × (2 × half), in], each head's (half, 2) order,
  back to Hugging Face's (2, half): the inverse of its converter's permutation."""
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weight_files(path: str) -> list:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      return sorted(set(json.load(f)["weight_map"].values()))
  for name in ("model.safetensors", "pytorch_model.bin"):
    if os.path.isfile(os.path.join(path, name)):
      return [name]
  raise UserError(
    f"{path} holds no model.safetensors, model.safetensors.index.json or "
    "pytorch_model.bin; save the model with save_pretrained"
  )


def _read_weights(file: str) -> dict:
  if file.endswith(".safetensors"):
    from safetensors.numpy import load_file  # lazy: only an import reads them

    try:
      return {k: np.asarray(v, np.float32) for k, v in load_file(file).items()}
    except TypeError:  # bfloat16 has no numpy dtype: read through torch
      pass
  import torch  # lazy: requirements-export.txt

  if file.endswith(".safetensors"):
    from safetensors.torch import load_file as load_torch

    tensors = load_torch(file)
  else:
    tensors = torch.load(file, map_location="cpu", weights_only=True)
  return {k: v.detach().to(torch.float32).numpy() for k, v in tensors.items()}


def _architecture(hf: dict) -> str:
  arch = (hf.get("architectures") or [""])[0]
  if arch not in SUPPORTED:
    raise UserError(
      f"architecture {arch or hf.get('model_type')!r} is not supported; the import reads "
      f"{' and '.join(SUPPORTED)} checkpoints"
    )
  return arch


def model_config_from_hf(hf: dict, dtype: str = "float32") -> ModelConfig:
  """The baseline (`kind='transformer'`) config that holds a checkpoint of config `hf`."""
  arch = _architecture(hf)
  common = dict(
    kind="transformer",
    vocab_size=int(hf["vocab_size"]),
    dtype=dtype,
    param_dtype="float32",
    state_dtype="float32",
    dropout_rate=0.0,
    remat_policy="none",
  )
  if arch == "GPT2LMHeadModel":
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
      raise UserError(
        f"GPT-2 activation_function={act!r} is not supported; the gpt2 family computes "
        "the tanh GELU ('gelu_new')"
      )
    d = int(hf["n_embd"])
    return ModelConfig(
      family="gpt2",
      d_model=d,
      num_heads=int(hf["n_head"]),
      mlp_dim=int(hf.get("n_inner") or 4 * d),
      num_layers=int(hf["n_layer"]),
      max_len=int(hf["n_positions"]),
      norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      **common,
    )
  heads = int(hf["num_attention_heads"])
  kv_heads = int(hf.get("num_key_value_heads") or heads)
  if kv_heads <= 0 or heads % kv_heads:
    raise UserError(
      f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}; "
      "grouped-query attention needs a whole number of query heads per key/value head"
    )
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise UserError(f"Llama {key}=true is not supported; the llama family has no biases")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UserError(f"Llama hidden_act={act!r} is not supported; the llama family is SwiGLU")
  d = int(hf["hidden_size"])
  if int(hf.get("head_dim") or d // heads) * heads != d:
    raise UserError(
      f"Llama head_dim={hf['head_dim']} × {heads} heads differs from hidden_size={d}; "
      "the llama family splits the width evenly over the heads"
    )
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if rope.get("rope_type", "default") != "default":
    raise UserError(
      f"Llama rope_type={rope['rope_type']!r} is not supported; the llama family "
      "computes the default RoPE"
    )
  return ModelConfig(
    family="llama",
    d_model=d,
    num_heads=heads,
    num_kv_heads=kv_heads if kv_heads != heads else None,
    mlp_dim=int(hf["intermediate_size"]),
    num_layers=int(hf["num_hidden_layers"]),
    max_len=int(hf.get("max_position_embeddings", 2048)),
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    **common,
  )


def _layer(cfg: ModelConfig, weights: dict, i: int) -> dict:
  """Layer i's weights under this project's names, in the checkpoint's layout."""
  d = cfg.d_model
  if cfg.family == "gpt2":
    p = f"transformer.h.{i}."
    qkv_w, qkv_b = _take(weights, p + "attn.c_attn.weight"), _take(weights, p + "attn.c_attn.bias")
    out = {
      "norm1_scale": _take(weights, p + "ln_1.weight"),
      "norm1_shift": _take(weights, p + "ln_1.bias"),
      "norm2_scale": _take(weights, p + "ln_2.weight"),
      "norm2_shift": _take(weights, p + "ln_2.bias"),
      "wo": _take(weights, p + "attn.c_proj.weight"),  # Conv1D: [in, out]
      "bo": _take(weights, p + "attn.c_proj.bias"),
      "w1": _take(weights, p + "mlp.c_fc.weight"),
      "b1": _take(weights, p + "mlp.c_fc.bias"),
      "w2": _take(weights, p + "mlp.c_proj.weight"),
      "b2": _take(weights, p + "mlp.c_proj.bias"),
    }
    for j, (w, b) in enumerate((("wq", "bq"), ("wk", "bk"), ("wv", "bv"))):
      out[w], out[b] = qkv_w[:, j * d : (j + 1) * d], qkv_b[j * d : (j + 1) * d]
    return out
  # torch Linear weights are [out, in]; this project's are [in, ...out].
  p = f"model.layers.{i}."
  return {
    n: _take(weights, p + key) if n.startswith("norm") else _take(weights, p + key + ".weight").T
    for n, key in LLAMA_LAYER_NAMES.items()
  }


def _take(weights: dict, key: str) -> np.ndarray:
  if key not in weights:
    raise UserError(f"the checkpoint has no {key!r}; it does not match its config.json")
  return weights.pop(key)


def model_from_hf(cfg: ModelConfig, weights: dict) -> LanguageModel:
  """The model of config `cfg` (`model_config_from_hf`) holding the checkpoint's
  `weights` (transformers names); every parameter is given, and every weight used. A
  shape that does not match, a weight missing or one left over is a one-line UserError."""
  weights = dict(weights)
  graphdef, state = abstract_model(cfg)
  target = nnx.to_pure_dict(state)
  gpt2 = cfg.family == "gpt2"
  top = {
    "embed": "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight",
    "final_norm_scale": "transformer.ln_f.weight" if gpt2 else "model.norm.weight",
  }
  if gpt2:
    top.update(pos_embed="transformer.wpe.weight", final_norm_shift="transformer.ln_f.bias")
  values = {name: _take(weights, key) for name, key in top.items()}
  if not cfg.tie_embeddings:
    values["head"] = _take(weights, "lm_head.weight").T  # [V, d] -> [d, V]
  elif "lm_head.weight" in weights:  # a tied checkpoint may store the shared table twice
    head = weights.pop("lm_head.weight")
    if not np.array_equal(head, values["embed"]):
      raise UserError(
        "tie_word_embeddings is true but lm_head.weight differs from the token embeddings; "
        "set tie_word_embeddings=false in config.json to import the separate head"
      )
  layers = [_layer(cfg, weights, i) for i in range(cfg.num_layers)]
  if weights:
    extra = sorted(weights)[:3]
    raise UserError(
      f"the checkpoint has {len(weights)} weights this {cfg.family} model has no place for "
      f"(e.g. {extra}); its config.json does not describe its weights"
    )
  for name in layers[0]:
    shapes = {l[name].shape for l in layers}
    if len(shapes) > 1:
      raise UserError(
        f"layer weight {name} has shapes {sorted(shapes)} across layers; one is wrong"
      )
  values["stack"] = {"params": {n: np.stack([l[n] for l in layers]) for n in layers[0]}}
  filled = _fit(target, values, "")
  nnx.replace_by_pure_dict(state, filled)
  return nnx.merge(graphdef, state)


def _fit(target, values, path: str):
  """`values` reshaped onto `target`'s (abstract) leaves, in their dtypes; every leaf
  given, each with as many elements as the target's."""
  if isinstance(target, dict):
    missing = sorted(set(target) - set(values))
    if missing:
      raise UserError(f"the checkpoint gives no weight for {path or '/'}{missing}")
    return {k: _fit(target[k], values[k], f"{path}/{k}") for k in target}
  value = np.asarray(values)
  if value.size != int(np.prod(target.shape)):
    raise UserError(
      f"weight {path} has shape {value.shape}, this model's is {tuple(target.shape)}; "
      "the checkpoint does not match its config.json"
    )
  return jnp.asarray(value.reshape(target.shape), target.dtype)
