#!/usr/bin/env bash
# The Python environment of tests/serve.rs: the official `openai` client (which brings httpx) in
# target/venv-openai. Run by .ci/run, and by the test itself when the environment is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv="$root/target/venv-openai"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import openai, httpx" 2>/dev/null; then exit 0; fi
python3 -m venv --clear "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai>=1.40,<3"
"$venv/bin/python" -c "import openai, httpx; print('openai', openai.__version__)"
