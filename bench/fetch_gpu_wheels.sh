#!/usr/bin/env bash
# Downloads, on a machine that reaches PyPI, the wheels the GPU check machine lacks (../shared/notes/
# gpu-machine.md: Python 3.12, torch, transformers, safetensors, pyarrow, PyYAML, nvidia-ml-py, but no
# pydantic, so eagleflow.config and every CLI command fail to import there) into .whl/ (git-ignored), to
# travel with the working tree: the device tool's `run` with carry [".whl"]. bench/gpu_check.sh installs
# them there with `pip install --no-index --no-deps --target`.
#   bench/fetch_gpu_wheels.sh            # into .whl/
#   WHEEL_DIR=/x bench/fetch_gpu_wheels.sh
# Versions are the ones requirements.txt pins (one version of each package); the wheels' own
# Requires-Dist is then checked: every requirement must be among these wheels or in the image.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEEL_DIR:-.whl}
PY=${PYTHON:-python3}
PACKAGES=(pydantic pydantic_core annotated-types typing_extensions typing-inspection)
# what the GPU machine's image already has, of what these wheels require (gpu-machine.md)
IMAGE_HAS="pyyaml torch transformers safetensors numpy pyarrow"

norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
pins=()
for p in "${PACKAGES[@]}"; do
  line=$(grep -iE "^$(norm "$p" | sed 's/-/[-_.]/g')==" requirements.txt || true)
  if [ -z "$line" ]; then
    echo "fetch_gpu_wheels: requirements.txt pins no version of $p; pin one there (the lock every environment uses)" >&2
    exit 2
  fi
  pins+=("$line")
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/eagleflow-wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# manylinux2014 == manylinux_2_17; the later tags only where a package ships nothing older
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$tmp" "${pins[@]}"

"$PY" - "$tmp" "$IMAGE_HAS" <<'PYEOF'
import re, sys, zipfile
from pathlib import Path
d, image = Path(sys.argv[1]), set(sys.argv[2].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = sorted(d.glob("*.whl"))
have = {norm(w.name.split("-")[0]) for w in wheels}
bad = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line and "Windows" not in line:
                req = norm(re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0])
                if req not in have and req not in image:
                    bad.append(f"{w.name} requires {req}, which is neither fetched nor in the image")
if bad:
    sys.exit("fetch_gpu_wheels: incomplete set:\n  " + "\n  ".join(bad) + "\nadd it to PACKAGES in bench/fetch_gpu_wheels.sh")
PYEOF

mkdir -p "$DEST"
rm -f "$DEST"/*.whl          # one version of each package: the set just checked
mv "$tmp"/*.whl "$DEST"/
ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $total bytes in $DEST (carry limit 64 MiB with the working tree)"
if [ "$total" -gt $((16 * 1024 * 1024)) ]; then
  echo "fetch_gpu_wheels: $total bytes is more than the 16 MiB this check allows itself of the 64 MiB carry" >&2
  exit 1
fi
