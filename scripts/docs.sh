#!/usr/bin/env bash
# Builds the documentation site (docs/, Sphinx + MyST) into docs/_build/html with warnings as
# errors: the guide pages, the reference generated from the code (Python API, command lines,
# REST API, settings) and the example notebooks (rendered, not run). Uses the active virtual
# environment, else .venv; the tools come from the `docs` extra (pip install -e '.[docs]').
#   scripts/docs.sh              build the site
#   scripts/docs.sh --doctest    then run the >>> examples of every module and the docs tests
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VIRTUAL_ENV:-$PWD/.venv}"
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
if ! python -c 'import sphinx, myst_nb, pydata_sphinx_theme, sphinxarg' 2>/dev/null; then
    echo "docs.sh: the docs tools are missing in $venv: pip install -e '.[docs]'" >&2
    exit 1
fi
python -m sphinx -W --keep-going -q -b html docs docs/_build/html
echo "docs.sh: built docs/_build/html/index.html"
if [[ "${1:-}" == "--doctest" ]]; then
    python -m pytest -q tests/unit/test_doctests.py tests/dist/test_doctests_torch.py \
        tests/unit/test_docs_links.py
fi
