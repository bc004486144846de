"""Models built from plans: the output registry, conversion, edited and DOT-MoE classes, the decoder accessor."""
