# What the bootstrap learns about a node before any step runs (sparknet.cluster.spark.plan's
# Facts): one section per `@name` line. It runs before anything of sparknet's is on the node.
#
#   sh -s -- ENV...
#
# Each ENV (a torch env an image may carry, e.g. /opt/pytorch) that has a python is listed with
# that Python's version and its torch's, read from the metadata (no import: seconds).
echo @user; id -un
echo @uid; id -u
echo @nproc; nproc
echo @meminfo; cat /proc/meminfo
echo @systemd; if [ -d /run/systemd/system ]; then echo yes; else echo no; fi
echo @mounts; cat /proc/mounts
echo @nvme; grep -H . /sys/block/nvme*/device/model 2>/dev/null
echo @envs
for d in "$@"; do
    [ -x "$d/bin/python" ] && echo "$d $("$d/bin/python" -c '
import importlib.metadata as m, platform
t = [d.version for d in m.distributions(name="torch")]
print(platform.python_version(), t[0] if t else "-")' 2>/dev/null)"
done
echo @python; python3 --version 2>&1
true
