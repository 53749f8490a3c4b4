"""MkDocs hooks: the README is the site's home page (one source for both), its links rewritten for the site."""

from __future__ import annotations

from pathlib import Path


def on_files(files, config):
    """Add the README as ``index.md``, its ``docs/`` links made relative to the site."""
    from mkdocs.structure.files import File

    readme = Path(config["config_file_path"]).parent / "README.md"
    files.append(File.generated(config, "index.md", content=readme.read_text().replace("](docs/", "](")))
    return files


def on_page_markdown(markdown, page, config, files):
    """The pages link to the README's sections as ``../README.md#...``: on the site that is the home page."""
    return markdown.replace("](../README.md", "](index.md")
