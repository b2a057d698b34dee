"""Paper: DiffEqFormer at GPT-small shape on WikiText-103 (Table 1 / App. C.4).

From the authors' config/wikitext_103/small.yaml (SDML-KU/qkvflow), which as
committed sets `model_choice: gpt2` (their GPT-2 baseline run, `--config.model.kind=transformer`
here) and carries the DiffEqFormer's time_embed_dim and sinusodial_dim, used here.
Differs from owt_small: the WikiText-103 corpus (detokenized), batch 256, 10,001
steps (≈ 2.6 B tokens, ~25 epochs of WikiText-103's ~103 M: the paper reports that GPT
overfits here and DiffEqFormer less so), evaluation every 200 steps on the validation
split. Same peak lr 6e-4, d_t 20, S 128.

  python -m input_pipeline.prepare --dataset=wikitext103 --data_dir=$DATA
  python main.py --config=configs/wikitext103_small.py --workdir=$W --config.data.data_dir=$DATA
  python main.py --config=configs/wikitext103_small.py --config.model.kind=transformer \
      --workdir=$W_gpt --config.data.data_dir=$DATA
  Weight-sharing baseline (Zhong et al.): --config.model.kind=shared

Expect: DiffEqFormer below GPT-small and the weight-sharing ODE in validation
perplexity (paper Table 1). Not run by us (accelerator pod).
"""

from configs import owt_small


def get_config():
  config = owt_small.get_config()
  config.num_train_steps = 10_001
  config.global_batch_size = 256
  config.eval_every_steps = 200
  config.checkpoint_every_steps = 1_000
  config.data.source = "wikitext103"
  config.data.eval_max_batches = 0  # the whole validation split (~250 k tokens)
  return config
