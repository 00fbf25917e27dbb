"""The mesh command line: ``shardpool mesh ...`` and ``python -m mesh ...`` (same commands).

:mod:`mesh.cli.parser` builds the parser and runs a command; one module per group of commands:
:mod:`mesh.cli.membership` (init, join, leave), :mod:`mesh.cli.running` (up, down),
:mod:`mesh.cli.invites` (invite, remove), :mod:`mesh.cli.status` (status, export-config), with
:mod:`mesh.cli.tokens`, :mod:`mesh.cli.agent_process` and :mod:`mesh.cli.common` beneath them.
"""
