"""The server's command lines: ``layertap serve`` and ``layertap demo drift``.

The client's ``layertap`` entry point (``layertap.cli``) dispatches here only
when the server extra is installed, so the thin client never imports torch.
Assemblers (``app``, the training agent) never import this package.
"""
