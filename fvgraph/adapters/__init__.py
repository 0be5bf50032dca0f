"""LoRA adapters: files read as diffusers reads them, slots chosen per batch row, merged weights (docs/adapters.md)."""
