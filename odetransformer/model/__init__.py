"""The model: a function of tokens and a time grid, and nothing about how it is trained.

Config (`config`), time embedding e(t) and time grids, ODE solvers, the blocks
(attention and MLP), the hypernetworks that generate every weight from t, the language
model (`transformer`), materialisation of an ODE at N steps into discrete layers, LoRA,
KV-cache decoding and parameter/FLOP counts.

May import: `odetransformer.errors` and its own modules; never training, the tools,
the runtime plumbing or the data pipeline.
"""
