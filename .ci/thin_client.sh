#!/usr/bin/env bash
# The base install is a thin client: install the wheel WITHOUT extras into a
# fresh venv (no torch, no prometheus-client), and use it against a real
# server running from the full .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'kill $server_pid 2>/dev/null || true; rm -rf "$tmp"' EXIT

.venv/bin/python -m pip wheel --quiet --no-deps -w "$tmp/dist" . 2>/dev/null
python3 -m venv "$tmp/thin"
"$tmp/thin/bin/python" -m pip install --quiet "$tmp"/dist/layertap-*.whl

.venv/bin/layertap serve --port 0 --no-metrics > "$tmp/server.out" 2> "$tmp/server.err" &
server_pid=$!
for _ in $(seq 120); do
    grep -q "serving on" "$tmp/server.out" 2>/dev/null && break
    sleep 0.5
done
addr=$(sed -n 's/^layertap: serving on //p' "$tmp/server.out")
[ -n "$addr" ] || { cat "$tmp/server.err"; exit 1; }

"$tmp/thin/bin/python" - "$addr" <<'PY'
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
