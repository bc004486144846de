"""Tests run offline, on CPU, with one torch thread (tiny models, 2-core machines)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models: threads cost more than they give
