"""Sphinx configuration for hora's documentation (built by ``scripts/docs.sh``)."""

from __future__ import annotations

import sys
from pathlib import Path

# docs/_ext holds hora_reference, which writes the REST and settings reference pages.
sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "hora"
author = "hora contributors"
copyright = "hora contributors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "hora_reference",
]

# MyST: markdown sources; ``[text](page.md#heading-anchor)`` links need heading anchors.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4
suppress_warnings = ["myst.header"]

# The example notebooks are rendered as committed (without outputs), never executed here.
nb_execution_mode = "off"

# reference/generated/ holds the pages hora_reference writes; the reference pages include them.
exclude_patterns = ["_build", "reference/generated", "Thumbs.db", ".DS_Store"]

html_theme = "pydata_sphinx_theme"
html_title = "hora"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}

# autodoc: Google docstrings (napoleon); type hints in the descriptions, not the signatures.
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
