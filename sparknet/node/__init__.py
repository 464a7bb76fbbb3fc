"""What runs on a node: functions of the sparknet wheel, called over SSH as one short command line.

The submitter never sends a program to a node: it sends `python -m sparknet.node COMMAND ...`
(`command.node_command`) to the node's venv, which has this very wheel. What must run before the
wheel is there (taking a host, the OS packages), or as root (a systemd unit, the backstop's
cancel: `sudo -n` of a shell command, never of the venv's Python, which would leave root's files
in the login user's venv), is a shell script kept as a file of this package (`scripts/`),
streamed to the node's `sh`; configuration files are templates beside it (`templates/`)."""
