"""``layertap incidents HOST [get ID -o FILE.npz | delete ID]``: the flight recorder's ring."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from .._incidents import IncidentInfo, Incidents, info_dict
from .args import CommandFactory, connect

__all__ = ["add_incidents_command"]


def add_incidents_command(command: CommandFactory) -> None:
    """Register ``incidents`` with the CLI's ``command(name, help)`` factory."""
    p = command("incidents", "List the flight recorder's incidents, or fetch or delete one.")
    p.add_argument("action", nargs="?", choices=("list", "get", "delete"), default="list",
                   help="list (default), get ID -o FILE.npz, or delete ID")
    p.add_argument("id", nargs="?", metavar="ID", help="incident id (see 'layertap incidents HOST')")
    p.add_argument("--tap", default="", help="list only this tap's incidents")
    p.add_argument("-o", "--output", type=Path, help="get: the .npz to write (inputs, layers, incident JSON)")
    p.add_argument("--json", action="store_true", help="list: one JSON object per line")
    p.set_defaults(func=_cmd_incidents)


def _line(info: IncidentInfo) -> str:
    when = dt.datetime.fromtimestamp(info.time, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    replay = "matches" if info.replay_matches else ("DIFFERS" if info.replayed else "none")
    rows = ",".join(map(str, info.rows)) or "-"
    return (f"{info.id}  {when}  tap={info.tap}  triggers={','.join(info.triggers)}  "
            f"layers={','.join(info.layers)}  rows={rows}  pass={info.pass_index}  replay={replay}")


def _cmd_incidents(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.id:
        raise ValueError(f"incidents {args.action}: name an incident ID (see 'layertap incidents {args.host}')")
    if args.action == "get" and args.output is None:
        raise ValueError("incidents get: give -o FILE.npz")
    with connect(args) as client:
        incidents = Incidents(client)
        if args.action == "get":
            incident = incidents.get(args.id)
            incident.save(args.output)
            print(f"{incident.info.id}: {len(incident.inputs)} input(s), {len(incident.layers)} layer tensor(s) "
                  f"-> {args.output}")
            return 0
        if args.action == "delete":
            incidents.delete(args.id)
            print(f"deleted {args.id}")
            return 0
        infos = incidents.list(args.tap)
    for info in infos:
        sys.stdout.write((json.dumps(info_dict(info)) if args.json else _line(info)) + "\n")
    if not infos and not args.json:
        print(f"no incidents at {args.host}")
    return 0
