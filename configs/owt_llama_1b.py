"""Paper: Llama-flavoured DiffEqFormer at Llama-1B shape on OpenWebText (Table 3, C.6).

From the authors' config/owt/llama_1b.yaml (SDML-KU/qkvflow). Differs from owt_large:
the llama flavour (RMSNorm, RoPE, SwiGLU with three time-dependent matrices, no biases,
no dropout, untied LM head), 16 steps/layers, d 2048, 16 heads, MLP 8192, sequence
2048, S 256 sinusoids (d_t stays 96), AdamW β2 0.95, ε 1e-8, weight decay 1e-5. The
authors tokenise with Llama-2's 32,000-piece tokenizer; we train a 32,000-piece
SentencePiece on the training split.

  python main.py --config=configs/owt_llama_1b.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/owt_llama_1b.py --config.model.kind=gpt --workdir=$W_gpt --config.data.data_dir=$DATA
(`kind=gpt` with flavour 'llama' is the discrete Llama baseline.)

Expect: DiffEqFormer clearly below the Llama-1B baseline in validation perplexity
(paper Table 2, Fig. 8). Not run by us (8 × H100 in the paper; ~1.2 B Llama params).
"""
from configs import owt_large


def get_config():
  config = owt_large.get_config()
  config.seq_len = 2048
  config.eval_batch_size = 128          # 128 × 2048: the same tokens per evaluation batch
  config.model.flavour = "llama"
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.mlp_dim = 8192
  config.model.num_steps = 16
  config.model.max_len = 2048
  config.model.time_sinusoids = 256
  config.model.dropout_rate = 0.0       # levanter's Llama has no dropout
  config.model.tie_embeddings = False
  config.data.vocab_size = 32000
  config.optim.b2 = 0.95
  config.optim.eps = 1e-8
  # The authors' Llama-ODE branch sets no decay mask (all parameters decay); at 1e-5 over
  # 40k steps that shrinks weights by < 0.02%, so the 'auto' group (embeddings) is kept.
  config.optim.weight_decay = 1e-5
  return config
