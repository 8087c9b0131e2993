"""The Dockerfile, checked statically (no Docker engine on these machines)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_builds_the_server_image():
    ins = instructions()
    words = [w for w, _ in ins]
    assert words[0] == "ARG" and ins[0][1].startswith("BASE=python:")  # CPU base by default
    assert ("FROM", "${BASE}") in ins  # CUDA via --build-arg BASE=...
    runs = " ".join(rest for w, rest in ins if w == "RUN")
    assert re.search(r"--index-url \$\{TORCH_INDEX\} \"torch==\$\{TORCH_VERSION\}\"", runs)
    assert 'pip install ".[server]"' in runs
    copied = [rest.split()[0] for w, rest in ins if w == "COPY"]
    for path in ("pyproject.toml", "setup.py", "proto", "client", "server"):
        assert path in copied and (REPO / path).exists()
    assert ("USER", "layertap") in ins
    entry = json.loads(dict(ins)["ENTRYPOINT"])
    assert entry[:2] == ["layertap", "serve"] and "--host" in entry and "0.0.0.0" in entry
    assert "HEALTHCHECK" in words and "EXPOSE" in words
