"""`fvgraph env`: versions, the GPU, optional kernel packages and the cards."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from fvgraph.cli.options import console


def env(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Versions of torch / CUDA / triton / diffusers, the GPU, optional kernel packages, and the cards."""
    from fvgraph.cards import card_names
    from fvgraph.env_report import environment

    report = environment()
    report["cards"] = card_names()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(title="fvgraph environment", show_header=False)
    for key, value in report.items():
        if key == "optional_kernels":
            for name, info in value.items():
                state = f"importable ({info['version']})" if info["importable"] else "not installed"
                table.add_row(f"kernel package {name}", state)
        else:
            table.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
    console.print(table)
