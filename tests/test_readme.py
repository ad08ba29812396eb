"""README is the front door and docs/ the rooms behind it: the README stays short, its two commands are the ones
`.ci/run` runs, every link in it and in the docs pages leads somewhere, and every run file under
docs/results/runs/ is in the index there (and every index row names a file that exists).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
RUNS = ROOT / "docs" / "results" / "runs"
MAX_LINES = 200
# The two commands for a fresh machine, byte for byte: `.ci/run` runs each of them in a fresh virtual environment.
COMMANDS = (
    "pip install torch==2.13.0 && pip install -e . && tokenflow demo",
    'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q -n 2 -m "not ray" && python -m pytest -q -m ray',
)
# A Markdown link or image: [text](target) / ![alt](target); the target ends at whitespace or the closing paren.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor in a page (code blocks skipped; a repeated heading gets -1, -2, as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of a Markdown page whose file, or whose #anchor in a Markdown file, does not exist."""
    text = page.read_text(encoding="utf-8")
    bad = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target} (no heading with that anchor)")
    return bad


def index_patterns(index_text: str) -> list[str]:
    """The file names (or `*`/`?` patterns) in the first column of the index's tables."""
    out = []
    for line in index_text.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2 and not set(cells[1].strip()) <= {"-", ":"}:
            out += re.findall(r"`([^`]+)`", cells[1])
    return out


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_LINES} (details go in docs/)"


def test_readme_has_the_two_commands_exactly_in_bash_blocks():
    blocks = [block.splitlines()[1:-1] for block in FENCE.findall(README.read_text(encoding="utf-8"))]
    for command in COMMANDS:
        assert any(command in block for block in blocks), f"README lost its command, byte for byte: {command}"


def test_ci_runs_the_readme_commands():
    """`.ci/run` runs each command's parts in order (it splits them to time and log them)."""
    ci = CI.read_text(encoding="utf-8")
    # The first command's install runs as one line, as a newcomer types it.
    assert "pip install torch==2.13.0 && pip install -e .\n" in ci
    for command in COMMANDS:
        at = 0
        for part in command.split(" && "):
            found = ci.find(part, at)
            assert found >= 0, f".ci/run does not run `{part}` (from README's `{command}`) after what precedes it"
            at = found + len(part)


def test_every_link_in_the_readme_resolves():
    text = README.read_text(encoding="utf-8")
    docs_links = [t for t in LINK.findall(text) if t.startswith("docs/")]
    assert docs_links, "README links none of the docs pages"
    assert broken_links(README) == []


def test_every_link_in_the_docs_resolves():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert pages
    bad = [f"{page.relative_to(ROOT)}: {b}" for page in pages for b in broken_links(page)]
    assert bad == [], "\n".join(bad)


def test_every_run_file_is_in_the_index_and_every_row_names_one():
    patterns = index_patterns((RUNS / "README.md").read_text(encoding="utf-8"))
    files = sorted(p.name for p in RUNS.iterdir() if p.is_file() and p.name != "README.md")
    unlisted = [f for f in files if not any(fnmatch.fnmatchcase(f, p) for p in patterns)]
    assert unlisted == [], f"run files missing from docs/results/runs/README.md: {unlisted}"
    stale = [p for p in patterns if not any(fnmatch.fnmatchcase(f, p) for f in files)]
    assert stale == [], f"index rows naming no file in docs/results/runs/: {stale}"


def test_the_checks_can_fail(tmp_path):
    """The parsers on pages made for them: a missing file, a missing anchor, an unlisted run, a stale row."""
    assert slug("## 1. Against vLLM (`tokenflow bench peer --real`)".lstrip("# ")) == \
        "1-against-vllm-tokenflow-bench-peer---real"
    (tmp_path / "a.md").write_text("# A\n\n## 2. Two: the `x`\n\n```\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#2-two-the-x) [gone](c.md) [no anchor](a.md#not-a-heading) [web](https://x.y/z)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["c.md (no such file)", "a.md#not-a-heading (no heading with that anchor)"]
    index = "| file | command |\n|---|---|\n| `a_*.json`, `b.json` | x |\n| `c.json` | y |\n"
    assert index_patterns(index) == ["a_*.json", "b.json", "c.json"]
