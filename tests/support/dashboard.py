"""Reads the PromQL out of the Grafana dashboard, with template variables filled in.

Shared by tests/deploy/test_dashboard.py and the real-Prometheus e2e test.
Import it by path, since tests/ is not a package::

    sys.path.insert(0, str(ROOT / "tests" / "deploy"))
    from support.dashboard import dashboard_exprs
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "layertap-drift.json"

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
#: Grafana's built-in interval variables, given a fixed value here.
_BUILTINS = ("__rate_interval", "__interval", "__range")


def load_dashboard(path: str | Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard as parsed JSON."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))  # panels nested in collapsed rows
    return out


def dashboard_targets(path: str | Path = DASHBOARD) -> list[tuple[str, str]]:
    """``(panel title, raw expr)`` of every Prometheus target, variables untouched."""
    d = load_dashboard(path)
    return [
        (p.get("title", ""), t.get("expr", ""))
        for p in _panels(d.get("panels", []))
        for t in p.get("targets", [])
    ]


def dashboard_variables(path: str | Path = DASHBOARD) -> list[str]:
    """Names of the dashboard's template variables."""
    return [v["name"] for v in load_dashboard(path).get("templating", {}).get("list", [])]


def substitute(expr: str, values: Mapping[str, str], rate_interval: str = "1m") -> str:
    """Replace ``$var``, ``${var}`` and ``[[var]]`` as Grafana would.

    Raises:
        KeyError: For a variable neither in ``values`` nor a built-in interval.
    """
    builtins = {name: rate_interval for name in _BUILTINS}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in values:
            if "=~" not in expr:
                return values[name]
            # Regex-escape like Grafana, then double the backslashes for the
            # PromQL string literal ("layer1\\.0" is the regex layer1\.0).
            return re.escape(values[name]).replace("\\", "\\\\")
        if name in builtins:
            return builtins[name]
        raise KeyError(f"dashboard variable ${name} has no value; pass it in values")

    return _VAR.sub(repl, expr)


def dashboard_exprs(
    path: str | Path = DASHBOARD,
    values: Mapping[str, str] | None = None,
    rate_interval: str = "1m",
) -> list[str]:
    """Every target expr of the dashboard with template variables substituted.

    Args:
        path: The dashboard JSON.
        values: Template variable values, e.g. ``{"model": "demo", "layer": "layer3"}``.
            Values are regex-escaped where the expr uses ``=~``, as Grafana does.
        rate_interval: Stands in for ``$__rate_interval``/``$__interval``/``$__range``;
            use at least 4x the scrape interval.

    Returns:
        The exprs, in panel order.
    """
    return [substitute(e, values or {}, rate_interval) for _, e in dashboard_targets(path)]
