#!/usr/bin/env bash
# Validates the deploy files offline, with the schemas the tools carry (no network):
#   k8s/*.yaml        against the Kubernetes API schemas (kubernetes-validate, strict: unknown
#                     fields fail), for the Kubernetes version below
#   compose.yaml      against the compose specification's JSON schema (the copy check-jsonschema
#                     ships), with jsonschema
#   systemd/*.service with `systemd-analyze verify` in a scratch root holding the units, a stand-in
#                     /usr/local/bin/brigade and the system's own units; any warning fails
# The Dockerfile is not built (that pulls images and crates; see README.md, "Deploy").
#
# Usage: deploy/validate.sh [DIR]      DIR: a folder laid out as deploy/ (default: this one)
# Needs: target/venv (made by .ci/run; or PYTHON=…) with kubernetes-validate, check-jsonschema,
# jsonschema and PyYAML; systemd-analyze (Debian's systemd package).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$(cd "${1:-$here}" && pwd)
root=$(cd "$here/.." && pwd)
py=${PYTHON:-$root/target/venv/bin/python}
k8s_version=1.33.0

die() { echo "validate.sh: $*" >&2; exit 2; }
[ -x "$py" ] || die "$py is missing: run .ci/run, or python3 -m venv target/venv && target/venv/bin/pip install kubernetes-validate check-jsonschema"
"$py" -c 'import kubernetes_validate, check_jsonschema, jsonschema, yaml' 2>/dev/null ||
  die "$py lacks kubernetes-validate, check-jsonschema, jsonschema or PyYAML: run .ci/run"
command -v systemd-analyze >/dev/null || die "systemd-analyze is missing: apt-get install systemd"

failed=0
fail() { echo "FAIL: $*"; failed=1; }

# --- Kubernetes ----------------------------------------------------------------------------------
for f in "$dir"/k8s/*.yaml; do
  if out=$("$py" -c 'import sys; from kubernetes_validate.__main__ import main; sys.exit(main())' \
      -k "$k8s_version" --strict --quiet "$f" 2>&1); then
    echo "ok: k8s/$(basename "$f") (Kubernetes $k8s_version, strict)"
  else
    fail "k8s/$(basename "$f"): $out"
  fi
done

# --- compose -------------------------------------------------------------------------------------
if out=$("$py" - "$dir/compose.yaml" <<'PY' 2>&1
import json, sys
from importlib import resources

import jsonschema
import yaml

schema = json.loads(
    resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
)
with open(sys.argv[1]) as f:
    doc = yaml.safe_load(f)
validator = jsonschema.validators.validator_for(schema)(schema)
errors = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
for e in errors:
    print("/".join(map(str, e.absolute_path)) or "(top)", ":", e.message)
sys.exit(1 if errors else 0)
PY
); then
  echo "ok: compose.yaml (compose specification schema)"
else
  fail "compose.yaml: $out"
fi

# --- systemd -------------------------------------------------------------------------------------
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/usr/local/bin" "$scratch/etc/systemd/system" "$scratch/usr/lib/systemd"
printf '#!/bin/sh\n' >"$scratch/usr/local/bin/brigade"
chmod 0755 "$scratch/usr/local/bin/brigade"
# the units' dependencies (network-online.target, multi-user.target, …) as this system has them
units=/usr/lib/systemd/system
[ -d "$units" ] || units=/lib/systemd/system
cp -r "$units" "$scratch/usr/lib/systemd/system"
for f in "$dir"/systemd/*.service; do
  cp "$f" "$scratch/etc/systemd/system/"
  unit=$(basename "$f")
  if out=$(systemd-analyze verify --man=no --root="$scratch" "$unit" 2>&1) && [ -z "$out" ]; then
    echo "ok: systemd/$unit (systemd-analyze verify)"
  else
    fail "systemd/$unit: $out"
  fi
done

if [ "$failed" -ne 0 ]; then
  echo "deploy/ did not validate"
  exit 1
fi
echo "deploy/ validated"
