"""The core paper's published numbers, shipped as reference data (see README.md here)."""
