"""The quick start stays true: one test command shared by README and CI, one dependency list."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT
from packaging.requirements import Requirement

SUPPORTED_PYTHONS = ("3.11", "3.12", "3.13")  # the oldest with JAX 0.10, the newest with JAX 0.12


def test_ci_runs_the_readme_test_command_at_both_ends():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make lab" in readme
    assert re.search(r"^    PK_REQUIRE_BROWSER=1 timed make test$", ci, re.M)  # the oldest end: the whole suite
    newest = re.findall(
        r'^timed make test PYTHON="\$NEWEST" VENV="\$NEWEST_VENV" PYTEST_ARGS="\$NEWEST_\w+"$', ci, re.M
    )
    assert len(newest) == 3  # the newest end: every fast test, multi-host, the named slow tests and notebooks
    assert "for version in 3.13 3.12; do" in ci and "found neither" in ci


def test_environment_yml_installs_this_package_with_its_extras():
    env = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s+- -e \.\[dev\]$", env, re.M)
    assert re.search(r"^\s+- python>=3\.11,<3\.14$", env, re.M)  # the Pythons pyproject.toml names
    # every dependency lives in pyproject.toml only
    assert "jax" not in env and "flax" not in env


def test_pins_admit_jax_010_to_012_on_python_311_to_313():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {re.split(r"[<>=!\[ ]", d)[0]: d for d in project["dependencies"]}
    for name in ("jax", "jaxlib"):
        admitted = Requirement(pins[name]).specifier
        assert {v for v in ("0.9.2", "0.10.2", "0.11.2", "0.12.0.1", "0.13.0") if v in admitted} == {
            "0.10.2",
            "0.11.2",
            "0.12.0.1",
        }
    assert project["requires-python"] == f">={SUPPORTED_PYTHONS[0]}"
    named = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)]
    assert tuple(named) == SUPPORTED_PYTHONS


def test_the_kit_uses_no_private_jax_module():
    """``jax._src`` and the like may change in any release: the kit uses JAX's public API only."""
    private = re.compile(r"\b(jax|jaxlib)(\.[A-Za-z]\w*)*\._[a-z]\w*")  # jax._src, jax.interpreters._x, ...
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in sorted((ROOT / "parallelkit").rglob("*.py"))
        for match in private.finditer(path.read_text())
    ]
    assert not found, found


def test_makefile_test_target_is_pytest():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: setup\n\t\$\(BIN\)/python -m pytest \$\(PYTEST_ARGS\)$", makefile, re.M)
    assert re.search(r"^PYTEST_ARGS \?=$", makefile, re.M)  # empty: `make test` runs the whole suite


def test_makefile_lab_target_runs_the_lab_command():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^lab: setup\n\t\$\(BIN\)/python -m parallelkit lab$", makefile, re.M)


def test_lab_command_fits_root_and_headless_machines():
    from parallelkit.__main__ import lab_command

    as_root_headless = lab_command(env={}, euid=0)
    as_user_with_display = lab_command(env={"DISPLAY": ":0"}, euid=1000)
    assert "--allow-root" in as_root_headless and "--allow-root" not in as_user_with_display
    if sys.platform.startswith("linux"):
        assert "--no-browser" in as_root_headless and "--no-browser" not in as_user_with_display
    assert as_root_headless[1:4] == ["-m", "jupyterlab", str(ROOT / "notebooks")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_make_lab_command_starts_a_server_that_answers():
    """What `make lab` runs, as the CI user (root in CI), without a display: it prints the URL with its
    token, and that URL answers HTTP 200."""
    from parallelkit.run.distributed.launcher import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    with tempfile.TemporaryDirectory() as home:
        env.update(JUPYTER_RUNTIME_DIR=home, JUPYTER_CONFIG_DIR=home)  # leave the user's Jupyter files alone
        proc = subprocess.Popen(
            [sys.executable, "-m", "parallelkit", "lab", f"--port={port}", "--ServerApp.ip=127.0.0.1"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            url = _wait_for(lambda: _printed_url(lines, port), proc, seconds=90)
            assert url, "".join(lines)[-3000:]
            # Jupyter prints the URL before its event loop binds the port, so the first tries may be refused.
            status = _wait_for(lambda: _status_of(url), proc, seconds=30)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(timeout=5)
            proc.stdout.close()
    assert status == 200
    assert "No display here" in "".join(lines)


def _printed_url(lines: list[str], port: int) -> str | None:
    found = re.search(rf"http://127\.0\.0\.1:{port}/lab\?token=[0-9a-f]+", "".join(lines))
    return found.group(0) if found else None


def _status_of(url: str) -> int | None:
    """The HTTP status `url` answers with, or None while nothing listens there yet."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.URLError as error:
        if isinstance(error.reason, ConnectionRefusedError):
            return None
        raise


def _wait_for(check, proc: subprocess.Popen, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if found := check():
            return found
        time.sleep(0.3)
    return None


def _package_source(tmp_path: Path) -> Path:
    """A copy of what the package is built from (the configuration, the README it cites, the package)."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(ROOT / "parallelkit", source / "parallelkit", ignore=shutil.ignore_patterns("__pycache__"))
    return source


def _pip(*args: str) -> subprocess.CompletedProcess:
    """pip, as `make setup` runs it (build isolation: the build backend pyproject.toml asks for)."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_holds_every_subpackage(tmp_path):
    source = _package_source(tmp_path)
    built = _pip("wheel", "--no-deps", "--wheel-dir", str(tmp_path / "wheels"), str(source))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("parallelkit-*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(source).as_posix() for p in (source / "parallelkit").rglob("*.py")}
    assert modules <= packed, f"left out of the wheel: {sorted(modules - packed)}"
    assert "parallelkit/corpus.txt.gz" in packed  # pk.data.text's default text (package data)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_editable_install_is_quiet_and_imports_from_the_checkout(tmp_path):
    """`make setup` installs the checkout editable; setuptools warns about folders named like the package
    unless the configuration lets it add the checkout to sys.path (pyproject.toml's package-dir)."""
    source = _package_source(tmp_path)
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    installed = _pip("--python", str(python), "install", "--no-deps", "-e", str(source))
    printed = installed.stdout + installed.stderr
    assert installed.returncode == 0, printed[-3000:]
    assert "Editable installation" not in printed and "BuildBackendWarning" not in printed, printed[-3000:]
    found = subprocess.run(  # where the package is found (importing it would need its dependencies)
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('parallelkit').origin)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert Path(found.stdout.strip()) == source / "parallelkit" / "__init__.py"
