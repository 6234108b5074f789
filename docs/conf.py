"""Sphinx configuration of the hvd_onebit documentation: MyST Markdown pages, the API from the
docstrings (autodoc, napoleon) and the CLI from click (sphinx-click). The generated tables
(results, the settings that matter) are written first, from the code and the committed JSON."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hvd_onebit_tools import docs_tables  # noqa: E402

docs_tables.write(docs_tables.generate())

project = "hvd_onebit"
author = "the hvd_onebit authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx_click"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "step", "zoo", "zoo_long"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
html_theme = "alabaster"
html_static_path = []
