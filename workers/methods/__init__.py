"""The methods as pure functions on tensors: scoring, selection, grouping, merging, scaling, editing (no
transformers, Ray or SQL import)."""
