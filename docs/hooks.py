"""MkDocs hooks (mkdocs.yml `hooks:`): what the pages show from outside docs/.

The dashboard picture lives next to the dashboard it shows (deploy/grafana/, where
render_dashboard.py writes it); the site serves that file instead of a copy that could age.

The package's layers are named once, in tests/test_layers.py (`LAYERS`, which the test checks
the imports against); the architecture page's table of them is built from there, read with
`ast` so that building the docs imports no test.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parent.parent

# Site path (as pages link it) -> file in the repository.
EXTERNAL_FILES = {
    "img/tether-dashboard.png": REPO / "deploy" / "grafana" / "tether-dashboard.png",
}

LAYERS_SOURCE = REPO / "tests" / "test_layers.py"
# Where a page shows the layers table.
LAYERS_PLACEHOLDER = "<!-- layers: built from LAYERS in tests/test_layers.py by docs/hooks.py -->"


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    for src_uri, path in EXTERNAL_FILES.items():
        files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    if LAYERS_PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(LAYERS_PLACEHOLDER, layers_table(LAYERS_SOURCE))


def layers_table(source: Path) -> str:
    """The `LAYERS` of `source` (pairs of a module prefix and what the layer holds) as a
    Markdown table, top-down."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "LAYERS" for t in targets):
                assert node.value is not None
                layers: tuple[tuple[str, str], ...] = ast.literal_eval(node.value)
                rows = [f"| `{module}` | {holds} |" for module, holds in layers]
                return "\n".join(["| layer | what it holds |", "|---|---|", *rows])
    raise ValueError(f"{source} has no LAYERS")
