"""Compile: a step plan to a signature, a captured graph, passes, a backend, and the capture cache on disk."""
