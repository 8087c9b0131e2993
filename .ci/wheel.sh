#!/usr/bin/env bash
# What users install, checked from the built wheel rather than the editable
# tree (which hides a package missing from the wheel):
#   1. the wheel with [server] in a fresh venv runs `layertap serve --smoke`
#      and then serves;
#   2. the wheel WITHOUT extras in another fresh venv is a thin client (no
#      torch, no prometheus-client) that captures from that server.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
server_pid=""
trap '[ -n "$server_pid" ] && kill $server_pid 2>/dev/null; rm -rf "$tmp"' EXIT

.venv/bin/python -m pip wheel --quiet --no-deps -w "$tmp/dist" . 2>/dev/null
wheel=$(ls "$tmp"/dist/layertap-*.whl)

echo "-- wheel[server] in a fresh venv: serve --smoke"
python3 -m venv "$tmp/full"
"$tmp/full/bin/python" -m pip install --quiet -c constraints-ci.txt "$wheel[server]"
(cd "$tmp" && timeout 300 "$tmp/full/bin/layertap" serve --smoke)

"$tmp/full/bin/layertap" serve --port 0 --no-metrics > "$tmp/server.out" 2> "$tmp/server.err" &
server_pid=$!
for _ in $(seq 120); do
    grep -q "serving on" "$tmp/server.out" 2>/dev/null && break
    sleep 0.5
done
addr=$(sed -n 's/^layertap: serving on //p' "$tmp/server.out")
[ -n "$addr" ] || { cat "$tmp/server.err"; exit 1; }

echo "-- wheel without extras in a fresh venv: thin client"
python3 -m venv "$tmp/thin"
"$tmp/thin/bin/python" -m pip install --quiet "$wheel"
(cd "$tmp" && "$tmp/thin/bin/python" - "$addr") <<'PY'
import importlib.util, sys
import numpy as np
import layertap
assert importlib.util.find_spec("torch") is None, "torch is installed in the thin venv"
with layertap.Client(sys.argv[1]) as c:
    x = np.zeros((2, 3, 32, 32), np.float32)
    act = c.capture(["layer4", "fc"], input=x)
    assert act["layer4"].shape == (2, 128, 2, 2) and act["fc"].shape == (2, 10)
    try:
        c.capture("layer4", input=x, as_torch=True)
    except Exception as exc:  # a clear error, not an ImportError traceback
        assert "torch" in str(exc), exc
    else:
        raise AssertionError("as_torch=True without torch should fail clearly")
print("thin client OK: capture works with grpcio, protobuf and numpy only")
PY
"$tmp/thin/bin/layertap" layers "$addr" > /dev/null
