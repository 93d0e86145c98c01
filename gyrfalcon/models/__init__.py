"""Model architectures, one file per family, and the checkpoint loader."""
