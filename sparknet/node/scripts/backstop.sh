# A node's backstop (sparknet.cluster.aws.userdata): what is left of it, or its cancel. It runs
# on any node the bootstrap reaches, whatever is installed there: POSIX sh.
#
#   sh -s -- armed SCRIPT    one word a line: `script` while the per-boot SCRIPT is there (the
#                            next boot schedules a power-off), `shutdown` while systemd-logind
#                            holds a scheduled shutdown; nothing when the backstop is gone, or
#                            on a node without logind (there `shutdown` schedules nothing)
#   sh -s -- cancel SCRIPT   remove SCRIPT first, so no later boot schedules it again, then
#                            cancel the pending shutdown, as root (`sudo -n` where the login
#                            user is not). Idempotent: with nothing scheduled `shutdown -c` does
#                            nothing; on an image without `shutdown` (looked up on root's PATH)
#                            nothing can be scheduled, and there is nothing to cancel.
set -u
action=$1 script=$2

case $action in
armed)
    if [ -e "$script" ]; then echo script; fi
    # logind's property: (st) "poweroff" USEC while one is scheduled, (st) "" 0 when none is
    # (readable without root)
    case "$(busctl get-property org.freedesktop.login1 /org/freedesktop/login1 \
        org.freedesktop.login1.Manager ScheduledShutdown 2>/dev/null)" in
    '(st) ""'*|'') ;;
    *) echo shutdown ;;
    esac
    ;;
cancel)
    s=
    [ "$(id -u)" = 0 ] || s='sudo -n'
    $s rm -f "$script" || exit 1
    $s sh -c 'command -v shutdown >/dev/null || exit 0; exec shutdown -c'
    ;;
*)
    echo "backstop.sh: no action $action" >&2
    exit 2
    ;;
esac
