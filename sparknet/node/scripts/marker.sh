# The owner marker of a host (sparknet.cluster.markers): read, taken or given back under flock
# on the lock file beside it, in this one run, so two sparknets never both take a host. It
# runs before anything of sparknet's is on the host (no venv, no wheel): POSIX sh.
#
#   sh -s -- take|release PREFIX MARKER LOCK LOCK_WAIT_S MAKE MATCH [HOLDER_JSON]
#
# MAKE (1 or 0): a PREFIX that is not there is made for the login user (sudo -n where it is not
# root), as the bootstrap's dirs step would, or, with 0, the answer is `absent` and nothing
# runs. MATCH is the text only the caller's marker holds. `take` prints `taken` (the host was
# free: HOLDER_JSON is its marker now), or `mine` / `held` then the marker (nothing written);
# `release` removes the marker when it is the caller's.
#
# The lock is the login user's alone (0600: another local user could hold a lock it can open);
# one the user cannot write (another user's prefix) is not taken: the marker, replaced in one
# rename, can still be read. A symbolic link in the lock's place is refused, and none is ever
# written through.
set -u
action=$1 p=$2 m=$3 lock=$4 wait_s=$5 make=$6 match=$7 holder=${8-}

if [ ! -d "$p" ]; then
    if [ "$make" = 1 ]; then
        s=
        [ "$(id -u)" = 0 ] || s='sudo -n'
        $s mkdir -p "$p" && $s chown "$(id -un)" "$p" || exit 1
    else
        echo absent
        exit 0
    fi
fi
command -v flock >/dev/null || { echo 'flock (util-linux) is not installed' >&2; exit 1; }
if [ -L "$lock" ] || { [ -e "$lock" ] && [ ! -f "$lock" ]; }; then
    echo "$lock is not a plain file (a link, a pipe), not a lock of sparknet's: remove it" >&2
    exit 1
fi
if [ -w "$lock" ] || { [ ! -e "$lock" ] && [ -w "$p" ]; }; then
    (umask 077; : >>"$lock") && [ ! -L "$lock" ] && exec 9>>"$lock" || exit 1
    if [ -O "$lock" ]; then chmod 600 "$lock"; fi
    flock -w "$wait_s" 9 || { echo 'its marker lock stays busy' >&2; exit 1; }
fi

case $action in
take)
    if [ -L "$m" ] || { [ -e "$m" ] && [ ! -f "$m" ]; }; then echo held; exit 0; fi
    if [ -s "$m" ]; then
        if grep -qF "$match" "$m"; then echo mine; else echo held; fi
        cat "$m"
        exit 0
    fi
    rm -f "$m.new" && (set -C; printf '%s\n' "$holder" > "$m.new") &&
        chmod 644 "$m.new" && mv -f "$m.new" "$m" && echo taken
    ;;
release)
    if [ -f "$m" ] && [ ! -L "$m" ] && grep -qF "$match" "$m" 2>/dev/null; then rm -f "$m"; fi
    true
    ;;
*)
    echo "marker.sh: no action $action" >&2
    exit 2
    ;;
esac
