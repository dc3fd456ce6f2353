#!/usr/bin/env bash
# Create the virtual environment tests/test_eagle3_interop.py runs speculators in:
#   bash tests/interop/make_speculators_venv.sh VENV_DIR
# then run the check with FASTDECODE_SPECULATORS_PYTHON=VENV_DIR/bin/python pytest -m slow tests/test_eagle3_interop.py
set -euo pipefail
venv="${1:?usage: make_speculators_venv.sh VENV_DIR}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python3 -m venv "$venv"
# torch first, pinned: an unpinned torch (or one pulled in by a dependency) is a multi-GB CUDA build.
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet --no-deps speculators==0.9.0
"$venv/bin/pip" install --quiet -r "$here/requirements-speculators.txt"
"$venv/bin/python" -c "import speculators.models.eagle3, importlib.metadata as m; print('speculators', m.version('speculators'), 'in $venv')"
