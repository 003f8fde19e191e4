"""`python -m asyncrl.migrate ORIGINAL.yaml [original overrides ...] [asyncrl overrides ...] -o job.yaml`:
write a Guided-GRPO recipe as an asyncrl-native YAML of the same experiment.

The YAML holds exactly what the drop-in launch (`python -m asyncrl.launch config=ORIGINAL.yaml ...`)
resolves from the recipe (the same converter, `asyncrl.config.recipe_tree`), so loading it with
`--config job.yaml` gives the same resolved config. Every value that was derived or changed on the
way (the role split, steps from epochs, PPO mini-batches, the evaluation data, ...) carries a
comment saying how, and the header lists the keys that were ignored or warned, so the user can read
and own the result. `config=ORIGINAL.yaml` (the original's spelling) is accepted too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from asyncrl.cli import fail
from asyncrl.config import ConfigError, load_guided_grpo
from asyncrl.config.loading import recipe_tree
from asyncrl.config.role_split import role_table

__all__ = ["main", "migrate", "render_yaml"]

_SECTIONS = ("model", "data", "algorithm", "rollout", "verifier", "buffer", "learner", "reward", "cluster", "trainer")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (prompts) as literal blocks; collections of scalars inline."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _leaf(key: str, value: Any, indent: str) -> list[str]:
    if isinstance(value, str) and "\n" in value:
        text = yaml.dump({key: value}, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10**6)
        return [(indent + line).rstrip() for line in text.rstrip("\n").split("\n")]
    flow = yaml.dump(value, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10**6, default_flow_style=True)
    flow = "\n".join(line for line in flow.rstrip("\n").split("\n") if line != "...")
    return [f"{indent}{key}: {flow}"]


_DICT_FIELDS = ("rollout.val_override_config", "model.override_config", "reward.kwargs", "cluster.resources")
"""Dict-valued fields: written whole, not as nested sections."""


def _emit(tree: dict[str, Any], comments: dict[str, str], prefix: str, indent: str) -> list[str]:
    lines: list[str] = []
    for key, value in tree.items():
        dotted = prefix + key
        if isinstance(value, dict) and value and dotted not in _DICT_FIELDS:
            lines.append(f"{indent}{key}:")
            lines += _emit(value, comments, dotted + ".", indent + "  ")
            continue
        if dotted in comments:
            lines.append(f"{indent}# {comments[dotted]}")
        lines += _leaf(key, value, indent)
    return lines


def render_yaml(tree: dict[str, Any], comments: dict[str, str], header: list[str]) -> str:
    """The asyncrl YAML: `header` as comment lines, then the sections in the config's order, with
    `comments[dotted key]` on the line above each commented value."""
    ordered = {s: tree[s] for s in _SECTIONS if s in tree} | {k: v for k, v in tree.items() if k not in _SECTIONS}
    lines = [f"# {h}" if h else "#" for h in header]
    return "\n".join(lines + _emit(ordered, comments, "", "")) + "\n"


def migrate(recipe: str, overrides: list[str]) -> str:
    """The asyncrl YAML text of a recipe plus overrides (ConfigError as the drop-in launch raises it)."""
    cfg, conv = load_guided_grpo(recipe, overrides)  # the same checks as the launch
    tree, _, native_keys = recipe_tree(recipe, overrides)
    comments = {key: f"derived: {why}" for key, why in conv.derived.items()}
    comments |= {key: "set by an asyncrl override on the command line" for key in native_keys}
    command = " ".join(["python -m asyncrl.migrate", recipe, *overrides])
    header = ["asyncrl job converted from a Guided-GRPO recipe (docs/guided_grpo.md#coming-from-guided-grpo).",
              f"Written by: {command}",
              "Run: python -m asyncrl.launch --config THIS_FILE   (the same experiment as the drop-in launch)", ""]
    header += role_table(cfg, conv.recipe_gpus or None, conv.tp_rule).split("\n")
    message = conv.message()
    if message:
        header += [""] + message.split("\n")
    return render_yaml(tree, comments, header)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.migrate",
                                     description="Write a Guided-GRPO recipe (YAML + overrides) as an asyncrl YAML.")
    parser.add_argument("recipe", help="the original's YAML (or config=X.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides: the original's keys in its meaning, then asyncrl's own keys")
    parser.add_argument("-o", "--output", required=True, help="asyncrl YAML to write ('-' = stdout)")
    args = parser.parse_intermixed_args(argv)
    recipe = args.recipe.removeprefix("config=")
    try:
        text = migrate(recipe, args.overrides)
    except ConfigError as exc:
        fail(str(exc))
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: python -m asyncrl.launch --config {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
