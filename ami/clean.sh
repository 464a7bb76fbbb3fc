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
#                  each of ROOT/home/*, and ROOT/LOGIN_HOME)
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

homes() {
    printf '%s\n' "$root/root"
    for h in "$root"/home/*; do
        if [ -d "$h" ] && [ ! -L "$h" ]; then printf '%s\n' "$h"; fi
    done
    case $login_home in
        /?*) printf '%s\n' "$root$login_home" ;;
    esac
}

exists() { [ -e "$1" ] || [ -L "$1" ]; }

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
            for f in "$base"$glob; do if exists "$f"; then rm -rf -- "$f" || status=1; fi; done ;;
        empty)
            for d in "$base"$glob; do
                if [ -d "$d" ]; then find "$d" -xdev ! -type d -delete 2>/dev/null; fi
            done ;;
        clear)
            for d in "$base"$glob; do
                if [ -d "$d" ]; then find "$d" -xdev -mindepth 1 -delete 2>/dev/null; fi
            done ;;
        remove-file)
            for f in "$base"$glob; do
                if [ -f "$f" ] && [ ! -L "$f" ]; then rm -f -- "$f" || status=1; fi
            done ;;
        truncate)
            for f in "$base"$glob; do if [ -f "$f" ]; then : > "$f" || status=1; fi; done ;;
        home)
            for h in $(homes | sort -u); do
                for f in "$h"/$glob; do if exists "$f"; then rm -rf -- "$f" || status=1; fi; done
            done ;;
        *)
            echo "clean.sh: no list $list" >&2
            exit 2 ;;
    esac
done
exit $status
