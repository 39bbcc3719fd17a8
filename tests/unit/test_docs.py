"""The docs: the site builds with ``mkdocs build --strict``, and every code block of README.md and
docs/*.md is run here or says why not. ``python tests/unit/test_docs.py`` rewrites the plan-key
table of docs/plans.md from the techniques' own key docs.

NOTE [ Code blocks in the docs ]
A fenced block's info string says what this test does with it:
- ``bash``: every command (a line, ``\\`` continues it, ``#`` starts a comment) is ``memfit ...``
  (or ``.venv/bin/memfit ...``) and runs through memfit's own ``main`` in the page's temporary
  folder; it must exit 0. Keep them small (a tiny model, a few steps): this file runs in about a
  minute on 2 cores.
- ``python``: executed, a page's blocks in order in one namespace and in the same folder, so a block
  may read the ``plan.yaml`` an earlier ``memfit plan --out plan.yaml`` of the page wrote.
- ``yaml``: a plan file; ``memfit.Plan.from_dict`` must accept it.
- ``text``: output or a diagram; never run.
A block of any kind is not run when the line just before its fence is ``<!-- not run: REASON -->``,
the reason said (needs a GPU, the network, a file of yours, longer than this test allows). A block
that is neither runnable nor marked fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,})([^`\s]*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*?) -->$")
RUNNABLE = ("bash", "python", "yaml")
MEMFIT = ("memfit", ".venv/bin/memfit")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    not_run: str | None
    """The reason of a ``<!-- not run: ... -->`` marker ("" when it gives none), or None."""

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, indented ones (in list items) included."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: a code block is never closed"
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        before = lines[i - 1].strip() if i else ""
        marker = NOT_RUN.match(before)
        reason = marker.group(1) if marker else "" if before.startswith("<!-- not run") else None
        found.append(Block(page, i + 1, lang, body + "\n", reason))
        i = end + 1
    return found


def commands(text: str) -> list[str]:
    """The shell commands of a bash block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in (shlex.join(shlex.split(raw, comments=True)) for raw in joined.split("\n")) if line]


def why_not_runnable(block: Block) -> str | None:
    """None when this test can run the block, else what is wrong with it."""
    if block.lang not in RUNNABLE:
        return f"a {block.lang or 'plain'} block (run: {', '.join(RUNNABLE)}; output: text)"
    if block.lang == "bash":
        other = [c for c in commands(block.text) if shlex.split(c)[0] not in MEMFIT]
        if other:
            return f"not a memfit command: {other[0]!r}"
    return None


ALL = [b for page in PAGES for b in blocks(page)]


def test_every_block_is_run_or_says_why_not():
    """NOTE [ Code blocks in the docs ]: a block this test cannot run carries a reason."""
    no_reason = [b.where() for b in ALL if b.not_run == ""]
    assert not no_reason, f"write the reason into <!-- not run: REASON --> before {', '.join(no_reason)}"
    unmarked = [f"{b.where()}: {why}" for b in ALL if b.lang != "text" and b.not_run is None
                and (why := why_not_runnable(b))]
    assert not unmarked, ("these code blocks are neither run by tests/unit/test_docs.py nor marked "
                          "<!-- not run: REASON --> on the line before the fence:\n" + "\n".join(unmarked))
    assert any(b.not_run is None and b.lang != "text" for b in ALL)


def test_readme_is_one_page_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 150, "README.md is one page: move the detail to docs/"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


# README's blocks plan for a GPU preset over the AdamW class and train twice (about 2 minutes here):
# they run in the slow suite (make test-slow), the other pages' blocks in the default one.
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name == "README.md" else p
                                  for p in PAGES if any(b.not_run is None and b.lang in RUNNABLE for b in blocks(p))],
                         ids=lambda p: p.name)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    """Each runnable block of the page, in order, in one folder (NOTE [ Code blocks in the docs ])."""
    import torch

    from memfit.cli.main import main
    from memfit.plans import Plan

    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    threads = torch.get_num_threads()
    # The blocks' models are tiny: one thread is as fast, and a CPU another process keeps busy slows
    # every parallel op of two threads to a scheduler time slice (a 10-step run: 1.4 s -> 20 s here).
    torch.set_num_threads(1)
    try:
        for b in blocks(page):
            if b.not_run is not None or b.lang not in RUNNABLE:
                continue
            if b.lang == "yaml":
                Plan.from_dict(yaml.safe_load(b.text), source=b.where())
            elif b.lang == "python":
                exec(compile(b.text, b.where(), "exec"), namespace)
            else:
                for command in commands(b.text):
                    assert main(shlex.split(command)[1:]) == 0, f"{b.where()}: {command}"
    finally:
        torch.set_num_threads(threads)


def test_site_builds_strict(tmp_path):
    """mkdocs fails on a broken link, a missing anchor or a page left out of the nav (mkdocs.yml)."""
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                        str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    assert (tmp_path / "site" / "plans" / "index.html").exists()


# The plan-key table of docs/plans.md, between these two lines.
TABLE_START = "<!-- plan keys: written by `python tests/unit/test_docs.py` from each Key's doc; do not edit -->"
TABLE_END = "<!-- end of plan keys -->"


def plan_key_table() -> str:
    """Every plan key in plan order: its flag, default, type and the one-line doc of its Key."""
    from memfit.plans import keys, technique_of

    def show(value) -> str:
        return "`" + yaml.safe_dump(list(value) if isinstance(value, tuple) else value,
                                    default_flow_style=True).strip().removesuffix("...").strip() + "`"

    rows = ["| key | flag | default | type | values | technique |", "|---|---|---|---|---|---|"]
    for key in keys():
        doc, kind = (text.replace("|", "\\|") for text in (key.doc, key.annotation))
        rows.append(f"| `{key.name}` | `--{key.name.replace('_', '-')}` | {show(key.default)} | {kind} | {doc} | "
                    f"{technique_of(key.name).name} |")
    return "\n".join(rows)


def test_plans_page_lists_every_key():
    """memfit.plans says each key's values are documented in docs/plans.md: the table is the Keys' own."""
    page = (ROOT / "docs" / "plans.md").read_text()
    assert TABLE_START in page and TABLE_END in page
    written = page.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert written == plan_key_table(), "docs/plans.md's key table is stale: run python tests/unit/test_docs.py"


if __name__ == "__main__":
    path = ROOT / "docs" / "plans.md"
    head, rest = path.read_text().split(TABLE_START, 1)
    path.write_text(f"{head}{TABLE_START}\n{plan_key_table()}\n{TABLE_END}{rest.split(TABLE_END, 1)[1]}")
    print(f"wrote the plan-key table of {path}")
