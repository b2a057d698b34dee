"""Paper Fig. 5 (left): pre-train on OpenWebText with 18 steps at GPT-medium width,
fine-tune on WikiText-103 with N ∈ {9, 12, 18, 24} steps, each method.

From the authors' config/finetune/owt_wiki.yaml (SDML-KU/qkvflow): pre-training with
18 steps, d_t 100, S 256, batch 256, 10,001 steps at lr 3e-4; fine-tuning with batch
256, 10,001 steps at lr 3e-4 (weight decay 0.1, cosine to 0.1×) for every method; LoRA
of rank 200 with alpha 8 (levanter's default) on every linear map of every layer
(W_Q, W_K, W_V, W_O, W_1, W_2), both factors starting at 1e-6·N(0, 1) (their lora.py),
with the embeddings trained too. The GPT baseline has 24 layers (paper Section 6.2).

Pre-train (DiffEqFormer with 18 steps, and the 24-layer GPT baseline):
  python main.py --config=configs/owt_medium.py --workdir=$PRE --config.data.data_dir=$DATA \
      --config.model.solver_steps=18 --config.model.time_embed_dim=100 \
      --config.model.time_sinusoids=256 --config.num_train_steps=10001
  python main.py --config=configs/owt_medium.py --workdir=$PRE_GPT --config.data.data_dir=$DATA \
      --config.model.kind=transformer --config.model.num_layers=24 --config.num_train_steps=10001
Fine-tune, for N in 9 12 18 24 and METHOD in continuous full lora (the GPT: full, lora
at its own 24 layers: --config.init_from=$PRE_GPT, no --config.finetune.solver_steps):
  python main.py --config=configs/finetune_owt_to_wiki.py --workdir=$W_${METHOD}_$N \
      --config.init_from=$PRE --config.finetune.method=$METHOD \
      --config.finetune.solver_steps=$N --config.data.data_dir=$DATA

Expect: with LoRA every N beats the GPT baseline; full fine-tuning is comparable to
GPT, and fewer steps overfit less (paper Section 6.2). Not run by us (accelerator pod).
"""

import ml_collections

from configs import wikitext103_medium


def get_config():
  config = wikitext103_medium.get_config()  # batch 256, 10,001 steps, lr 3e-4, β2 0.999
  config.init_from = ""  # required: the OpenWebText pre-training workdir
  config.finetune = ml_collections.ConfigDict()
  config.finetune.method = "lora"  # 'continuous' | 'full' | 'lora'
  config.finetune.solver_steps = 24  # N ∈ {9, 12, 18, 24}; the yaml's finetune_layer
  # Deprecated name of solver_steps (0 = the pre-trained K), kept so old flags parse:
  config.finetune.num_steps = ml_collections.config_dict.placeholder(int)
  config.finetune.lora_rank = 200
  config.finetune.lora_alpha = 8.0  # scale alpha / rank = 0.04
  config.finetune.targets = "wq,wk,wv,wo,w1,w2"
  config.finetune.lora_init = "small"  # A, B ~ 1e-6·N(0, 1), as the authors' lora.py
  config.finetune.train_embeddings = True
  # Must equal the pre-trained model's (the fine-tuning run checks): the commands above.
  config.model.time_embed_dim = 100
  config.model.time_sinusoids = 256
  config.optim.learning_rate = 3e-4
  return config
