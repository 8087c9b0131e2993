"""``layertap tensorboard``: follow a tap into TensorBoard event files (``layertap[tensorboard]``).

The bridge module is imported only when the command runs, so the thin client
without the extra still starts every other command.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from .._errors import LayertapError
from .args import CommandFactory, connect, positive_float, positive_int

__all__ = ["add_tensorboard_command"]


def _cmd_tensorboard(args: argparse.Namespace) -> int:
    try:
        tb = importlib.import_module("layertap._tensorboard")
    except ImportError as exc:
        print(f"layertap: {exc}")
        return 1
    options = tb.FollowOptions(selector=args.selector, every=args.every, images=tuple(args.images or ()),
                               image_every=args.image_every, image_timeout=args.image_timeout,
                               duration=args.duration, passes=args.passes)
    bridge = tb.TensorBoardBridge(args.logdir)
    try:
        with connect(args) as client:
            written = tb.follow(client, bridge, options)
    except LayertapError as exc:
        if exc.code != "DEADLINE_EXCEEDED" or args.duration is None:
            raise  # reaching --duration is the normal end
        written = None
    except KeyboardInterrupt:
        written = None
    finally:
        bridge.close()
    skipped = f", {bridge.images_skipped} image(s) skipped: no pass in time" if bridge.images_skipped else ""
    print(f"{args.logdir}: last step {bridge.step}" + ("" if written is None else f" ({written} passes)") + skipped)
    return 0


def add_tensorboard_command(command: CommandFactory) -> None:
    """Register ``tensorboard`` with the CLI's ``command(name, help)`` factory (which adds HOST and the connection flags)."""
    p = command("tensorboard", "Follow a tap and write TensorBoard event files (needs layertap[tensorboard]).")
    p.add_argument("selector", metavar="SELECTOR", help="module name, glob ('layer*') or re:regex")
    p.add_argument("--logdir", type=Path, required=True, help="TensorBoard run directory (continued if it has events)")
    p.add_argument("--every", type=positive_int, help="summarize every N-th pass")
    p.add_argument("--images", action="append", metavar="LAYER",
                   help="capture this layer's feature maps as an image grid (repeatable)")
    p.add_argument("--image-every", type=positive_int, default=10,
                   help="capture the --images layers every N written passes (default 10)")
    p.add_argument("--image-timeout", type=positive_float, default=2.0,
                   help="wait this many seconds for a pass to capture --images from; none skips the image (default 2)")
    p.add_argument("--duration", type=positive_float, help="stop after this many seconds")
    p.add_argument("--passes", type=positive_int, help="stop after this many passes")
    p.set_defaults(func=_cmd_tensorboard)
