"""The `fvgraph` command line, one command per module: generate videos, serve requests (JSON lines,
HTTP, Ray Serve replicas), warm and inspect the capture cache, calibrate step caching, diff settings,
run the benchmarks, report the environment."""

from __future__ import annotations

import typer

from fvgraph.cli.bench import bench
from fvgraph.cli.caching import calibrate
from fvgraph.cli.capture_cache import cache_clear, cache_ls, cache_verify
from fvgraph.cli.env import env
from fvgraph.cli.generate import generate
from fvgraph.cli.parity import parity
from fvgraph.cli.serve import serve
from fvgraph.cli.serve_ray import serve_ray
from fvgraph.cli.warmup import warmup

# Plain help (rich_markup_mode=None): rich's option tables wrap the help text to a narrow column at 80
# characters and cut long option names; click's own layout keeps both readable.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="fvgraph: a compiled runtime for diffusion transformers")
app.command()(generate)
app.command()(serve)
app.command("serve-ray")(serve_ray)  # the same HTTP API from N engine replicas (imports Ray only when run)
app.command()(warmup)
app.command()(calibrate)
app.command()(parity)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(bench)
app.command()(env)

cache_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Inspect the on-disk capture cache: ls | verify | clear.")
cache_app.command("ls")(cache_ls)
cache_app.command("verify")(cache_verify)
cache_app.command("clear")(cache_clear)
app.add_typer(cache_app, name="capture-cache")
app.add_typer(cache_app, name="cache", help="The same as `capture-cache` (the on-disk compiled steps; step caching is --cache).")

__all__ = ["app"]
