"""`python -m asyncrl.bench sweep --config X.yaml`: rollout actors × staleness bound, the real system.

Each cell is one real run (asyncrl.bench.e2e.measure) with `rollout.num_actors = a` and
`buffer.max_staleness = s`; the same figures per cell as `e2e`, plus a heat map of trained
tokens/s. `--actors 1,2,4 --staleness 0,1,2` choose the grid (defaults fit a 2-core machine:
1,2 x 0,1,2), `--steps` the steps per cell (8).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from asyncrl.bench.common import int_list, print_table
from asyncrl.bench.e2e import measure
from asyncrl.config import Config


def add_args(parser: Any) -> None:
    parser.add_argument("--actors", type=int_list, metavar="1,2", help="rollout actor counts (1,2; --smoke 1)")
    parser.add_argument("--staleness", type=int_list, metavar="0,1,2",
                        help="buffer.max_staleness values (0,1,2; --smoke 0,1)")
    parser.add_argument("--steps", type=int, help="learner steps per cell, 2 of them warm-up (8; --smoke 2)")


def run(cfg: Config, args: Any) -> dict[str, Any]:
    smoke = args.smoke
    actors = args.actors or ([1] if smoke else [1, 2])
    staleness = args.staleness or ([0, 1] if smoke else [0, 1, 2])
    if 0 not in staleness:
        staleness = [0, *staleness]  # the synchronous baseline cell of `ratio`
    steps, warmup = (2, 0) if smoke else (args.steps if args.steps is not None else 8, 2)
    cells = []
    for a in actors:
        for s in staleness:
            c = cfg.model_copy(deep=True)
            c.rollout.num_actors = a
            c.buffer.max_staleness = s
            try:
                cell = measure(c, steps, warmup, f"a{a}-s{s}")
            except RuntimeError as exc:  # one failed run (e.g. start-up timeout) must not lose the others
                print(f"  actors {a} staleness {s}: FAILED ({exc})")
                cells.append({"rollout_actors": a, "max_staleness": s, "error": str(exc),
                              "trained_tokens_per_s": float("nan")})
                continue
            cells.append(cell)
            print(f"  actors {a} staleness {s}: {cell['trained_tokens_per_s']:.0f} tok/s, "
                  f"learner idle {cell['learner_idle_ratio']:.2f}, rollout idle {cell['rollout_idle_ratio']:.2f}")
    result = summarize(cells, actors, staleness)
    best = result["best"] or {}
    print_table("sweep", [("cells", len(cells)), ("failed cells", result["failed_cells"]),
                          ("best actors", best.get("rollout_actors")), ("best staleness", best.get("max_staleness")),
                          ("best / (first actors, sync)", result["ratio"])])
    _heatmap(cells, actors, staleness, Path(args.output))
    return result


def summarize(cells: list[dict[str, Any]], actors: list[int], staleness: list[int]) -> dict[str, Any]:
    """The sweep JSON: every cell, the grid, the best cell and `ratio` = best trained tokens/s ÷
    the (fewest actors, max_staleness=0) cell's (the synchronous baseline of the same grid)."""
    ok = [c for c in cells if "error" not in c]
    base = next((c for c in ok if c["rollout_actors"] == actors[0] and c["max_staleness"] == 0), None)
    best = max(ok, key=lambda c: c["trained_tokens_per_s"], default=None)
    ratio = (best["trained_tokens_per_s"] / max(base["trained_tokens_per_s"], 1e-9)
             if best is not None and base is not None else float("nan"))
    return {"cells": cells, "actors": actors, "staleness": staleness, "best": best, "ratio": ratio,
            "failed_cells": len(cells) - len(ok)}


def _heatmap(cells: list[dict[str, Any]], actors: list[int], staleness: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.zeros((len(actors), len(staleness)))
    for c in cells:
        grid[actors.index(c["rollout_actors"]), staleness.index(c["max_staleness"])] = c["trained_tokens_per_s"]
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    im = ax.imshow(grid, cmap="viridis", origin="lower")
    ax.set_xticks(range(len(staleness)), [str(s) for s in staleness])
    ax.set_yticks(range(len(actors)), [str(a) for a in actors])
    ax.set_xlabel("max_staleness")
    ax.set_ylabel("rollout actors")
    for i in range(len(actors)):
        for j in range(len(staleness)):
            ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, label="trained tokens/s")
    fig.tight_layout()
    fig.savefig(out / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}.png", dpi=100)
    plt.close(fig)
