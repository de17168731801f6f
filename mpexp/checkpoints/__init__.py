"""Checkpoints: whole ones (one file from the main rank) and sharded ones (a folder, FSDP)."""
