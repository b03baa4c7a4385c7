"""MkDocs hooks (mkdocs.yml `hooks:`): files from outside docs/ that the pages show.

The dashboard picture lives next to the dashboard it shows (deploy/grafana/, where
render_dashboard.py writes it); the site serves that file instead of a copy that could age.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent.parent

# Site path (as pages link it) -> file in the repository.
EXTERNAL_FILES = {
    "img/tether-dashboard.png": REPO / "deploy" / "grafana" / "tether-dashboard.png",
}


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    for src_uri, path in EXTERNAL_FILES.items():
        files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files
