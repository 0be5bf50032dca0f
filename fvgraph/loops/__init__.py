"""Loops: what a request does step by step (the contract, the registry, each loop, its step modules and samplers)."""
