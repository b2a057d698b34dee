"""Parallel-block transformer for Hugging Face transformers (`trust_remote_code=True`).

`python -m odetransformer.export` copies this file into an exported directory as
`modeling_odetransformer.py`; it imports only torch and transformers. The model is a
DiffEqFormer (or weight-sharing ODE) materialised at N Euler steps, or a discrete
parallel-block model: layer k adds Attn(N1(x)) + FFN(N2(x)) to x, the step size dt
already multiplied into each layer's output projections and their biases.

Config fields beyond the usual ones: `family` 'gpt2' (learned positions, LayerNorms with
bias, biases, tanh-GELU MLP) or 'llama' (RoPE, RMSNorms, no biases, SwiGLU);
`block_norm` 'layer' | 'rms' | 'rms_shift' (an RMSNorm plus a bias: the authors' Llama
block, whose time-dependent shift is a constant per layer once materialised) with
`block_norm_eps`; `ffn_reads_attn_norm` (the FFN normalises N1(x) instead of x);
`embed_scale` on the input embeddings.
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast


class OdeTransformerConfig(PreTrainedConfig):
  model_type = "odetransformer"
  keys_to_ignore_at_inference = ["past_key_values"]

  vocab_size: int = 2048
  hidden_size: int = 128
  intermediate_size: int = 512
  num_hidden_layers: int = 4
  num_attention_heads: int = 4
  max_position_embeddings: int = 256
  family: str = "gpt2"
  norm_eps: float = 1e-5
  block_norm: str = "layer"
  block_norm_eps: float = 1e-5
  ffn_reads_attn_norm: bool = False
  rope_base: float = 10000.0
  embed_scale: float = 1.0
  tie_word_embeddings: bool = True
  use_cache: bool = True
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  eos_token_id: int | None = None


class Norm(nn.Module):
  """LayerNorm ('layer'), RMSNorm ('rms') or RMSNorm plus a bias ('rms_shift'), in
  float32."""

  def __init__(self, size, kind, eps):
    super().__init__()
    self.kind, self.eps = kind, eps
    self.weight = nn.Parameter(torch.ones(size))
    self.bias = nn.Parameter(torch.zeros(size)) if kind != "rms" else None

  def forward(self, x):
    h = x.float()
    if self.kind == "layer":
      h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
    if self.bias is not None:
      h = h + self.bias.float()
    return h.to(x.dtype)


def rope(x, positions, base):
  """Rotary embedding (rotate-half) of x [b, heads, t, head_dim] at positions [b, t]."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (
    base ** (torch.arange(0, 2 * half, 2, dtype=torch.float32, device=x.device) / (2 * half))
  )
  angle = positions.float()[:, None, :, None] * inv_freq
  cos, sin = angle.cos(), angle.sin()
  x1, x2 = x.float()[..., :half], x.float()[..., half:]
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Attention(nn.Module):
  def __init__(self, config, layer_idx):
    super().__init__()
    d, bias = config.hidden_size, config.family == "gpt2"
    self.layer_idx, self.config = layer_idx, config
    self.heads = config.num_attention_heads
    self.q_proj = nn.Linear(d, d, bias=bias)
    self.k_proj = nn.Linear(d, d, bias=bias)
    self.v_proj = nn.Linear(d, d, bias=bias)
    self.o_proj = nn.Linear(d, d, bias=bias)

  def forward(self, x, positions, mask, cache):
    b, t, d = x.shape
    split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
    q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
    if self.config.family == "llama":
      q, k = rope(q, positions, self.config.rope_base), rope(k, positions, self.config.rope_base)
    if cache is not None:
      k, v = cache.update(k, v, self.layer_idx)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return self.o_proj(o.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
  def __init__(self, config):
    super().__init__()
    d, f, gpt = config.hidden_size, config.intermediate_size, config.family == "gpt2"
    self.gpt = gpt
    self.fc1 = nn.Linear(d, f, bias=gpt)
    self.fc2 = nn.Linear(f, d, bias=gpt)
    self.fc3 = None if gpt else nn.Linear(d, f, bias=False)

  def forward(self, x):
    if self.gpt:
      return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
    return self.fc2(F.silu(self.fc1(x)) * self.fc3(x))


class ParallelLayer(nn.Module):
  """x + Attn(N1(x)) + FFN(N2(x)), or FFN(N2(N1(x))) with `ffn_reads_attn_norm`."""

  def __init__(self, config, layer_idx):
    super().__init__()
    self.norm1 = Norm(config.hidden_size, config.block_norm, config.block_norm_eps)
    self.norm2 = Norm(config.hidden_size, config.block_norm, config.block_norm_eps)
    self.attn = Attention(config, layer_idx)
    self.mlp = MLP(config)
    self.ffn_reads_attn_norm = config.ffn_reads_attn_norm

  def forward(self, x, positions, mask, cache):
    h = self.norm1(x)
    a = self.attn(h, positions, mask, cache)
    return x + a + self.mlp(self.norm2(h if self.ffn_reads_attn_norm else x))


class OdeTransformerPreTrainedModel(PreTrainedModel):
  config_class = OdeTransformerConfig
  base_model_prefix = "model"
  _no_split_modules = ["ParallelLayer"]
  _supports_sdpa = True


class OdeTransformerModel(OdeTransformerPreTrainedModel):
  def __init__(self, config):
    super().__init__(config)
    self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
    if config.family == "gpt2":
      self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
    self.layers = nn.ModuleList(ParallelLayer(config, i) for i in range(config.num_hidden_layers))
    self.norm = Norm(
      config.hidden_size, "layer" if config.family == "gpt2" else "rms", config.norm_eps
    )
    self.post_init()

  def forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    use_cache=None,
    **kwargs,
  ):
    x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    b, t = x.shape[:2]
    use_cache = self.config.use_cache if use_cache is None else use_cache
    if use_cache and past_key_values is None:
      past_key_values = DynamicCache(config=self.config)
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    if position_ids is None:
      position_ids = (torch.arange(t, device=x.device) + past)[None].expand(b, t)
    if self.config.family == "gpt2":
      x = x + self.embed_positions(position_ids)
    x = x * self.config.embed_scale
    # Causal within the cache and the padding mask; each token always sees itself, so
    # a padded position stays finite.
    keys = torch.arange(past + t, device=x.device)
    queries = torch.arange(t, device=x.device)[:, None] + past
    mask = (keys[None, :] <= queries)[None, None]
    if attention_mask is not None:
      mask = mask & attention_mask[:, None, None, -(past + t) :].bool()
    mask = mask | (keys[None, :] == queries)[None, None]
    for layer in self.layers:
      x = layer(x, position_ids, mask, past_key_values if use_cache else None)
    return self.norm(x), past_key_values


class OdeTransformerForCausalLM(OdeTransformerPreTrainedModel, GenerationMixin):
  _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

  def __init__(self, config):
    super().__init__(config)
    self.model = OdeTransformerModel(config)
    self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    self.post_init()

  def forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
  ):
    hidden, cache = self.model(
      input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache
    )
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden[:, keep])
    loss = None
    if labels is not None:
      loss = self.loss_function(
        logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
      )
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
