"""Every metric key has exactly one writer, and docs/metrics.md is the list of them.

A *write* of a key is a namespaced string (`rollout/`, `verifier/`, `buffer/`, `train/`, `loss/`,
`reward/`, `perf/`, `weights/`, `coordinator/`, `eval/`) used as a dict-literal key, a dict-
comprehension key or an assignment subscript (`out["train/x"] = ...`) in asyncrl/ (the benchmarks,
which write their own result files, are left out). A key built with an f-string is a family
(`buffer/{}` ~ `buffer/<counter>` in the table). Reading a key (`m["train/x"]`, `m.get(...)`) is
not a write.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = re.compile(r"^(rollout|verifier|buffer|train|loss|reward|perf|weights|coordinator|eval)/")


def _written_keys(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Dict):
        return [k for k in node.keys if k is not None]
    if isinstance(node, ast.DictComp):
        return [node.key]
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        return [t.slice for t in flat if isinstance(t, ast.Subscript)]
    return []


def _key_name(expr: ast.expr) -> str | None:
    """The key a write names, an f-string's holes as `*`; None when it is not a metric key."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        name = expr.value
    elif isinstance(expr, ast.JoinedStr):
        name = "".join(v.value if isinstance(v, ast.Constant) else "*" for v in expr.values)
    else:
        return None
    return name if NAMESPACE.match(name) else None


def writers(root: Path) -> dict[str, set[str]]:
    """Metric key -> the modules (paths relative to `root`'s parent) that write it."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith("asyncrl/bench/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            for expr in _written_keys(node):
                name = _key_name(expr)
                if name is not None:
                    out.setdefault(name, set()).add(rel)
    return out


def documented(doc: Path) -> dict[str, str]:
    """Key (a `<family>` as `*`) -> writer, from the table of docs/metrics.md."""
    out: dict[str, str] = {}
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[1].startswith("asyncrl/"):
            key = re.sub(r"<[^>]+>", "*", cells[0].strip("`"))
            assert key not in out, f"docs/metrics.md lists {key} twice"
            out[key] = cells[1]
    return out


def test_no_metric_key_has_two_writers():
    found = writers(ROOT / "asyncrl")
    shared = {k: sorted(v) for k, v in found.items() if len(v) > 1}
    assert not shared, f"metric keys written by more than one module: {shared}"


def test_the_table_and_the_code_name_the_same_keys_and_writers():
    found = writers(ROOT / "asyncrl")
    table = documented(ROOT / "docs" / "metrics.md")
    assert len(table) > 50  # the parser read the table (a broken table would pass the checks below)
    never_written = sorted(k for k in table if k not in found)
    assert not never_written, f"docs/metrics.md lists keys nothing in asyncrl/ writes: {never_written}"
    undocumented = sorted(k for k in found if k not in table)
    assert not undocumented, f"keys written in asyncrl/ but missing from docs/metrics.md: {undocumented}"
    wrong = {k: (table[k], sorted(found[k])) for k in table if {table[k]} != found[k]}
    assert not wrong, f"docs/metrics.md names another writer (table, code): {wrong}"


def test_the_scan_sees_a_second_writer(tmp_path):
    """The scan itself: a planted second writer of a key, in another module, is reported."""
    pkg = tmp_path / "asyncrl"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "a.py").write_text('def f():\n    return {"train/reward_mean": 1.0, f"buffer/{k}": 2}\n')
    (pkg / "b.py").write_text('def g(out):\n    out["train/reward_mean"] = 0.5\n    return out.get("loss/pg")\n')
    (pkg / "bench" / "c.py").write_text('X = {"train/reward_mean": 0}\n')
    assert writers(pkg) == {"train/reward_mean": {"asyncrl/a.py", "asyncrl/b.py"}, "buffer/*": {"asyncrl/a.py"}}
