# Exit 0 where the node's PCI tree has an NVSwitch: NVIDIA's (vendor 0x10de) devices of class
# 0x0680 ("Bridge"), which show in sysfs before any driver loads (sparknet.cluster.spark.steps'
# NvidiaDriver). It runs before anything of sparknet's is on the node: POSIX sh.
#
#   sh -s -- DEVICES    (the PCI devices dir, /sys/bus/pci/devices)
for d in "$1"/*; do
    [ "$(cat "$d/vendor" 2>/dev/null)" = 0x10de ] &&
        case "$(cat "$d/class" 2>/dev/null)" in 0x0680*) exit 0 ;; esac
done
exit 1
