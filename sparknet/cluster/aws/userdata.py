"""The cloud-init user data every EC2 instance sparknet launches gets.

The node's host key, and the backstop that ends the instance when nothing else will.

The host key: cloud-init installs `ssh_keys` before sshd starts and deletes the image's own keys
(`ssh_deletekeys`); with `ssh_keys` given it generates no others, so the key sparknet pins is
the only one the node presents (`ssh_genkeytypes` would be redundant, and cloud-init's schema
refuses the empty list).

The backstop: the autostop timer, which ends an idle cluster, is the bootstrap's last step, so
until it runs nothing ends an instance whose bootstrap failed or whose submitter went away (a
laptop that sleeps). From launch on, each instance therefore powers itself off `minutes` after
each boot; it is launched with InstanceInitiatedShutdownBehavior=terminate, so a shutdown from
inside it terminates it. The shutdown is a per-boot script (cloud-init's `scripts_per_boot`
runs every executable file of ``/var/lib/cloud/scripts/per-boot`` at the end of each boot), not
a `runcmd`: the NVIDIA driver step reboots the node, and a `shutdown -P +N` scheduled once is
gone after a reboot. The script runs late in the boot, when systemd-logind (which holds a
scheduled shutdown) is up, which a `bootcmd` does not wait for. Once the master's timer runs,
the bootstrap cancels the backstop on every node (`BACKSTOP_TOOL`'s `cancel`): the scheduled
shutdown, and the script, so no later boot schedules it again. Whether a node still has a
backstop to cancel is its `armed`: the script, or the shutdown systemd-logind holds (its
ScheduledShutdown property), so a second bootstrap of a cluster whose backstops are gone has
nothing to do.

An image without systemd's `shutdown` has no backstop: the script fails at each boot (exit
127), and nothing can be scheduled; the cancel then removes the script and has no shutdown to
cancel.
"""

from __future__ import annotations

import shlex

import yaml

from sparknet.node import files

#: where the backstop's script lives on a node: cloud-init's per-boot scripts dir
BACKSTOP_SCRIPT = "/var/lib/cloud/scripts/per-boot/sparknet-backstop"


def cloud_config(host_private: str, host_public: str, backstop_minutes: int) -> str:
    """The user data of one launch request: its ed25519 host key (OpenSSH private and public
    key text) and a backstop of `backstop_minutes`. Valid under cloud-init's own schema."""
    if backstop_minutes < 1:
        raise ValueError(f"backstop_minutes {backstop_minutes!r} must be at least 1")
    config = {
        "ssh_deletekeys": True,
        "ssh_keys": {"ed25519_private": host_private, "ed25519_public": host_public},
        "write_files": [
            {
                "path": BACKSTOP_SCRIPT,
                "owner": "root:root",
                "permissions": "0755",
                "content": backstop_script(backstop_minutes),
            }
        ],
    }
    return "#cloud-config\n" + yaml.safe_dump(config, sort_keys=False)


def backstop_script(minutes: int) -> str:
    """The per-boot script: a power-off `minutes` from now (`-P`: a halt would leave the
    instance running and billing; a power-off is what EC2 turns into a termination)."""
    why = (
        "sparknet backstop: no autostop timer has taken over since this boot; "
        "powering off (the instance terminates)"
    )
    return files.template("backstop.sh", minutes=int(minutes), why=shlex.quote(why))


#: the package script (`sparknet.node.files.script`) that prints what of a node's backstop is
#: left (`sh -s -- armed BACKSTOP_SCRIPT`) and cancels it (`sh -s -- cancel BACKSTOP_SCRIPT`, as
#: root: `sudo -n` where the login user is not)
BACKSTOP_TOOL = "backstop.sh"

#: what its `armed` prints for each part of a backstop a node still has, one word a line
ARMED_SCRIPT, ARMED_SHUTDOWN = "script", "shutdown"
