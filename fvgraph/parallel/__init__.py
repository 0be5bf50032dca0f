"""Parallel denoise steps: CFG-parallel and Ulysses sequence parallelism across worker processes."""
