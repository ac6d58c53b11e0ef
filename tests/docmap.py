"""The code map of docs/internals.md, written from the code (test process): the first paragraph of
every package's docstring, and of each plain module directly under `kvd/` and in the daemon's
process shell (`kvd/daemon/`), and the house rules as tests/test_layering.py states them.

`python -m tests.docmap` rewrites the map between its two markers; tests/test_docs.py checks that the
file says what the code says. To change the map, change the docstrings, then run it.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvd"
INTERNALS = ROOT / "docs" / "internals.md"
BEGIN = "<!-- code map: written by `python -m tests.docmap` from the docstrings; change those, then run it -->"
END = "<!-- end of the code map -->"
SHELL = ("kvd", "kvd/daemon")  # the folders whose plain modules are listed one by one


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""


def first_paragraph(text: str) -> str:
    paragraph = " ".join(line.strip() for line in text.strip().split("\n\n")[0].splitlines())
    return paragraph[:-1] + "." if paragraph.endswith(":") else paragraph  # (one that introduces an example)


def packages() -> list[Path]:
    return sorted(path.parent for path in PACKAGE.rglob("__init__.py") if path.parent != PACKAGE)


def code_map() -> str:
    """The map's text, markers included."""
    lines = [BEGIN, ""]
    for folder in [PACKAGE, *packages()]:
        depth = max(0, len(folder.relative_to(ROOT).parts) - 2)  # (kvd/ and its packages at the top)
        lines.append(f"{'  ' * depth}- `{folder.relative_to(ROOT).as_posix()}/`: "
                     f"{first_paragraph(docstring(folder / '__init__.py'))}")
        if folder.relative_to(ROOT).as_posix() in SHELL:
            lines += [f"{'  ' * (depth + 1)}- `{path.name}`: {first_paragraph(docstring(path))}"
                      for path in sorted(folder.glob("*.py")) if path.name not in ("__init__.py", "__main__.py")]
    intro, _, rules = docstring(ROOT / "tests" / "test_layering.py").partition("\n\n")
    lines += ["", "`tests/` mirrors the tree (pure tests per package, `tests/system/` for real daemons). "
              f"`tests/test_layering.py`: {first_paragraph(intro)}", "", rules.strip(), "", END]
    return "\n".join(lines)


def written(text: str) -> str:
    """text (docs/internals.md) with its map made the code's."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + code_map() + text[end:]


def main() -> int:
    text = INTERNALS.read_text()
    new = written(text)
    if new != text:
        INTERNALS.write_text(new)
        print(f"{INTERNALS.relative_to(ROOT)}: code map rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
