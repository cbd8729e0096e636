"""moe_train: dropless Mixture-of-Experts language-model training in JAX."""

__version__ = "0.1.0"
