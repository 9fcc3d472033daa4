"""The README's first Python snippet runs as pasted, from the checkout's root."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_python_snippet_runs_as_pasted(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REPO / "README.md").read_text()
    match = re.search(r"```python\n(import ucformat\n.*?)```", text, re.S)
    assert match is not None, "the README has no snippet starting with 'import ucformat'"
    monkeypatch.chdir(REPO)
    namespace: dict[str, object] = {}
    exec(compile(match.group(1), "README.md", "exec"), namespace)  # the user's own paste
    assert namespace["ckpt"] is not None
    assert os.path.exists("/tmp/ckpt.ucf/ucformat.json")


def test_the_readme_lists_every_documentation_page_once() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("## Documentation\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\[docs/([\w.-]+\.md)\]\(docs/\1\)", section)
    assert len(listed) == len(set(listed)), sorted(p for p in listed if listed.count(p) > 1)
    assert sorted(listed) == sorted(p.name for p in (REPO / "docs").glob("*.md"))
