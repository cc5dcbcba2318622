"""GPU-only scripts, run by hand on a machine with CUDA (CI has none and never runs them)."""
