#!/usr/bin/env python3
"""Copies files verbatim into the Markdown pages that show them, so a page cannot drift from them.

    tools/doc_includes.py           rewrite every include block in docs/**/*.md
    tools/doc_includes.py --check   exit 1 (and say which) when a page differs from its files

An include block in a page is

    <!-- include: slurm/reshard.sbatch -->
    ```bash
    ...the file, byte for byte...
    ```
    <!-- end include -->

The path is relative to the page. Everything between the two markers is generated: edit the
file, then run the script. The fence language comes from the file's extension.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

BEGIN_RE = re.compile(r"^<!-- include: (\S+) -->$")
END = "<!-- end include -->"
LANGUAGES = {".sh": "bash", ".sbatch": "bash", ".py": "python", ".cpp": "cpp", ".hpp": "cpp", ".json": "json"}


class IncludeError(Exception):
    pass


def block(page: pathlib.Path, rel: str) -> list[str]:
    """The generated lines of one include block (between the markers)."""
    src = (page.parent / rel).resolve()
    if not src.is_file():
        raise IncludeError(f"{page.relative_to(ROOT)}: includes {rel}, which does not exist")
    text = src.read_text(encoding="utf-8")
    if not text.endswith("\n"):
        text += "\n"
    fence = "```"
    while fence in text:
        fence += "`"
    return [fence + LANGUAGES.get(src.suffix, "") + "\n", *text.splitlines(keepends=True), fence + "\n"]


def render(page: pathlib.Path) -> tuple[str, list[str]]:
    """The page with every include block regenerated, and the included paths."""
    lines = page.read_text(encoding="utf-8").splitlines(keepends=True)
    out: list[str] = []
    included: list[str] = []
    i = 0
    while i < len(lines):
        m = BEGIN_RE.match(lines[i].rstrip("\n"))
        out.append(lines[i])
        i += 1
        if not m:
            continue
        end = next((j for j in range(i, len(lines)) if lines[j].rstrip("\n") == END), None)
        if end is None:
            raise IncludeError(f"{page.relative_to(ROOT)}: '{m.group(0)}' has no '{END}' after it")
        out.extend(block(page, m.group(1)))
        out.append(lines[end])
        included.append(m.group(1))
        i = end + 1
    return "".join(out), included


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    args = ap.parse_args()
    stale = 0
    try:
        for page in sorted(DOCS.rglob("*.md")):
            old = page.read_text(encoding="utf-8")
            new, included = render(page)
            if new == old:
                continue
            if args.check:
                print(f"{page.relative_to(ROOT)}: differs from {', '.join(included)}: run tools/doc_includes.py")
                stale += 1
            else:
                page.write_text(new, encoding="utf-8")
                print(f"updated {page.relative_to(ROOT)}")
    except IncludeError as e:
        print(e, file=sys.stderr)
        return 1
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
