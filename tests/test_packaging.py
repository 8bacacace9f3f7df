"""The quick start stays true: one test command shared by README and CI, one dependency list."""

from __future__ import annotations

import re
import tomllib

from helpers import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make lab" in readme
    assert re.search(r"^make test$", ci, re.M)


def test_environment_yml_installs_this_package_with_its_extras():
    env = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s+- -e \.\[dev\]$", env, re.M)
    assert re.search(r"^\s+- python=3\.11$", env, re.M)
    # every dependency lives in pyproject.toml only
    assert "jax" not in env and "flax" not in env


def test_pyproject_lists_the_stack():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!\[ ]", d)[0] for d in project["dependencies"]}
    assert {"jax", "jaxlib", "flax", "optax"} <= names
    extras = project["optional-dependencies"]
    notebook_names = {re.split(r"[<>=!\[ ]", d)[0] for d in extras["notebooks"]}
    assert {"jupyterlab", "ipywidgets", "matplotlib"} <= notebook_names


def test_makefile_test_target_is_pytest():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: setup\n\t\$\(BIN\)/python -m pytest$", makefile, re.M)
