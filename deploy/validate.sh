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
# Join tokens: the values in k8s/secret.yaml and systemd/*.env are checked as brigade checks a
# token (`brg1-` and at least 128 random bits as lower-case hex or base32, 10+ distinct
# characters, no template words). The shipped files hold placeholders, which are listed as notes;
# with --filled (for a copy filled in for a deployment) a placeholder or weak token fails.
#
# Usage: deploy/validate.sh [--filled] [DIR]   DIR: a folder laid out as deploy/ (default: this one)
# Needs: target/venv (made by .ci/run; or PYTHON=…) with kubernetes-validate, check-jsonschema,
# jsonschema and PyYAML; systemd-analyze (Debian's systemd package).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
filled=0
if [ "${1:-}" = "--filled" ]; then filled=1; shift; fi
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

# --- join tokens ---------------------------------------------------------------------------------
if out=$("$py" - "$dir" "$filled" <<'PY' 2>&1
import re, sys
from pathlib import Path

import yaml

root, filled = Path(sys.argv[1]), sys.argv[2] == "1"
WORDS = ("replace", "example", "changeme", "placeholder", "your", "token", "secret", "xxxx")

def weak(value):
    """Why `value` is not a join token brigade accepts, or None."""
    if not value.startswith("brg1-"):
        return "it does not begin with brg1-"
    body = value[5:]
    if not (re.fullmatch(r"[0-9a-f]{32,}", body) or re.fullmatch(r"[a-z2-7]{26,}", body)):
        return "it is not 128 bits or more of lower-case hex or base32 after brg1-"
    if len(set(body)) < 10:
        return "it has fewer than 10 distinct characters"
    if any(w in body for w in WORDS):
        return "it holds a template word"
    return None

found = []
secret = root / "k8s" / "secret.yaml"
if secret.is_file():
    for doc in yaml.safe_load_all(secret.read_text()):
        token = ((doc or {}).get("stringData") or {}).get("token")
        if token is not None:
            found.append((f"k8s/{secret.name}", str(token)))
for env in sorted((root / "systemd").glob("*.env")):
    for line in env.read_text().splitlines():
        if line.startswith("BRIGADE_JOIN_TOKEN="):
            found.append((f"systemd/{env.name}", line.split("=", 1)[1].strip()))
bad = 0
for where, value in found:
    why = "it is empty" if not value else weak(value)
    if why is None:
        print(f"ok: {where} holds a join token brigade accepts")
    elif filled:
        print(f"{where}: the join token is a placeholder or weak: {why}")
        bad = 1
    else:
        print(f"note: {where} holds a placeholder ({why}): put a real token there before deploying")
sys.exit(bad)
PY
); then
  echo "$out"
else
  echo "$out" | sed -E '/^(ok|note): /!s/^/FAIL: /'
  failed=1
fi

if [ "$failed" -ne 0 ]; then
  echo "deploy/ did not validate"
  exit 1
fi
echo "deploy/ validated"
