"""What the nvidia-driver step meets on a bare Ubuntu GPU node, as stand-ins first on a loopback
node's PATH (a `tests.sshd.RebootingNode`), each doing what the real tool does, with its output
and exit codes:

- `apt-get install` records packages in a package db (one file per package) and refuses a
  package the archive lacks (`E: Unable to locate package`, exit 100) or a caller not root;
- `dpkg-query -W` lists the db (`ii  <package>`; exit 1 and `no packages found matching` for a
  pattern that matches none);
- `ubuntu-drivers install --gpgpu` installs what ubuntu-drivers-common's `--gpgpu` does
  (UbuntuDrivers/detect.py `_build_installation_list`): `nvidia-headless-no-dkms-<branch>` and
  the kernel modules `linux-modules-nvidia-<branch>-aws`, no `nvidia-utils-<branch>`;
- `nvidia-smi` exists only once `nvidia-utils-<branch>` is installed; it works at a boot after
  the kernel modules were installed (exit 9 before, as without a loaded driver) and only for the
  loaded branch (exit 18, `Driver/library version mismatch`, else). It answers `-L`, the GPU
  discovery script's `--query-gpu=index --format=csv,noheader` and the bare table with its
  `CUDA Version:`; on an NVSwitch node it lists the GPUs whether the fabric manager runs or not,
  as the real one does (only CUDA waits for the fabric manager);
- `systemctl` reboots (the RebootingNode's own tool) and runs the fabric manager's service: it
  exists once `nvidia-fabricmanager-<major>` is installed, starts only where the driver is
  loaded (the real one aborts without it), and starts at each boot once enabled;
- `sudo -n` runs the command as "root" (what the stand-ins above check);
- a sysfs PCI tree (the step's `steps.PCI_DEVICES`) with the node's GPUs and, on an NVSwitch
  node, its switches (NVIDIA's class 0x0680 devices).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.sshd import RebootingNode

#: driver branches the stand-in archive has, with the driver version and the CUDA version its
#: nvidia-smi prints (NVIDIA's release notes)
BRANCHES = {
    "535-server": ("535.247.01", "12.2"),
    "550": ("550.163.01", "12.4"),
    "550-server": ("550.163.01", "12.4"),
    "570-server": ("570.172.08", "12.8"),
}

_ROOT = '[ "$(id -u)" = 0 ] || [ "$SPARKNET_TEST_ROOT" = 1 ]'

_SUDO = """#!/bin/sh
[ "$1" = -n ] && shift
export SPARKNET_TEST_ROOT=1
exec "$@"
"""

_APT_GET = """#!/bin/sh
db=@STATE@/dpkg
cmd= ; pkgs=
while [ $# -gt 0 ]; do
  case "$1" in
    -o) shift ;;
    -*) ;;
    update|install) cmd=$1 ;;
    *) pkgs="$pkgs $1" ;;
  esac
  shift
done
if ! { @ROOT@; }; then
  echo "E: Could not open lock file /var/lib/dpkg/lock-frontend - open (13: Permission denied)" >&2
  exit 100
fi
[ "$cmd" = update ] && exit 0
[ "$cmd" = install ] || { echo "apt-get stand-in: no stand-in for: $cmd" >&2; exit 64; }
for p in $pkgs; do
  grep -qx "$p" @STATE@/archive || { echo "E: Unable to locate package $p" >&2; exit 100; }
done
echo "install$pkgs" >> @STATE@/apt.log
for p in $pkgs; do
  touch "$db/$p"
  case "$p" in
    linux-modules-nvidia-*-aws)
      b=${p#linux-modules-nvidia-}; b=${b%-aws}
      echo "$b $(cat @BOOT_ID@)" > @STATE@/modules ;;
    nvidia-utils-*)
      sed "s/@BRANCH@/${p#nvidia-utils-}/g" @STATE@/nvidia-smi.in > @BIN@/nvidia-smi
      chmod 755 @BIN@/nvidia-smi ;;
    nvidia-fabricmanager-*) touch @STATE@/units/nvidia-fabricmanager ;;
  esac
done
"""

_DPKG_QUERY = """#!/bin/sh
if [ "$1" != -W ] || [ "$2" != '-f=${db:Status-Abbrev} ${Package}\\n' ]; then
  echo "dpkg-query stand-in: no stand-in for: $*" >&2; exit 64
