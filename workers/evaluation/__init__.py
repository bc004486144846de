"""Evaluation: perplexity, lm-eval suites and runs."""
