"""`fvgraph env`: versions, the GPU, optional kernel packages and the cards."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from fvgraph.cli.options import BOUNDARY_RATIO_OPTION, DTYPE_OPTION, FLOW_SHIFT_OPTION, chosen_card_from_options, console


def env(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    card: Optional[str] = typer.Option(None, help="Also list the recipe a run of this card uses (loads no weights)."),
    checkpoint: Optional[str] = typer.Option(None, help="With --card: set each recipe value beside what this checkpoint "
                                             "(a local folder or a Hub repo id in the Hub cache) says."),
    dtype: Optional[str] = DTYPE_OPTION,
    flow_shift: Optional[float] = FLOW_SHIFT_OPTION,
    boundary_ratio: Optional[float] = BOUNDARY_RATIO_OPTION,
) -> None:
    """Versions of torch / CUDA / triton / diffusers, the GPU, optional kernel packages, and the cards;
    with --card, the precision and recipe a run uses, and where a --checkpoint says otherwise."""
    from fvgraph.cards import card_names, get_card
    from fvgraph.env_report import environment
    from fvgraph.models.hub_checkpoint import local_checkpoint
    from fvgraph.runtime.checkpoint_recipe import recipe_values

    report = environment()
    report["cards"] = card_names()
    if card is not None:
        try:
            chosen = chosen_card_from_options(get_card(card), dtype, flow_shift, boundary_ratio)
            folder = None if checkpoint is None else local_checkpoint(checkpoint)
        except (KeyError, ValueError) as err:
            console.print(f"[red]error:[/red] {err}")
            raise typer.Exit(2) from None
        report["precision"] = chosen.recipe.precision
        for value in recipe_values(chosen, folder) if folder is not None else ():
            report[f"recipe {value.key}"] = str(value) + (" (differs)" if value.differs else "")
        if checkpoint is None:
            report["recipe flow_shift"] = str(chosen.recipe.sampler.config.get("flow_shift"))
            report["recipe boundary_ratio"] = str(chosen.recipe.boundary_ratio)
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