fi
shift 2
rc=0
for pattern in "$@"; do
  found=
  for f in @STATE@/dpkg/$pattern; do
    [ -e "$f" ] || continue
    printf 'ii  %s\\n' "${f##*/}"; found=1
  done
  [ -n "$found" ] || { echo "dpkg-query: no packages found matching $pattern" >&2; rc=1; }
done
exit $rc
"""

_UBUNTU_DRIVERS = """#!/bin/sh
case "$*" in
  "install --gpgpu")
    if [ -e @STATE@/dpkg/nvidia-headless-no-dkms-@PICK@ ]; then
      echo "No drivers found for installation."; exit 0
    fi
    exec apt-get install -o DPkg::options::=--force-confnew --no-install-recommends -y \\
      nvidia-headless-no-dkms-@PICK@ linux-modules-nvidia-@PICK@-aws ;;
  "list --gpgpu")
    echo "nvidia-driver-@PICK@, (kernel modules provided by linux-modules-nvidia-@PICK@-aws)" ;;
  *) echo "ubuntu-drivers stand-in: no stand-in for: $*" >&2; exit 64 ;;
esac
"""

# @BRANCH@ is filled in when apt-get installs nvidia-utils-<branch>
_NVIDIA_SMI = """#!/bin/sh
m=@STATE@/modules
if [ ! -f $m ] || [ "$(cut -d' ' -f2 $m)" = "$(cat @BOOT_ID@)" ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure\\
 that the latest NVIDIA driver is installed and running."
  exit 9
fi
case @BRANCH@ in
@VERSIONS@
esac
if [ "$(cut -d' ' -f1 $m)" != @BRANCH@ ]; then
  echo "Failed to initialize NVML: Driver/library version mismatch"
  echo "NVML library version: ${driver%.*}"
  exit 18
fi
n=@GPUS@
case "$*" in
  -L)
    i=0; while [ $i -lt $n ]; do
      echo "GPU $i: @MODEL@ (UUID: GPU-5e1f0c3a-0000-0000-0000-00000000000$i)"; i=$((i+1))
    done ;;
  "--query-gpu=index --format=csv,noheader")
    i=0; while [ $i -lt $n ]; do echo $i; i=$((i+1)); done ;;
  "")
    d() { printf "%${1}s" '' | tr ' ' -; }
    date
    echo "+$(d 89)+"
    printf '| NVIDIA-SMI %-22s Driver Version: %-14s CUDA Version: %-9s|\\n' $driver $driver $cuda
    echo "|$(d 41)+$(d 24)+$(d 22)+" ;;
  *) echo "nvidia-smi stand-in: no stand-in for: $*" >&2; exit 2 ;;
esac
"""

_SYSTEMCTL = """#!/bin/sh
s=@STATE@
boot=$(cat @BOOT_ID@)
verb=$1; shift
[ "$verb" = reboot ] && exec $s/systemctl-reboot reboot
quiet= ; now= ; unit=
for a in "$@"; do
  case "$a" in --quiet|-q) quiet=1 ;; --now) now=1 ;; *) unit=${a%.service} ;; esac
done
if [ "$unit" != nvidia-fabricmanager ]; then
  echo "systemctl stand-in: no stand-in for: $verb $*" >&2; exit 64
fi
svc=nvidia-fabricmanager.service
loaded() { [ -f $s/modules ] && [ "$(cut -d' ' -f2 $s/modules)" != "$boot" ]; }
root() {
  @ROOT@ && return 0
  echo "Failed to $verb unit: Access denied" >&2; exit 1
}
start() {
  if [ ! -e $s/units/$unit ]; then
    echo "Failed to start $svc: Unit $svc not found." >&2; exit 5
  fi
  if ! loaded; then
    echo "Job for $svc failed because the control process exited with error code." >&2
    echo "See \\"systemctl status $svc\\" and \\"journalctl -xeu $svc\\" for details." >&2
    exit 1
  fi
  echo "$boot" > $s/active; rm -f $s/stopped
}
case "$verb" in
  is-active)
    if [ "$(cat $s/active 2>/dev/null)" = "$boot" ] || {
         [ -f $s/enabled ] && [ "$(cat $s/enabled)" != "$boot" ] && loaded &&
         [ "$(cat $s/stopped 2>/dev/null)" != "$boot" ]; }; then
      [ -n "$quiet" ] || echo active; exit 0
    fi
    [ -n "$quiet" ] || echo inactive; exit 3 ;;
  enable)
    root
    if [ ! -e $s/units/$unit ]; then
      echo "Failed to enable unit: Unit file $svc does not exist." >&2; exit 1
    fi
    [ -f $s/enabled ] || echo "$boot" > $s/enabled
    [ -z "$now" ] || start ;;
  start|restart) root; start ;;
  stop) root; rm -f $s/active; echo "$boot" > $s/stopped ;;
  *) echo "systemctl stand-in: no stand-in for: $verb $*" >&2; exit 64 ;;
