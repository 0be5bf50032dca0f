"""Models: a card's components loaded from seeded configs or a local diffusers folder, and each
family's denoiser cut into the sections step caching runs (wan_sections.py)."""
