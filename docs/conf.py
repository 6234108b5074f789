"""Sphinx configuration of the hvd_onebit documentation: MyST Markdown pages, the API from the
docstrings (autodoc, napoleon) and the CLI from click (sphinx-click). The generated tables
live in the pages themselves (``python -m hvd_onebit_tools.docs_tables`` refreshes them;
``tests/test_docs.py`` fails when one is stale), so the build reads the sources as they are."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:  # the Horovod face's page builds where Horovod is not installed (a DDP user's environment)
    import horovod.torch  # noqa: F401
except ImportError:
    autodoc_mock_imports = ["horovod"]

project = "hvd_onebit"
author = "the hvd_onebit authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx_click"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "step", "zoo", "zoo_long", "figures"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # into the Args entries, not a second list
napoleon_google_docstring = True
smartquotes = False  # "--np" stays two hyphens, so commands copy as they are
html_theme = "alabaster"
html_static_path = []

HOROVOD_DEFAULTS = {"compression": "hvd.Compression.none", "op": "hvd.Average",
                    "process_set": "hvd.global_process_set"}


def horovod_defaults(app, what, name, obj, options, signature, return_annotation):
    """The Horovod face's Horovod defaults as its users write them (op=hvd.Average), not as
    their values print (op=0) or as the mocked module names them."""
    if name == "hvd_onebit.DistributedOptimizer" and signature:
        for param, spelling in HOROVOD_DEFAULTS.items():
            signature = re.sub(rf"\b{param}=(<[^>]*>|[^,)]+)", f"{param}={spelling}", signature)
    return signature, return_annotation


def setup(app):
    app.connect("autodoc-process-signature", horovod_defaults)
