"""Pieces shared by model families (attention kernels and masks)."""
