"""The baselines: random FFN, random init, dense-to-dense pruning, and DOT-MoE (dense to MoE)."""
