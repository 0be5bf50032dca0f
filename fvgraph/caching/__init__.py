"""Step caching (what diffusers calls `enable_cache`): per request, a method decides between steps
which denoise step kind runs, and keeps what it reuses in the request's loop state (docs/step_caching.md).

settings.py is the base every method's settings derive from and the parser of `Request.cache`;
methods.py lists the methods; each method is one file (mag_cache.py, tea_cache.py, taylor_seer.py,
fb_cache.py) with its settings, its per-request state, its decision and the step kinds it adds.
"""
