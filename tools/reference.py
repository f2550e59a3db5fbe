#!/usr/bin/env python3
"""Writes docs/reference.md, the reference of every public type and function, from the headers.

    tools/reference.py           run Doxygen on include/statedict (detail/ left out), write the page
    tools/reference.py --check   exit 1 when docs/reference.md differs from what the headers give

The descriptions are the headers' own `///` and `///<` comments; the page is never edited by
hand. Needs doxygen (Debian: apt-get install doxygen); the page is made with Debian 12's 1.9.4.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference.md"

DOXYFILE = """
INPUT = {root}/include/statedict
RECURSIVE = YES
FILE_PATTERNS = *.hpp
EXCLUDE_PATTERNS = */detail/*
EXCLUDE_SYMBOLS = *::detail *::detail::* detail
GENERATE_HTML = NO
GENERATE_LATEX = NO
GENERATE_XML = YES
XML_PROGRAMLISTING = NO
OUTPUT_DIRECTORY = {out}
EXTRACT_ALL = YES
EXTRACT_STATIC = YES
ENABLE_PREPROCESSING = YES
MACRO_EXPANSION = YES
EXPAND_ONLY_PREDEF = YES
PREDEFINED = STATEDICT_API=inline
INPUT_FILTER = "sed -e 's/::inline v0//'"
JAVADOC_AUTOBRIEF = YES
QUIET = YES
WARNINGS = NO
"""

# The order of the page: the facade first, then the layers bottom-up as docs/architecture.md has them.
ORDER = ["api.hpp", "convert.hpp", "statedict.hpp", "formats/", "exec/", "shard/", "core/", "io/", "interop/", "reflect.hpp"]
# Namespace members left out: the error ids have their own page (docs/errors.md).
SKIP_NAMESPACES = {"statedict::errors"}


def text(node) -> str:
    """The text of a description node, whitespace collapsed."""
    if node is None:
        return ""
    return " ".join("".join(node.itertext()).split())


def describe(m) -> str:
    brief, detail = text(m.find("briefdescription")), text(m.find("detaileddescription"))
    return " ".join(s for s in (brief, detail) if s)


def qualified(name: str) -> str:
    """Doxygen 1.9 loses the inner namespace of `namespace statedict::inline v0::megatron`, and
    names `namespace statedict::inline v0` v0; INPUT_FILTER drops `::inline v0` (the user writes
    statedict:: either way) and this maps any v0 that is left."""
    return re.sub(r"^v0(::|$)", r"statedict\1", name or "")


def tidy(sig: str) -> str:
    sig = sig.replace("v0::", "")
    sig = re.sub(r"\b(inline|constexpr inline|static inline) ", "", sig)
    sig = re.sub(r"(\S) ([&*]+)(\w)", r"\1\2 \3", sig)  # "const T &x" -> "const T& x"
    sig = re.sub(r"< ", "<", sig)
    sig = re.sub(r" >", ">", sig)
    return " ".join(sig.split())


def template_of(m) -> str:
    tpl = m.find("templateparamlist")
    if tpl is None:
        return ""
    params = []
    for p in tpl.findall("param"):
        t = text(p.find("type"))
        n = text(p.find("declname"))
        params.append(f"{t} {n}".strip())
    return "template <" + ", ".join(params) + "> "


def header_of(location: str) -> str:
    return location.split("include/statedict/", 1)[-1]


def member_line(m, scope: str) -> str | None:
    kind = m.get("kind")
    name = m.findtext("name")
    if kind == "function":
        sig = template_of(m) + tidy(f"{text(m.find('type'))} {scope}{name}{text(m.find('argsstring'))}")
    elif kind == "variable":
        init = text(m.find("initializer"))
        sig = tidy(f"{text(m.find('type'))} {scope}{name}") + (f" {init}" if init and len(init) < 60 else "")
    elif kind == "typedef":
        sig = template_of(m) + tidy(text(m.find("definition"))).replace("typedef ", "")
        sig = re.sub(r"^using \S*?(\w+) =", r"using \1 =", sig)
    elif kind == "enum":
        values = [v.findtext("name") for v in m.findall("enumvalue")]
        sig = f"enum {scope}{name} {{ {', '.join(values)} }}"
    elif kind == "friend":
        return None
    else:
        return None
    d = describe(m)
    return f"- `{sig.strip()}`" + (f": {d}" if d else "")


def compound_members(c, sections: tuple[str, ...]) -> list:
    out = []
    for sec in c.findall("sectiondef"):
        if sec.get("kind") in sections:
            out.extend(sec.findall("memberdef"))
    return out


def collect(xml: pathlib.Path) -> dict[str, list[tuple[int, str]]]:
    """header -> [(line, markdown)]"""
    by_header: dict[str, list[tuple[int, str]]] = {}
    index = ET.parse(xml / "index.xml").getroot()
    for comp in index.findall("compound"):
        kind = comp.get("kind")
        root = ET.parse(xml / f"{comp.get('refid')}.xml").getroot().find("compounddef")
        name = qualified(root.findtext("compoundname"))
        if kind == "namespace" and name.startswith("statedict") and name not in SKIP_NAMESPACES:
            scope = name.removeprefix("statedict").removeprefix("::")
            scope = scope + "::" if scope else ""
            for m in compound_members(root, ("func", "var", "typedef", "enum")):
                line = member_line(m, scope)
                loc = m.find("location")
                if line and loc is not None and "include/statedict/" in loc.get("file", ""):
                    by_header.setdefault(header_of(loc.get("file")), []).append((int(loc.get("line", 0)), line))
        elif kind in ("class", "struct") and name.startswith("statedict::"):
            if "::detail" in name:
                continue
            loc = root.find("location")
            if loc is None or "include/statedict/" not in loc.get("file", ""):
                continue
            short = name.removeprefix("statedict::")
            tpl = template_of(root)
            d = describe(root)
            lines = [f"\n#### {tpl}{kind} `{short}`\n"]
            if d:
                lines.append(d + "\n")
            members = compound_members(root, ("public-func", "public-static-func", "public-attrib", "public-static-attrib",
                                              "public-type"))
            for m in members:
                if m.get("kind") == "function" and not text(m.find("type")) and not describe(m):
                    continue  # undocumented constructors and destructors
                if m.findtext("name", "").startswith("operator=") and not describe(m):
                    continue
                ml = member_line(m, "")
                if ml:
                    lines.append(ml)
            by_header.setdefault(header_of(loc.get("file")), []).append((int(loc.get("line", 0)), "\n".join(lines) + "\n"))
    return by_header


def order_key(header: str):
    for i, prefix in enumerate(ORDER):
        if header == prefix or (prefix.endswith("/") and header.startswith(prefix)):
            return (i, header)
    return (len(ORDER), header)


def first_comment(header: str) -> str:
    """The header's opening comment, first paragraph, without its "statedict:" tag."""
    lines = []
    for ln in (ROOT / "include" / "statedict" / header).read_text().splitlines():
        if not ln.startswith("//"):
            break
        body = ln[2:].strip()
        if not body or body.startswith("SPDX"):
            if lines:
                break
            continue
        lines.append(body)
    intro = re.sub(r"^statedict:\s*", "", " ".join(lines))
    return intro[:1].upper() + intro[1:]


def render(by_header) -> str:
    out = ["# Reference",
           "",
           "Every public type and function of the library, header by header, with the descriptions the",
           "headers give them. Generated from the headers by `tools/reference.py` (Doxygen); do not edit.",
           "[library.md](library.md) shows them at work; [errors.md](errors.md) lists the error ids.",
           ""]
    headers = sorted(by_header, key=order_key)
    out.append("Headers: " + ", ".join(f"[{h}](#{anchor(h)})" for h in headers))
    out.append("")
    for h in headers:
        out.append(f"## {h}")
        out.append("")
        intro = first_comment(h)
        if intro:
            out.append(intro)
            out.append("")
        out.append(f"`#include <statedict/{h}>`")
        out.append("")
        for _, md in sorted(by_header[h], key=lambda x: x[0]):
            out.append(md)
        out.append("")
    page = "\n".join(out)
    page = re.sub(r"\n{3,}", "\n\n", page)
    return page.rstrip() + "\n"


def anchor(h: str) -> str:
    return re.sub(r"[^a-z0-9_ -]", "", h.lower()).replace(" ", "-")


def generate() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        doxyfile = pathlib.Path(tmp) / "Doxyfile"
        doxyfile.write_text(DOXYFILE.format(root=ROOT, out=tmp))
        subprocess.run(["doxygen", str(doxyfile)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return render(collect(pathlib.Path(tmp) / "xml"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    page = generate()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run tools/reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
