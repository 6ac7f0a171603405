"""`sgdjob simulate`: run scenario files through the discrete-event simulator in every mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command()
@click.argument("scenarios", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for one <name>.json per scenario.",
)
def simulate(scenarios: tuple[Path, ...], out_dir: Path) -> None:
    """Simulate each SCENARIO.yaml in sync, rebalanced sync, hierarchical, async and auto (the
    policy in the loop); write OUT/<name>.json and print efficiencies (useful throughput / bound)."""
    # numpy-backed: imported here so `sgdjob` in the operator image (no numpy) still starts.
    from sgdjob_operator.sim import ScenarioError, load_scenario, simulate_scenario
    from sgdjob_operator.sim.compare import table

    loaded = []
    failed = False
    for path in scenarios:
        try:
            loaded.append(load_scenario(path))
        except ScenarioError as err:
            failed = True
            for problem in err.problems:
                click.echo(f"{path}: {problem}", err=True)
    names = [sc.name for sc in loaded]
    for name in sorted({n for n in names if names.count(n) > 1}):
        failed = True
        click.echo(f"two scenarios are named {name!r}: their results would overwrite each other", err=True)
    if failed:
        sys.exit(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for sc in loaded:
        result = simulate_scenario(sc)
        (out_dir / f"{sc.name}.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
        results.append(result)
        click.echo(
            f"{sc.name}: {sc.workers} workers, {sc.duration:.0f} s simulated in {result.seconds:.1f} s", err=True
        )
    click.echo(table(results))
