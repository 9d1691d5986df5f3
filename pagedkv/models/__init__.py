"""Model files (Llama) and their building blocks, plus loading weights."""
