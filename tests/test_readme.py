"""Every ``bash`` and ``python`` block of the README and of the documentation pages runs as written, in order
(the README's tour first, then the pages in :data:`PAGES`' order), as on a fresh clone.

The blocks run in a scratch directory laid out like a checkout after the two set-up commands: ``.venv``
(the environment running the tests), ``flows/`` and ``../shared`` beside it, and an empty
``storage/``. A block preceded by ``<!-- not run by tests/test_readme.py: REASON -->`` is left out; the
reason must name the file that runs it instead (``.ci/run`` for the set-up commands, a test module for
the served refresh), and that file must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: the documentation pages whose blocks run after the README's, in this order (later blocks use earlier stores)
PAGES = [README, *(REPO / "docs" / name for name in ("guide.md", "large-labels.md", "benchmarks.md", "tree.md",
                                                    "leml.md", "gradfac.md", "measurements.md"))]
#: lines of the README at most: what xmldask is, how to start, where to go next (the rest is in docs/)
README_LINES = 250
SKIP = re.compile(r"<!-- not run by tests/test_readme.py: (?P<reason>.*?) -->\s*$")
#: seconds a block may take (the pipeline on bibtex is the longest: about a minute on 2 cores)
BLOCK_TIMEOUT = 900


def readme_blocks() -> list[dict]:
    """The fenced ``bash``/``python`` blocks of the README and the pages: language, code, file, line, skip reason."""
    return [block for page in PAGES for block in _blocks(page)]


def _blocks(page: Path) -> list[dict]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.match(previous)
        if fence.group(1) in ("bash", "python"):
            blocks.append({"language": fence.group(1), "code": "\n".join(lines[i + 1:end]) + "\n", "line": i + 1,
                           "file": str(page.relative_to(REPO)), "skip": skip.group("reason") if skip else None})
        i = end + 1
    return blocks


def test_every_skipped_block_names_what_runs_it():
    blocks = readme_blocks()
    assert len(blocks) >= 6
    for block in blocks:
        if block["skip"]:
            named = re.findall(r"(\.ci/run|tests/\w+\.py)", block["skip"])
            assert named and all((REPO / name).exists() for name in named), block


@pytest.mark.slow
@pytest.mark.first
@pytest.mark.shared_data
def test_readme_blocks_run_as_written(shared_data, tmp_path):
    shared = shared_data.parent
    checkout = tmp_path / "repo"
    checkout.mkdir()
    (tmp_path / "shared").symlink_to(shared, target_is_directory=True)
    (checkout / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (checkout / "flows").symlink_to(REPO / "flows", target_is_directory=True)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("XMLDASK_", "PREFECT_API_URL"))}  # the defaults of a fresh shell
    ran = 0
    for n, block in enumerate(readme_blocks()):
        if block["skip"]:
            continue
        if block["language"] == "bash":
            command = ["bash", "-e", "-o", "pipefail", "-c", block["code"]]
        else:
            script = checkout / f"readme_block_{n}.py"
            script.write_text(block["code"])
            command = [str(checkout / ".venv" / "bin" / "python"), script.name]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
        print(f"{block['file']} line {block['line']}: {time.perf_counter() - start:.1f} s")  # shown with -s
        assert done.returncode == 0, (f"{block['file']} line {block['line']} ({block['language']}) failed with "
                                      f"{done.returncode}:\n{block['code']}\n--- stdout\n{done.stdout[-3000:]}\n"
                                      f"--- stderr\n{done.stderr[-5000:]}")
        ran += 1
    assert ran >= 5
    assert (checkout / "storage" / "bibtex" / "pred.zarr").is_dir()


def test_the_readme_is_short_and_every_link_of_the_pages_resolves():
    assert len(README.read_text().splitlines()) <= README_LINES
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_api_reference_covers_every_public_module():
    """Each public module (no ``_`` in its dotted name) is on docs/api.md, or everything it exports is exported by a
    module that is (a package re-exporting its modules' classes)."""
    import importlib

    listed = re.findall(r"^::: ([\w.]+)$", (REPO / "docs" / "api.md").read_text(), flags=re.M)
    exported = {id(getattr(importlib.import_module(name), attr))
                for name in listed for attr in getattr(importlib.import_module(name), "__all__", ())}
    missing = []
    for package in ("xmldask", "flows"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            name = ".".join(parts)
            if any(part.startswith("_") for part in parts) or name in listed or name in ("xmldask.cli", "flows"):
                continue
            module = importlib.import_module(name)
            if not {id(getattr(module, attr)) for attr in getattr(module, "__all__", ())} <= exported - {None}:
                missing.append(name)
    assert not missing, f"public modules on no page of docs/api.md: {missing}"