esac
"""


@dataclass(frozen=True)
class NvidiaTools:
    """The stand-ins on one node: its state dir (package db, PCI tree, the service's state)."""

    state: Path

    @property
    def pci(self) -> Path:
        return self.state / "pci"

    def installed(self) -> set[str]:
        return {p.name for p in (self.state / "dpkg").iterdir()}

    def apt_installs(self) -> list[str]:
        """Each `apt-get install` run, as `install <package> ...`."""
        log = self.state / "apt.log"
        return log.read_text().splitlines() if log.exists() else []

    def fabric_manager_enabled(self) -> bool:
        return (self.state / "enabled").exists()


def install(
    node: RebootingNode,
    state: Path,
    *,
    branch: str = "550-server",
    gpus: int = 1,
    model: str = "NVIDIA A10G",
    nvswitches: int = 0,
) -> NvidiaTools:
    """Put the stand-ins on `node`'s PATH, with `state` as their state dir: a bare node (no
    NVIDIA package) with `gpus` GPUs and `nvswitches` NVSwitches, whose ubuntu-drivers picks
    `branch`. The archive has every branch of BRANCHES (utils, headless driver, modules) and
    the fabric managers of their majors."""
    for sub in ("dpkg", "units", "pci"):
        (state / sub).mkdir(parents=True)
    majors = sorted({b.split("-")[0] for b in BRANCHES})
    archive = ["ubuntu-drivers-common"]
    for b in BRANCHES:
        archive += [f"nvidia-headless-no-dkms-{b}", f"linux-modules-nvidia-{b}-aws"]
        archive += [f"nvidia-utils-{b}"]
    archive += [f"nvidia-fabricmanager-{m}" for m in majors]
    (state / "archive").write_text("\n".join(archive) + "\n")
    versions = "\n".join(f"  {b}) driver={d} cuda={c} ;;" for b, (d, c) in BRANCHES.items())
    fill = {
        "@STATE@": str(state),
        "@BOOT_ID@": str(node.boot_id),
        "@BIN@": str(node.bin),
        "@ROOT@": _ROOT,
        "@PICK@": branch,
        "@GPUS@": str(gpus),
        "@MODEL@": model,
        "@VERSIONS@": versions,
    }

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    (state / "nvidia-smi.in").write_text(filled(_NVIDIA_SMI))
    # the node's own reboot tool stays what `systemctl reboot` runs
    (node.bin / "systemctl").rename(state / "systemctl-reboot")
    tools = {
        "sudo": _SUDO,
        "apt-get": _APT_GET,
        "dpkg-query": _DPKG_QUERY,
        "ubuntu-drivers": _UBUNTU_DRIVERS,
        "systemctl": _SYSTEMCTL,
    }
    for name, body in tools.items():
        (node.bin / name).write_text(filled(body))
        (node.bin / name).chmod(0o755)
    devices = [("0000:00:1f.0", "0x8086", "0x060100"), ("0000:00:1f.4", "0x8086", "0x068000")]
    devices += [(f"0000:{0x10 + i:02x}:00.0", "0x10de", "0x030200") for i in range(gpus)]
    devices += [(f"0000:{0x60 + i:02x}:00.0", "0x10de", "0x068000") for i in range(nvswitches)]
    for address, vendor, klass in devices:
        (state / "pci" / address).mkdir()
        (state / "pci" / address / "vendor").write_text(vendor + "\n")
        (state / "pci" / address / "class").write_text(klass + "\n")
    return NvidiaTools(state)
