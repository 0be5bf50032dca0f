"""The engine: a card built into its parts once (builder.py; with worker ranks when parallel) and
many requests' loops driven step by step through them (engine.py)."""
