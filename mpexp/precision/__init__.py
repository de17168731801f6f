"""Precision: the modes (autocast dtype, TF32, fp8, fp32 islands) and the loss scalers."""
