"""Paper: DiffEqFormer at GPT-medium shape on OpenWebText (Table 3 / App. C.4).

From the authors' config/owt/medium.yaml (SDML-KU/qkvflow). Differs from owt_small:
24 steps/layers, d 1024, 16 heads, MLP 4096, d_t 96, batch 256, 40,001 steps (the
authors' count), peak lr 3e-4, evaluation every 500 steps.

  python main.py --config=configs/owt_medium.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/owt_medium.py --config.model.kind=transformer --workdir=$W_gpt \
      --config.data.data_dir=$DATA

Expect: validation perplexity below owt_small's, DiffEqFormer at or below GPT-medium
(paper Table 2). Not run by us (accelerator pod; ~355 M GPT, ~1.27 B DiffEqFormer params).
"""

from configs import owt_small


def get_config():
  config = owt_small.get_config()
  config.num_train_steps = 40_001
  config.eval_every_steps = 500
  config.global_batch_size = 256
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.mlp_dim = 4096
  config.model.solver_steps = 24  # K
  config.model.num_layers = 24  # L (the baseline)
  config.model.time_embed_dim = 96
  config.optim.learning_rate = 3e-4
  return config
