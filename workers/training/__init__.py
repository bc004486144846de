"""Training: distillation, its losses, DDP and FSDP, the memory model, Router KD."""
