"""veomni.kernels."""
