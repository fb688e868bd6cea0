#!/bin/bash
# The hardware check on a bare GPU machine (the `device` tool of the
# development environment, docs/hardware.md): unpacks what
# shared/hardware/prepare.sh packed into .gpu/ (release binaries, Docker's
# daemons, busybox), starts dockerd, and runs tests/hardware/check.sh with
# its results in $OUT.
set -u
D=$PWD/.gpu
OUT=${OUT:-/tmp/gpuctl-hw-out}
mkdir -p "$OUT" /opt/gpuctl-hw/bin
tar -xJf "$D/gpuctl.tar.xz" -C /opt/gpuctl-hw/bin
chmod 0755 /opt /opt/gpuctl-hw /opt/gpuctl-hw/bin
if ! command -v dockerd >/dev/null; then
  mkdir -p /tmp/dk && tar -xJf "$D/docker.tar.xz" -C /tmp/dk
  cp /tmp/dk/libdevmapper.so.1.02.1 /tmp/dk/libseccomp.so.2 /usr/local/lib/ 2>/dev/null; ldconfig
  cp /tmp/dk/dockerd /tmp/dk/containerd /tmp/dk/containerd-shim-runc-v2 /tmp/dk/runc /tmp/dk/docker-init /usr/local/bin/
fi
ping_docker() {
  python3 -c "import socket;s=socket.socket(socket.AF_UNIX);s.connect('/var/run/docker.sock');s.send(b'GET /_ping HTTP/1.0\r\n\r\n');assert b'OK' in s.recv(200)" 2>/dev/null
}
start_dockerd() { # extra flags
  (setsid dockerd --iptables=false --bridge=none "$@" >"$OUT/dockerd.log" 2>&1 &)
  for _ in $(seq 40); do ping_docker && return 0; sleep 1; done
  return 1
}
# gpuctl demo builds its image from the host's static /bin/busybox.
[ -e /bin/busybox ] || cp "$D/busybox" /bin/busybox
start_dockerd || { pkill dockerd; sleep 1; start_dockerd --storage-driver=vfs; } || echo "dockerd does not start: container checks are skipped"
GPUCTL_BIN=/opt/gpuctl-hw/bin BUSYBOX="$D/busybox" OUT="$OUT" bash tests/hardware/check.sh > >(tee "$OUT/check.log") 2>&1
rc=$?
pkill dockerd
sleep 1 # tee of check.log finishing
# Few files come back from such a machine: the summary, and the rest packed.
(cd "$OUT" && tar -czf /tmp/gpuctl-hw-all.tgz . && find . -type f ! -name summary.txt -delete &&
  mv /tmp/gpuctl-hw-all.tgz all.tgz)
exit $rc
