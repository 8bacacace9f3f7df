"""The deployment recipes the multi-host page quotes: each quoted line is a line of its file."""

from __future__ import annotations

import re

from helpers import ROOT

PAGE = ROOT / "docs" / "multi_host.md"
BLOCK = re.compile(r"```text\n(deploy/.*?)```", re.S)  # the block that quotes the recipes


def quoted_lines(page: str) -> dict[str, list[str]]:
    """The recipe files a ```text block of ``page`` names (unindented), each with its indented lines."""
    quotes: dict[str, list[str]] = {}
    for block in BLOCK.findall(page):
        lines = []
        for line in block.splitlines():
            if line.startswith(" "):
                lines.append(line.strip())
            else:
                lines = quotes.setdefault(line.strip(), [])
    return quotes


def test_every_line_the_page_quotes_is_in_its_recipe():
    quotes = quoted_lines(PAGE.read_text())
    assert set(quotes) == {"deploy/slurm/train.sbatch", "deploy/kubernetes/trainer.yaml"}
    for recipe, lines in quotes.items():
        assert lines, f"{recipe}: the page quotes no line of it"
        in_file = {line.strip() for line in (ROOT / recipe).read_text().splitlines()}
        missing = [line for line in lines if line not in in_file]
        assert not missing, f"docs/multi_host.md quotes lines {recipe} no longer holds: {missing}"


def test_a_changed_recipe_line_is_found():
    page = "```text\ndeploy/slurm/train.sbatch\n    #SBATCH --nodes=3\n```\n"
    quotes = quoted_lines(page)
    assert quotes == {"deploy/slurm/train.sbatch": ["#SBATCH --nodes=3"]}
    assert "#SBATCH --nodes=3" not in {
        line.strip() for line in (ROOT / "deploy/slurm/train.sbatch").read_text().splitlines()
    }
