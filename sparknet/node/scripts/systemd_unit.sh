# A daemon's systemd unit (sparknet.cluster.spark.daemons): installed and (re)started, stopped,
# or stopped and removed, as root (`sudo -n` where the login user is not: never a prompt).
#
#   sh -s -- start UNIT STAGED UNIT_FILE    install STAGED as UNIT_FILE, reload, enable, restart
#   sh -s -- stop UNIT                      stop it, then check it is down
#   sh -s -- remove UNIT UNIT_FILE          stop, disable and delete it, then check it is gone
#
# A unit never installed is no error: systemctl's complaints about it are muted. But a unit
# still running (or still installed, for `remove`) afterwards fails the run, saying which on
# stderr: a refused `sudo -n` (sudoers changed) must not pass silently, or `down` would delete
# the conf with the secret while the unit stays enabled, and the next boot would start the
# daemon with no authentication.
set -u
action=$1 unit=$2
s=
[ "$(id -u)" = 0 ] || s='sudo -n'

# The unit neither runs nor starts: systemd's states other than inactive, failed, unknown are
# active, activating (as in a restart loop), deactivating, reloading. With a unit file given,
# that file is gone too.
stopped() {
    st=$(systemctl is-active "$unit")
    case $st in
    inactive|failed|unknown) ;;
    *) echo "$unit is still $st" >&2; exit 1 ;;
    esac
    if [ -n "${1-}" ] && [ -e "$1" ]; then
        echo "$1 is still there" >&2
        exit 1
    fi
}

case $action in
start)
    $s install -m 0644 "$3" "$4" && $s systemctl daemon-reload &&
        $s systemctl enable -q "$unit" && $s systemctl restart "$unit"
    ;;
stop)
    $s systemctl stop "$unit" 2>/dev/null
    stopped
    ;;
remove)
    $s systemctl stop "$unit" 2>/dev/null
    $s systemctl disable -q "$unit" 2>/dev/null
    $s rm -f "$3"
    $s systemctl daemon-reload
    stopped "$3"
    ;;
*)
    echo "systemd_unit.sh: no action $action" >&2
    exit 2
    ;;
esac
