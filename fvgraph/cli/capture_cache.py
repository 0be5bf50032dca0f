"""`fvgraph cache ls | verify | clear`: inspect and tidy the on-disk capture cache."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from fvgraph.cli.options import DEFAULT_CACHE_DIR, console


def cache_ls(
    cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifests as JSON."),
) -> None:
    """List every fingerprint directory and its entries."""
    from fvgraph.compile.capture_cache import cache_dirs, cache_links, leftovers, link_problem
    from fvgraph.compile.capture_cache_files import size_of

    caches = cache_dirs(cache_dir)
    if as_json:
        listing = {c.dir.name: {"fingerprint": c.fingerprint, "entries": c.entries(), "problems": c.problems,
                                "unloadable": c.unloadable_keys(),
                                "orphans": [str(p.relative_to(c.dir)) for p in leftovers(c)]} for c in caches}  # fmt: skip
        typer.echo(json.dumps(listing, indent=1))
        return
    for link in cache_links(cache_dir):
        console.print(f"[yellow]skipped {link_problem(link)}[/yellow]")
    if not caches:
        console.print(f"{cache_dir}: empty")
    for cache in caches:
        fp = cache.fingerprint
        title = (f"{cache.dir.name}: {fp.get('card_id')} -O{fp.get('opt_level')} {fp.get('backend')} torch {fp.get('torch')} "
                 f"gpu {fp.get('gpu')} cpu {fp.get('cpu_isa')} passes {fp.get('pass_pipeline')}")  # fmt: skip
        table = Table(title=title)
        for column in ("signature", "step", "batch", "latents", "MB", "compile s", "capture s"):
            table.add_column(column)
        for key, record in sorted(cache.entries().items(), key=lambda kv: str(kv[1]["factors"].get("step_kind"))):
            factors, meta = record["factors"], record["meta"]
            inputs = (factors.get("shape") or {}).get("inputs") if isinstance(factors.get("shape"), dict) else None
            latents = next((i[1] for i in inputs or [] if isinstance(i, list) and i[:1] == ["latents"]), "-")
            size = sum(a["bytes"] for a in record["artifacts"].values()) / 1e6
            capture, compile_s = meta.get("capture_seconds"), meta.get("compile_seconds")
            table.add_row(key, str(factors.get("step_kind")), str(factors.get("batch")), str(latents), f"{size:.1f}",
                          _seconds(compile_s, 1), _seconds(capture, 3))  # fmt: skip
        console.print(table)
        for problem in cache.problems:
            console.print(f"[red]{cache.dir.name}:[/red] {problem}")
        for key, mark in cache.unloadable_keys().items():
            console.print(f"[yellow]{cache.dir.name}: {key} is compiled in process: its packages, built here, "
                          f"did not load ({str(mark.get('problem'))[:300]})[/yellow]")  # fmt: skip
        left = leftovers(cache)
        if left:
            console.print(f"[yellow]{cache.dir.name}: {len(left)} orphaned files ({sum(map(size_of, left)) / 1e6:.1f} MB) "
                          "no entry uses (a killed warmup's staging, replaced artifacts): `fvgraph cache verify` "
                          "names them, `fvgraph cache clear` removes them[/yellow]")  # fmt: skip


def _seconds(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def cache_verify(cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache.")) -> None:
    """Check every entry's artifacts against the sizes and sha256 in its manifest, load each one as a
    serving process would, and look for orphaned files. Exits 1 on a problem."""
    from fvgraph.compile.capture_cache import cache_dirs, verify

    problems = verify(cache_dir)
    for line in problems:
        console.print(f"[red]bad:[/red] {line}")
    count = sum(len(c.entries()) for c in cache_dirs(cache_dir))
    if problems:
        raise typer.Exit(1)
    console.print(f"ok: {count} entries verified under {cache_dir}")


def cache_clear(
    cache_dir: Path = typer.Option(DEFAULT_CACHE_DIR, help="Root of the capture cache."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask."),
) -> None:
    """Remove every fingerprint directory under the cache root."""
    from fvgraph.compile.capture_cache import cache_links, clear, link_problem

    if not yes and not typer.confirm(f"remove every compiled step under {cache_dir}?"):
        raise typer.Exit(1)
    for link in cache_links(cache_dir):
        console.print(f"[yellow]skipped {link_problem(link)}[/yellow]")
    console.print(f"removed {clear(cache_dir)} fingerprint directories from {cache_dir}")
