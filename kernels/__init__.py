"""Triton / CUTLASS-DSL / flashinfer kernels, each beside a plain-torch reference implementation."""
