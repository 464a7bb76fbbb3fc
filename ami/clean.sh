#!/bin/sh
# Cleans a sparknet builder before its image is made: `sparknet ami bake` runs it as root over
# SSH (sparknet/cluster/ami.py, `cleanup_command`), with ami/image.toml's lists as arguments.
#
# usage: clean.sh ROOT LOGIN_HOME [LIST BASE GLOB]...
#   ROOT        where the image's "/" is: empty on the builder itself, a directory in tests
#   LOGIN_HOME  the home of the user the bake logs in as (as the builder sees it)
#   LIST BASE GLOB  one entry of image.toml: BASE (ROOT or the install prefix: taken as it is,
#               never as a glob) and the glob after it, so "/var/log/*" is ROOT "/var/log/*":
#     remove       removed, whatever it is
#     empty        the files under the directory deleted, the directories kept
#     clear        everything under the directory deleted (dotfiles too), the directory kept
#     remove-file  removed where a regular file (a symlink stays)
#     truncate     emptied where a file, kept
#     home         a glob relative to a home (BASE empty): removed in every home (ROOT/root,
#                  each of ROOT/home/*, ROOT/LOGIN_HOME, and each user's of ROOT/etc/passwd)
# Below a home or the install prefix (which their users own, and so may have replaced a
# directory there with a symbolic link, ~/.ssh -> /) no symbolic link is followed: a match
# reached through one is left (the link itself is removed where a glob names it) and counts as
# not removed.
# A glob that matches nothing removes nothing. Exits 1 where a file could not be removed or
# emptied (what `empty` and `clear` race with on a live machine is not counted: the scan after
# the clean-up is what finds a secret left behind). Writes no file of its own (the temporary
# directories are among what it clears).
set -u
root=$1 login_home=$2
shift 2
# the globs are expanded unquoted, split at newlines only: a space in a path stays in it
IFS='
'

homes() { # each home directory once: root's, /home/*'s, the login user's, /etc/passwd's
    {
        printf '%s\n' "$root/root"
        for h in "$root"/home/*; do printf '%s\n' "$h"; done
        case $login_home in
            /?*) printf '%s\n' "$root$login_home" ;;
        esac
        if [ -f "$root/etc/passwd" ]; then
            while IFS=: read -r _user _pw _uid _gid _gecos h _shell; do
                case $h in
                    /?*) printf '%s\n' "$root$h" ;; # not "/" (daemons'), nor a relative one
                esac
            done < "$root/etc/passwd"
        fi
    } | sort -u | while IFS= read -r h; do
        if [ -d "$h" ]; then printf '%s\n' "$h"; fi
    done
}

exists() { [ -e "$1" ] || [ -L "$1" ]; }

# "$1" is where its path says under "$2" (a home or the prefix): no symbolic link between them
below() {
    up=${1%/*}
    top=$(cd -P -- "$2" 2>/dev/null && pwd) && top=${top%/} &&
        [ "$(cd -P -- "$up" 2>/dev/null && pwd)" = "$top${up#"$2"}" ]
}

# "$1" under BASE "$2": may it be cleaned? (a path under the builder's ROOT always may)
may() {
    if [ "$2" = "$root" ] || below "$1" "$2"; then return 0; fi
    echo "clean.sh: ${1#"$root"} not removed: a symbolic link below ${2#"$root"} leads there" >&2
    status=1
    return 1
}

# cloud-init's own clean-up first (its state and logs: the image's first boot is a first boot);
# only on the builder itself, where it would clean this machine
if [ -z "$root" ] && command -v cloud-init >/dev/null 2>&1; then
    cloud-init clean --logs
fi

status=0
while [ $# -ge 3 ]; do
    list=$1 base=$2 glob=$3
    shift 3
    case $list in
        remove)
            for f in "$base"$glob; do
                if exists "$f" && may "$f" "$base"; then rm -rf -- "$f" || status=1; fi
            done ;;
        empty)
            for d in "$base"$glob; do
                if [ -d "$d" ] && may "$d" "$base"; then
                    find "$d" -xdev ! -type d -delete 2>/dev/null
                fi
            done ;;
        clear)
            for d in "$base"$glob; do
                if [ -d "$d" ] && may "$d" "$base"; then
                    find "$d" -xdev -mindepth 1 -delete 2>/dev/null
                fi
            done ;;
        remove-file)
            for f in "$base"$glob; do
                if [ -f "$f" ] && [ ! -L "$f" ] && may "$f" "$base"; then
                    rm -f -- "$f" || status=1
                fi
            done ;;
        truncate)
            for f in "$base"$glob; do
                if [ -f "$f" ] && may "$f" "$base"; then : > "$f" || status=1; fi
            done ;;
        home)
            for h in $(homes); do
                for f in "$h"/$glob; do
                    if exists "$f" && may "$f" "$h"; then rm -rf -- "$f" || status=1; fi
                done
            done ;;
        *)
            echo "clean.sh: no list $list" >&2
            exit 2 ;;
    esac
done
exit $status
