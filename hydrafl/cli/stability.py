"""`hydrafl stability`: is an outer learning rate and momentum stable, before a run finds out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from hydrafl.cli.common import fail


def stability(
    inner_lr: Annotated[float, typer.Option(help="Inner SGD learning rate eta.")],
    curvature: Annotated[float, typer.Option(help="Curvature h of the mode.")],
    curvature_var: Annotated[
        float, typer.Option(help="Per-sample curvature variance v (2h^2 for Gaussian).")
    ],
    batch_size: Annotated[int, typer.Option(help="Inner batch size b.")],
    local_steps: Annotated[int, typer.Option(help="Inner steps H per round.")],
    sites: Annotated[int, typer.Option(help="Number of sites M averaged.")],
    outer_lr: Annotated[float, typer.Option(help="Outer learning rate gamma.")],
    momentum: Annotated[float, typer.Option(help="Outer momentum mu.")],
    nesterov: Annotated[
        bool, typer.Option("--nesterov/--heavy-ball", help="Outer momentum form.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of the stable region here.")
    ] = None,
) -> None:
    """Exact mean-square stability of DiLoCo's outer momentum on the stochastic quadratic model."""
    from hydrafl.server.aggregation.stability import OuterSetup, check, plot_stable_region

    try:
        setup = OuterSetup(
            inner_lr=inner_lr,
            curvature=curvature,
            curvature_var=curvature_var,
            batch_size=batch_size,
            local_steps=local_steps,
            sites=sites,
            outer_lr=outer_lr,
            momentum=momentum,
            nesterov=nesterov,
        )
    except ValueError as error:
        fail(str(error), 2)
    verdict = check(setup)
    if plot:
        plot_stable_region(setup, plot)
    if as_json:
        print(json.dumps(verdict.to_dict()))
        return
    form = "Nesterov" if nesterov else "heavy-ball"
    word = "[green]STABLE[/]" if verdict.stable else "[red]UNSTABLE[/]"
    Console().print(
        f"{word} ({form}, mean-square): outer lr {outer_lr:g}, momentum {momentum:g}; "
        f"largest stable outer lr {verdict.max_stable_outer_lr:.4g}"
    )
    if plot:
        Console().print(f"stable region plotted to {plot}")
