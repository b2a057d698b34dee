"""odetransformer: Neural ODE Transformers (DiffEqFormer) in Flax NNX."""
