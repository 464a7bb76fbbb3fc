# The OS packages a step installs with apt (sparknet.cluster.spark.steps): Java and the venv
# module before the node has a venv, the NVIDIA driver before it has a GPU. POSIX sh, run as
# root through `sudo -n` (never a prompt) unless the login user is root.
#
#   sh -s -- [--no-update] PACKAGE...
#
# apt waits up to 5 minutes for another apt (a fresh instance's unattended upgrades) to let go
# of its lock, and asks nothing (DEBIAN_FRONTEND=noninteractive).
set -u
s=
[ "$(id -u)" = 0 ] || s='sudo -n'
update=1
if [ "${1-}" = --no-update ]; then update=0; shift; fi
apt() { $s env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 "$@"; }
if [ "$update" = 1 ]; then apt update -qq || exit 1; fi
apt install -y -qq "$@"
