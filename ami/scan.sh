#!/bin/sh
# The last look at a sparknet builder before its image is made: files that look like a
# credential or a private key, left after clean.sh. `sparknet ami bake` runs it as root over SSH
# (sparknet/cluster/ami.py, `scan_command`) and fails the bake, naming them, if it prints any.
#
# usage: scan.sh ROOT LOGIN_HOME [dir DIR | skip PATTERN]...
#   ROOT        where the image's "/" is: empty on the builder itself, a directory in tests
#   LOGIN_HOME  the home of the user the bake logs in as (as the builder sees it)
#   dir DIR     a directory searched (its "/" and {prefix} resolved); every home always is:
#               ROOT/root, ROOT/home (a home there that is a link: where it leads too),
#               ROOT/LOGIN_HOME, and each user's of ROOT/etc/passwd but "/" (nor one on /run,
#               /dev, /proc or /sys, which the image does not hold)
#   skip PATTERN  a `find -path` pattern whose files are not looked at ("*" matches "/" too)
#
# Prints "PATH<TAB>WHY" for each file found, PATH as the image will have it (ROOT taken off), and
# exits 0 when it has looked (found or not). A file is reported if
#   - it holds a PEM private key (a "-----BEGIN ... PRIVATE KEY" line; text files under 1 MiB),
#   - or it holds an AWS secret access key set to its 40 characters (an ini or env file's
#     aws_secret_access_key = ..., AWS_SECRET_ACCESS_KEY=..., JSON's "SecretAccessKey": "..."),
#   - or its name is one a credential or a private key has (a list below; not *.pem: those
#     under /etc/ssl are certificates, found by what they hold instead).
set -u
set -f # patterns are find's, not the shell's
root=$1 login_home=$2
shift 2
IFS='
'
dirs="$root/root
$root/home"
set +f
for h in "$root"/home/*; do
    if [ -L "$h" ]; then dirs="$dirs
$h"; fi
done
set -f
case $login_home in
    /?*) dirs="$dirs
$root$login_home" ;;
esac
if [ -f "$root/etc/passwd" ]; then
    while IFS=: read -r _user _pw _uid _gid _gecos h _shell; do
        case $h in
            /run/* | /var/run/* | /dev | /dev/* | /proc/* | /sys/*) ;; # not in the image
            /?*) dirs="$dirs
$root$h" ;;
        esac
    done < "$root/etc/passwd"
fi
skips=
while [ $# -ge 2 ]; do
    case $1 in
        dir) dirs="$dirs
$2" ;;
        skip) skips="$skips
$2" ;;
        *)
            echo "scan.sh: no list $1" >&2
            exit 2 ;;
    esac
    shift 2
done

# the skipped paths as one find expression (never true when there are none)
set -- ! -path '*'
for p in $skips; do set -- "$@" -o -path "$p"; done

report() { # PATHs on stdin, as the image has them, with WHY
    while IFS= read -r f; do printf '%s\t%s\n' "${f#"$root"}" "$1"; done
}

pem='-----BEGIN [A-Z0-9 ]*PRIVATE KEY'
# an AWS secret access key written out (an ini, env or JSON setting and its 40 characters), not a
# mention of the name: AWS_SECRET_ACCESS_KEY="$SECRET" in a script is no secret
name='(aws_secret_access_key|secretaccesskey|aws_secret_key)'
value='[[:space:]]*[:=][[:space:]]*["'\'']?[A-Za-z0-9/+]{40}([^A-Za-z0-9/+]|$)'
aws="$name[\"']?$value"
for d in $(printf '%s\n' "$dirs" | sort -u); do
    [ -d "$d" ] || continue
    find -H "$d" -xdev \( "$@" \) -prune -o \( -type f -o -type l \) \( \
        -name credentials -o -name credentials.json -o -name application_default_credentials.json \
        -o -name 'id_rsa' -o -name 'id_dsa' -o -name 'id_ecdsa' -o -name 'id_ed25519' \
        -o -name 'id_ecdsa_sk' -o -name 'id_ed25519_sk' -o -name token -o -name stored_tokens \
        -o -name .netrc -o -name .git-credentials -o -name .pypirc -o -name kaggle.json \
        -o -name .s3cfg -o -name .boto -o -name '*.p12' -o -name '*.pfx' \
        \) -print | report "a credential's or private key's name"
    find -H "$d" -xdev \( "$@" \) -prune -o -type f -size -1024k -print0 \
        | xargs -0 -r grep -l -I -s -e "$pem" -- | report "a PEM private key"
    find -H "$d" -xdev \( "$@" \) -prune -o -type f -size -1024k -print0 \
        | xargs -0 -r grep -l -I -s -i -E -e "$aws" -- | report "an AWS secret access key"
done | sort -u
exit 0
