"""Paper baseline: the discrete Llama-1B on OpenWebText (Table 2, Fig. 8).

From the authors' config/owt/llama_1b.yaml (SDML-KU/qkvflow), which sets
`model_choice: llama`: their train_lm.py then builds levanter's discrete Llama, not an
ODE. So this is that baseline: 16 layers, d 2048, 16 heads, MLP 8192 (SwiGLU), RMSNorm,
RoPE, no biases, no dropout, untied LM head, sequence 2048, batch 256, 40,001 steps,
peak lr 3e-4 (1% warm-up, cosine to 0.1×), AdamW β2 0.95, ε 1e-8, weight decay 1e-5 on
weight matrices and embeddings, bf16 compute with f32 params. Token embeddings start
at N(0, 1) as levanter's Llama. The authors tokenise with Llama-2's 32,000-piece
tokenizer; we train a 32,000-piece SentencePiece on the training split. Our
Llama-family DiffEqFormer at this shape is configs/owt_llama_1b_ode.py.

  python main.py --config=configs/owt_llama_1b.py --workdir=$W --config.data.data_dir=$DATA

Expect: validation perplexity above owt_llama_1b_ode's DiffEqFormer (paper Table 2,
Fig. 8). Not run by us (8 × H100 in the paper; ~1.2 B parameters).
"""

from configs import owt_large


def get_config():
  config = owt_large.get_config()
  config.seq_len = 2048
  config.eval_batch_size = 128  # 128 × 2048: the same tokens per evaluation batch
  config.model.kind = "transformer"  # discrete; with family 'llama', Llama blocks
  config.model.family = "llama"
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.mlp_dim = 8192
  config.model.num_layers = 16  # L
  config.model.solver_steps = 16  # K of owt_llama_1b_ode.py
  config.model.max_len = 2048
  config.model.time_sinusoids = 256  # the yaml's sinusodial_dim (used by the ODE variant)
  config.model.dropout_rate = 0.0  # levanter's Llama has no dropout
  config.model.tie_embeddings = False
  config.data.vocab_size = 32000
  config.optim.b2 = 0.95
  config.optim.eps = 1e-8
  config.optim.weight_decay = 1e-5  # 'auto': weight matrices and embeddings, as train_lm.py
  return config
