#!/bin/bash
# gpuctl's check on a real GPU host (docs/hardware.md). Run as root on a host
# with an NVIDIA driver and no other gpuctl running:
#
#   GPUCTL_BIN=target/release bash tests/hardware/check.sh
#
# It starts a master and an agent on loopback, compares what the agent
# discovered with nvidia-smi, runs jobs in containers (if dockerd answers)
# and as host processes, and checks from outside gpuctl (CUDA inside the task,
# nvidia-smi's process list, the agent's metrics) that each task sees and uses
# exactly its GPUs, that the driver volume works and is read-only, and that a
# container's GPU work outlives an agent SIGKILL. It also compares
# `gpuctl-agent check` with nvidia-smi and, last, runs `gpuctl demo` with
# the same binaries once its own daemons are stopped. Each check prints
# PASS/FAIL/SKIP; the summary is in $OUT/summary.txt, logs beside it.
#
# Env: GPUCTL_BIN (dir of gpuctl, gpuctl-master, gpuctl-agent), OUT (results
# dir), BUSYBOX (static busybox for the test image), NVCC (to build
# cudacheck.cu; without it the CUDA checks are skipped), GPUCTL_HW_SKIP
# (sections to skip, of: mig mps).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${GPUCTL_BIN:-target/release}
BIN=$(cd "$BIN" && pwd)
OUT=${OUT:-/tmp/gpuctl-hw}
BUSYBOX=${BUSYBOX:-/bin/busybox}
NVCC=${NVCC:-nvcc}
# Not under /tmp: host tasks get a private /tmp of their own, and they run
# programs from here (cudacheck) as users of their own.
mkdir -p /var/lib/gpuctl-hw
W=$(mktemp -d /var/lib/gpuctl-hw/run.XXXXXX)
chmod 0755 /var/lib/gpuctl-hw "$W"
G="$BIN/gpuctl --master 127.0.0.1:17050"
mkdir -p "$OUT"
: >"$OUT/summary.txt"

say() { echo "$*" | tee -a "$OUT/summary.txt"; }
pass() { say "PASS $1: $2"; }
fail() { say "FAIL $1: $2"; }
skip() { say "SKIP $1: $2"; }
check() { # name, detail, condition...
  local n=$1 d=$2; shift 2
  if "$@"; then pass "$n" "$d"; else fail "$n" "$d"; fi
}
sec() { echo; echo "######## $*"; }
cleanup() {
  for p in ${AGENT_PID:-} ${MASTER_PID:-}; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  umount "$W/cg1/devices" 2>/dev/null
}
trap cleanup EXIT

sec host
nvidia-smi || { fail driver "nvidia-smi does not run"; exit 1; }
nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id,serial,driver_version --format=csv
nvidia-smi topo -m
ls -l /dev/nvidia* 2>&1
# Where the driver's files are: what the driver volume is built from.
for f in $(command -v nvidia-smi) /usr/bin/nvidia-smi /usr/local/nvidia/bin/nvidia-smi; do
  [ -e "$f" ] && { ls -la "$f"; readlink -f "$f"; head -c 4 "$f" | od -c | head -1; }
done
ldconfig -p | grep -E 'libcuda\.|libnvidia-ml\.' ; cat /etc/ld.so.conf.d/* 2>/dev/null | head
cat /usr/bin/nvidia-smi 2>/dev/null | head -20
ls -laL /lib/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1 2>&1; md5sum -b /lib/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1 2>&1
CGV=v1; [ -f /sys/fs/cgroup/cgroup.controllers ] && CGV=v2
echo "cgroup: $CGV"; cat /proc/self/cgroup
NGPU=$(nvidia-smi -L | grep -c '^GPU ')
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
DOCKER=0
if python3 - <<'EOF' 2>/dev/null; then DOCKER=1; fi
import socket; s = socket.socket(socket.AF_UNIX); s.connect('/var/run/docker.sock')
s.send(b'GET /_ping HTTP/1.0\r\n\r\n'); assert b'OK' in s.recv(200)
EOF
echo "gpus=$NGPU driver=$DRIVER docker=$DOCKER"

sec "gpuctl-agent check"
# The operator's check of a node (agent/src/check.rs), on the real NVML and
# Docker: what it reports against nvidia-smi. No cluster is needed.
timeout 120 "$BIN/gpuctl-agent" check --json >"$OUT/agent-check.json" 2>"$OUT/agent-check.err"
AC_RC=$?
timeout 120 "$BIN/gpuctl-agent" check >"$OUT/agent-check.txt" 2>&1
AC_TXT_RC=$?
cat "$OUT/agent-check.json" "$OUT/agent-check.err" "$OUT/agent-check.txt"
nvidia-smi --query-gpu=uuid,name --format=csv,noheader >"$W/smi-uuid-name.txt"
check agentcheck.exit "gpuctl-agent check --json and plain exit 0 ($AC_RC, $AC_TXT_RC)" \
  [ "$AC_RC" = 0 -a "$AC_TXT_RC" = 0 ]
python3 - "$OUT/agent-check.json" "$W/smi-uuid-name.txt" "$DRIVER" "$DOCKER" <<'EOF' >"$W/agentcheck.txt"
import csv, json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f'FAIL agentcheck.json: the report is not JSON ({e})'); sys.exit()
smi = [[c.strip() for c in row] for row in csv.reader(open(sys.argv[2])) if row]
gpus = r.get('gpus') or []
err = r.get('nvml_error')
names, want = [g.get('model') for g in gpus], [n for _, n in smi]
print(('PASS' if names == want and not err else 'FAIL') +
      f' agentcheck.gpus: {len(gpus)} GPU(s) {names}, nvidia-smi {len(smi)} {want}' +
      (f'; nvml_error {err!r}' if err else ''))
if gpus and all('uuid' in g for g in gpus):
    got, wantu = [g['uuid'] for g in gpus], [u for u, _ in smi]
    print(('PASS' if got == wantu else 'FAIL') + f' agentcheck.uuids: ours {got}, nvidia-smi {wantu}')
else:
    print('SKIP agentcheck.uuids: the report names no UUIDs (fields: ' +
          (', '.join(sorted(gpus[0])) if gpus else 'no GPU') + ')')
print(('PASS' if gpus and all(g.get('healthy') for g in gpus) else 'FAIL') +
      f" agentcheck.healthy: {sum(bool(g.get('healthy')) for g in gpus)} of {len(gpus)} healthy")
print(('PASS' if r.get('driver_version') == sys.argv[3] else 'FAIL') +
      f" agentcheck.driver: driver {r.get('driver_version')!r}, nvidia-smi {sys.argv[3]!r}")
d = r.get('docker') or {}
answers = 'docker' in r and r['docker'] is not None and not d.get('error')
said = 'answers' if answers else ('not checked' if r.get('docker') is None else f"not available ({d.get('error')})")
print(('PASS' if answers == (sys.argv[4] == '1') else 'FAIL') +
      f" agentcheck.docker: Docker {said}; the socket ping says {'up' if sys.argv[4] == '1' else 'down'}")
EOF
while read -r v n rest; do say "$v $n $rest"; done <"$W/agentcheck.txt"
check agentcheck.text "the plain report names $NGPU GPU(s) and driver $DRIVER" \
  sh -c "grep -q 'GPUs (NVML): $NGPU found, $NGPU healthy' '$OUT/agent-check.txt' && grep -q 'Driver: *$DRIVER' '$OUT/agent-check.txt'"

sec "test program and image"
CUDA=0
R=$W/rootfs
mkdir -p "$R/bin" "$R/tmp" "$R/etc"
if command -v "$NVCC" >/dev/null && "$NVCC" -O2 -cudart static -o "$R/bin/cudacheck" "$HERE/cudacheck.cu"; then
  CUDA=1
  for l in $(ldd "$R/bin/cudacheck" | grep -o '/[^ ]*'); do cp --parents -L "$l" "$R/"; done
  # What libcuda itself loads (a CUDA image has these).
  for l in libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1; do
    p=$(ldconfig -p | awk -v l="$l" '$1 == l && /x86-64/ {print $NF; exit}')
    [ -n "$p" ] && cp --parents -L "$p" "$R/"
  done
  "$R/bin/cudacheck" || true
fi
if [ "$DOCKER" = 1 ] && [ -x "$BUSYBOX" ]; then
  cp "$BUSYBOX" "$R/bin/busybox"
  for c in sh ls cat echo sleep env grep wc head id touch; do ln -sf busybox "$R/bin/$c"; done
  tar -C "$R" -cf "$W/rootfs.tar" .
  python3 "$HERE/docker-import.py" "$W/rootfs.tar" gpuctl-hw
  # An image that asks for every GPU the way NVIDIA's images do.
  python3 "$HERE/docker-import.py" "$W/rootfs.tar" gpuctl-hw-all 'ENV NVIDIA_VISIBLE_DEVICES=all'
fi

start_agent() { # extra agent flags
  "$BIN/gpuctl-agent" --master 127.0.0.1:17050 --listen 127.0.0.1:17051 \
    --work-dir "$W/agent" --metrics-listen 127.0.0.1:19101 \
    --health-interval-secs 2 "$@" >>"$OUT/agent.log" 2>&1 &
  AGENT_PID=$!
}
wait_gpus() {
  for _ in $(seq 60); do
    [ "$($G gpus --json 2>/dev/null | python3 -c 'import json,sys;print(len(json.load(sys.stdin)))' 2>/dev/null)" = "$NGPU" ] && return 0
    sleep 1
  done
  return 1
}
# run NAME SUBMIT-ARGS... -- CMD: submits, waits, leaves the job id in $J and
# the job's output in $LOG.
run() {
  local name=$1; shift
  J=$($G jobs submit --name "$name" "$@")
  timeout 200 $G jobs wait "$J" --timeout 180 >/dev/null 2>&1
  $G jobs get "$J" >"$OUT/job-$name.txt" 2>&1
  LOG=$($G jobs logs "$J" 2>&1)
  echo "--- $name ($J)"; cat "$OUT/job-$name.txt"; echo "$LOG"
}
has() { grep -q "$1" <<<"$LOG"; }
hasnt() { ! grep -q "$1" <<<"$LOG"; }
state() { $G jobs get "$1" --json 2>/dev/null | python3 -c 'import json,sys;print(json.load(sys.stdin)["state"])' 2>/dev/null; }
metric() { # name, task: the value of the sample of that task
  python3 - "$1" "$2" <<'EOF'
import sys, urllib.request
name, task = sys.argv[1], sys.argv[2]
body = urllib.request.urlopen('http://127.0.0.1:19101/metrics').read().decode()
for line in body.splitlines():
    if line.startswith(name + '{') and f'task="{task}"' in line:
        print(line.rsplit(' ', 1)[1]); break
EOF
}

sec cluster
"$BIN/gpuctl-master" --listen 127.0.0.1:17050 --data-dir "$W/master" >"$OUT/master.log" 2>&1 &
MASTER_PID=$!
start_agent
if ! wait_gpus; then
  fail discovery "the agent did not report $NGPU GPUs"; tail -40 "$OUT/agent.log"; exit 1
fi
AID=$($G agents list --json | python3 -c 'import json,sys;print(json.load(sys.stdin)[0]["id"])')
$G agents describe "$AID" | tee "$OUT/describe.txt"
$G agents list --json | python3 -c 'import json,sys;print(json.dumps([g for a in json.load(sys.stdin) for g in a["gpus"]]))' >"$OUT/gpus.json"

sec discovery
nvidia-smi -q >"$W/smi-q.txt"
python3 - "$OUT/gpus.json" "$W/smi-q.txt" <<'EOF' >"$W/disc.txt"
import csv, json, subprocess, sys
ours = {g['uuid']: g for g in json.load(open(sys.argv[1]))}
q = ['index', 'uuid', 'name', 'memory.total', 'pci.bus_id', 'serial']
rows = csv.reader(subprocess.run(['nvidia-smi', '--query-gpu=' + ','.join(q),
    '--format=csv,noheader,nounits'], capture_output=True, text=True).stdout.splitlines())
minors = [l.split(':')[1].strip() for l in open(sys.argv[2]) if l.strip().startswith('Minor Number')]
for i, r in enumerate(rows):
    idx, uuid, name, mem, bus, serial = [c.strip() for c in r]
    g = ours.get(uuid)
    if g is None:
        print(f'FAIL discovery.{idx}: {uuid} not reported'); continue
    want = {'index': int(idx), 'model': name, 'memory_mib': int(mem),
            'pci_bus_id': bus.lower(), 'serial': '' if serial.startswith('[') else serial,
            'minor': int(minors[i]) if i < len(minors) else None, 'healthy': True}
    got = dict(g, pci_bus_id=g['pci_bus_id'].lower())
    bad = [f'{k}: ours {got.get(k)!r}, nvidia-smi {v!r}' for k, v in want.items()
           if v is not None and got.get(k) != v]
    print(('FAIL' if bad else 'PASS') + f' discovery.{idx}: {uuid} ' + ('; '.join(bad) or
          f"{g['model']}, {g['memory_mib']} MiB, {g['pci_bus_id']}, minor {g['minor']}, cc {g['compute_capability']}"))
EOF
while read -r v n rest; do say "$v $n $rest"; done <"$W/disc.txt"
check discovery.driver "describe shows driver $DRIVER" grep -q "$DRIVER" "$OUT/describe.txt"
check discovery.healthy "the health probes pass on every GPU" python3 -c '
import json, sys; sys.exit(not all(g["healthy"] for g in json.load(open(sys.argv[1]))))' "$OUT/gpus.json"
# The topology matrix against nvidia-smi topo -m: NV<n>, PIX, PXB, PHB,
# NODE or SYS for every pair of GPUs.
if [ "$NGPU" -gt 1 ]; then
  nvidia-smi topo -m >"$W/topo.txt"
  python3 - "$OUT/gpus.json" "$W/topo.txt" <<'EOF2' >"$W/topo-check.txt"
import json, re, sys
gpus = sorted(json.load(open(sys.argv[1])), key=lambda g: g['index'])
rows = {}
for line in open(sys.argv[2]):
    cells = re.sub(r'\x1b\[[0-9;]*m', '', line).split()
    if cells and re.fullmatch(r'GPU\d+', cells[0]):
        rows[int(cells[0][3:])] = cells[1:1 + len(gpus)]
bad = []
for a in gpus:
    for b in gpus:
        if a['uuid'] == b['uuid']:
            continue
        p = next((p for p in a.get('peers', []) if p['uuid'] == b['uuid']), None)
        ours = '?' if p is None else (f"NV{p['nvlinks']}" if p.get('nvlinks') else p.get('pcie', '?'))
        smi = rows.get(a['index'], [])[b['index']] if b['index'] < len(rows.get(a['index'], [])) else '?'
        if ours != smi:
            bad.append(f"GPU{a['index']}-GPU{b['index']}: ours {ours}, nvidia-smi {smi}")
print(('FAIL' if bad else 'PASS') + ' discovery.topology: ' + ('; '.join(bad) or f'{len(gpus)} GPUs, every pair as nvidia-smi topo -m'))
EOF2
  while read -r v n rest; do say "$v $n $rest"; done <"$W/topo-check.txt"
else
  skip discovery.topology "one GPU: no pair to compare"
fi
UUID0=$(python3 -c 'import json,sys;print(sorted(json.load(open(sys.argv[1])),key=lambda g:g["index"])[0]["uuid"])' "$OUT/gpus.json")

sec "driver volume"
VOL=$(ls -d "$W"/agent/volumes/*/ 2>/dev/null | head -1)
if [ -n "$VOL" ]; then
  (cd "$VOL" && ls -la bin lib lib64) | tee "$OUT/volume.txt"
  check volume.libs "libcuda and libnvidia-ml in the volume" \
    sh -c "ls $VOL/lib64 2>/dev/null | grep -q libcuda.so && ls $VOL/lib64 | grep -q libnvidia-ml.so"
  check volume.smi "nvidia-smi in the volume" test -e "$VOL/bin/nvidia-smi"
else
  fail volume "no driver volume under $W/agent/volumes"
fi

if [ "$DOCKER" = 1 ]; then
  sec containers
  run c-gpu --gpus 1 --image gpuctl-hw:1 -- sh -c 'ls /dev | grep nvidia; echo NVD=$NVIDIA_VISIBLE_DEVICES; env | grep -E "^(PATH|LD_LIBRARY_PATH)="; cat /proc/driver/nvidia/version; LD_DEBUG=libs cudacheck 2>&1 | grep -iE "libcuda|libnvidia|cannot|error" | head -30; /usr/local/nvidia/bin/nvidia-smi -L; echo smi_rc=$?; cudacheck; echo cuda_rc=$?; touch /usr/local/nvidia/x 2>/dev/null && echo VOLUME_WRITABLE; true'
  check container.succeeded "a 1-GPU container job SUCCEEDED" [ "$(state "$J")" = SUCCEEDED ]
  check container.smi "nvidia-smi from the driver volume lists the GPU" has "smi_rc=0"
  check container.ro "the driver volume is read-only" hasnt VOLUME_WRITABLE
  if [ "$CUDA" = 1 ]; then
    check container.cuda "CUDA in the container sees one GPU" has "cuda_count=1 "
    check container.cuda.uuid "and it is $UUID0" has "uuid=$UUID0"
  fi
  run c-none --image gpuctl-hw-all:1 -- sh -c 'ls /dev | grep nvidia; echo NVD=$NVIDIA_VISIBLE_DEVICES; cudacheck; echo cuda_rc=$?'
  check container.nogpu.nodes "a job without GPUs has no /dev/nvidia* (image asks for all)" hasnt '^nvidia'
  check container.nogpu.env "NVIDIA_VISIBLE_DEVICES=void for it" has "NVD=void"
  if [ "$CUDA" = 1 ]; then
    check container.nogpu.cuda "CUDA there finds no device" hasnt 'cuda_count=[1-9]'

    sec "metrics while a task burns its GPU"
    J=$($G jobs submit --name burn --gpus 1 --image gpuctl-hw:1 -- cudacheck 40)
    for _ in $(seq 60); do [ "$(state "$J")" = RUNNING ] && break; sleep 1; done
    TASK=$($G jobs get "$J" --json | python3 -c 'import json,sys;print(json.load(sys.stdin)["tasks"][0]["id"])')
    sleep 12
    UTIL=$(metric gpuctl_gpu_utilization_ratio "$TASK")
    MEMU=$(metric gpuctl_gpu_memory_used_bytes "$TASK")
    $G top --once | tee "$OUT/top.txt"
    nvidia-smi --query-gpu=utilization.gpu,memory.used,power.draw --format=csv
    check metrics.util "utilization of $TASK's GPU is ${UTIL:-missing}" \
      python3 -c "import sys; sys.exit(not (float('${UTIL:-0}') >= 0.5))"
    check metrics.memory "memory used on it is ${MEMU:-missing} bytes" \
      python3 -c "import sys; sys.exit(not (float('${MEMU:-0}') > 0))"
    check metrics.top "gpuctl top names the task" grep -q "$J" "$OUT/top.txt"

    sec "agent SIGKILL while the task burns"
    PIDS_BEFORE=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | sort | tr '\n' ' ')
    kill -9 "$AGENT_PID"; wait "$AGENT_PID" 2>/dev/null
    sleep 2
    PIDS_DOWN=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | sort | tr '\n' ' ')
    start_agent
    sleep 8
    check fault.alive "the GPU process outlived the agent's SIGKILL ($PIDS_BEFORE)" \
      [ -n "$PIDS_BEFORE" -a "$PIDS_BEFORE" = "$PIDS_DOWN" ]
    check fault.running "the job is RUNNING again under the restarted agent" [ "$(state "$J")" = RUNNING ]
    timeout 100 $G jobs wait "$J" --timeout 90 >/dev/null 2>&1
    LOG=$($G jobs logs "$J" 2>&1)
    check fault.done "it then SUCCEEDED" [ "$(state "$J")" = SUCCEEDED ]
    check fault.output "with the output of its whole run" has "burn done"

    sec "cancel frees the GPU"
    J=$($G jobs submit --name cancel --gpus 1 --image gpuctl-hw:1 -- cudacheck 300)
    for _ in $(seq 60); do [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 1; done
    $G jobs cancel "$J"
    for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 1; done
    check cancel.gone "no process left on the GPU after cancel" \
      [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ]
  fi
else
  skip containers "dockerd does not answer on /var/run/docker.sock"
fi

sec "host processes"
run p-gpu --gpus 1 -- sh -c 'nvidia-smi -L; echo NVD=$NVIDIA_VISIBLE_DEVICES; echo pid=$$ uid=$(id -u) gid=$(id -g) groups=$(id -G); echo procs=$(ls /proc | grep -c "^[0-9]"); ls /tmp | wc -l | sed "s/^/tmp_entries=/"; nvidia-smi -L >/dev/null 2>&1; echo smi_rc=$?'
P_GPU=$(state "$J")
# Issue 31: every host task in namespaces of its own, under a user of its
# own, and the GPU still works there.
check process.ns.pid "the command is pid 2 of its own PID namespace (task-init is 1)" has "pid=2 "
check process.ns.user "it runs as a user of its own from 80000-89999, no other group" \
  python3 -c "import re,sys; m=re.search(r'uid=(\d+) gid=(\d+) groups=(\S+)\n', sys.argv[1]); sys.exit(not (m and 80000 <= int(m[1]) <= 89999 and m[1] == m[2] == m[3]))" "$LOG"
check process.ns.proc "its /proc shows only its own processes" \
  python3 -c "import re,sys; m=re.search(r'procs=(\d+)', sys.argv[1]); sys.exit(not (m and int(m[1]) <= 6))" "$LOG"
check process.ns.tmp "its /tmp is private and empty" has "tmp_entries=0"
check process.ns.smi "nvidia-smi works as that user in those namespaces" has "smi_rc=0"
run p-none -- sh -c 'cat /dev/nvidia0 2>&1 | head -c 200; echo; nvidia-smi -L 2>&1 | head -3'
P_NONE=$(state "$J")
if [ "$CGV" = v2 ]; then
  # cgroup v2: the task's cgroup carries gpuctl's eBPF device program.
  check process.v2.gpu "a 1-GPU host process SUCCEEDED under the device program ($P_GPU)" \
    [ "$P_GPU" = SUCCEEDED ]
  check process.v2.denied "a host process without GPUs is denied /dev/nvidia0 ($P_NONE)" \
    has "Operation not permitted"
  if [ "$CUDA" = 1 ]; then
    run v2-cuda --gpus 1 -- "$R/bin/cudacheck"
    check process.v2.cuda "CUDA in a 1-GPU host process sees $UUID0" has "uuid=$UUID0"
    run v2-cuda-none -- "$R/bin/cudacheck"
    check process.v2.cuda.none "CUDA in a host process without GPUs finds no device" hasnt 'cuda_count=[1-9]'
  fi
else
  check process.gpu "a 1-GPU host process SUCCEEDED and nvidia-smi saw the GPU" \
    [ "$P_GPU" = SUCCEEDED ]
  check process.nogpu "a host process without GPUs is denied /dev/nvidia0" \
    has "Operation not permitted"
fi

# On a v2 host the devices controller is free for a v1 hierarchy (v2 has
# none; it uses eBPF). Mounted beside v2, it lets the agent's v1 isolation of
# host processes be checked against the real driver.
if [ "$CGV" = v2 ]; then
  sec "host processes under a v1 devices hierarchy beside v2"
  mkdir -p "$W/cg1/devices"
  if mount -t cgroup -o devices none "$W/cg1/devices" 2>"$W/mount.err"; then
    kill "$AGENT_PID"; wait "$AGENT_PID" 2>/dev/null
    start_agent --cgroup-root "$W/cg1"
    wait_gpus || fail v1.agent "the agent did not come back"
    sleep 2
    run v1-gpu --gpus 1 -- sh -c 'nvidia-smi -L; echo smi_rc=$?; echo NVD=$NVIDIA_VISIBLE_DEVICES'
    check process.v1.gpu "a 1-GPU host process SUCCEEDED" [ "$(state "$J")" = SUCCEEDED ]
    check process.v1.smi "nvidia-smi in it lists the GPU" has "smi_rc=0"
    if [ "$CUDA" = 1 ]; then
      run v1-cuda --gpus 1 -- "$R/bin/cudacheck"
      check process.v1.cuda "CUDA in a 1-GPU host process sees $UUID0" has "uuid=$UUID0"
      run v1-cuda-none -- "$R/bin/cudacheck"
      check process.v1.cuda.none "CUDA in a host process without GPUs finds no device" hasnt 'cuda_count=[1-9]'
    fi
    run v1-none -- sh -c 'cat /dev/nvidia0 2>&1 | head -c 200; cat /dev/nvidiactl 2>&1 | head -c 200; echo'
    check process.v1.denied "a host process without GPUs is denied /dev/nvidia0" has "Operation not permitted"
  else
    skip process.v1 "mounting a v1 devices hierarchy failed: $(cat "$W/mount.err")"
  fi
fi

# Issue 31: one task's fork bomb stops at the agent's task_pids_max (on
# this host's own cgroup version), counted by the kernel in pids.events.
sec "processes per task"
kill "$AGENT_PID"; wait "$AGENT_PID" 2>/dev/null
start_agent --task-pids-max 40
wait_gpus || fail pids.agent "the agent did not come back"
sleep 2
J=$($G jobs submit --name bomb -- python3 -c 'import os, time
n = 0
for i in range(300):
    try:
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        n += 1
    except OSError:
        pass
print("forked", n, flush=True); time.sleep(30)')
for _ in $(seq 30); do [ "$(state "$J")" = RUNNING ] && break; sleep 1; done
TASK=$($G jobs get "$J" --json | python3 -c 'import json,sys;print(json.load(sys.stdin)["tasks"][0]["id"])')
AID=$($G agents list --json | python3 -c 'import json,sys;print(json.load(sys.stdin)[0]["id"])')
for d in /sys/fs/cgroup/gpuctl/$AID/$TASK /sys/fs/cgroup/pids/gpuctl/$AID/$TASK; do [ -e "$d/pids.max" ] && PCG=$d; done
sleep 3
LOG=$($G jobs logs "$J" 2>&1)
echo "cgroup ${PCG:-none}: max $(cat "$PCG/pids.max" 2>&1) current $(cat "$PCG/pids.current" 2>&1) events $(cat "$PCG/pids.events" 2>&1); $LOG"
check pids.max "the task's cgroup has pids.max 40 (${PCG:-no pids cgroup})" [ "$(cat "$PCG/pids.max" 2>/dev/null)" = 40 ]
check pids.refused "the kernel refused its forks past it (pids.events)" \
  python3 -c "import sys; sys.exit(not int(open(sys.argv[1]).read().split()[1]) > 0)" "$PCG/pids.events"
check pids.inside "inside, fewer than 40 of 300 forks went through ($LOG)" \
  python3 -c "import sys; sys.exit(not int(sys.argv[1].split()[1]) < 40)" "$LOG"
$G jobs cancel "$J" >/dev/null

sec mig
# MIG through gpuctl on GPU 0 (issue 33): the agent turns MIG mode on if it
# can without a reset (an H100 can; a VM may refuse), splits the GPU into
# one device of its smallest profile, a host job asking for that profile
# runs CUDA and sees one device of the slice's memory, and the GPU goes
# back whole. What the driver says is recorded whatever happens.
gj() { $G gpus --json | python3 -c "import json,sys; g=json.load(sys.stdin)[0]; $1"; }
GPU0=$(gj 'print(g["uuid"])')
nvidia-smi -i 0 --query-gpu=mig.mode.current,mig.mode.pending --format=csv 2>&1 | tee "$OUT/mig-mode.txt"
if [[ " ${GPUCTL_HW_SKIP:-} " == *" mig "* ]]; then
  skip mig "skipped: GPUCTL_HW_SKIP"
elif [ "$(gj 'print((g.get("mig") or {}).get("capable", False))')" != True ]; then
  skip mig "GPU 0 has no MIG (NVML reports no MIG mode)"
else
  $G gpus --json >"$OUT/mig-before.json"
  # The smallest profile NVML lists (once MIG mode is on, if it is off now).
  PROFILE=$(gj 'p=sorted((g["mig"].get("profiles") or []), key=lambda p: (p["gpu_slices"], p["memory_mib"])); print(p[0]["name"] if p else "1g.10gb")')
  $G gpus mig set "$GPU0" --profiles "$PROFILE" --timeout 180 >"$OUT/mig-set.txt" 2>&1
  MIG_RC=$?
  cat "$OUT/mig-set.txt"
  nvidia-smi -L 2>&1 | tee "$OUT/mig-L.txt"
  ls -l /dev/nvidia-caps 2>&1 | head; head -5 /proc/driver/nvidia-caps/mig-minors 2>&1
  if [ $MIG_RC -ne 0 ]; then
    fail mig.set "gpus mig set $PROFILE: $(tail -1 "$OUT/mig-set.txt")"
  else
    MIGUUID=$(gj 'print(g["mig"]["devices"][0]["uuid"] if g["mig"]["devices"] else "")')
    check mig.discovery "gpuctl lists MIG device $MIGUUID ($PROFILE), as nvidia-smi -L does" \
      grep -q "${MIGUUID:-none}" "$OUT/mig-L.txt"
    if [ -x "$R/bin/cudacheck" ]; then
      run mig-cuda --mig "$PROFILE" -- sh -c "echo NVD=\$NVIDIA_VISIBLE_DEVICES; $R/bin/cudacheck"
      check mig.visible "the task's NVIDIA_VISIBLE_DEVICES is its MIG device" has "NVD=$MIGUUID"
      check mig.cuda "CUDA in the task sees exactly one device, the slice" has "cuda_count=1 "
    else
      skip mig.cuda "no nvcc: cudacheck not built"
    fi
    $G gpus mig set "$GPU0" --disable --timeout 180 >"$OUT/mig-disable.txt" 2>&1
    check mig.disable "gpus mig set --disable gives GPU 0 back whole ($(tail -1 "$OUT/mig-disable.txt"))" \
      [ "$(gj 'print(g["mig"]["enabled"])')" = False ]
  fi
fi

sec mps
# Fractions of an MPS-shared GPU (issue 34): the agent's MPS daemon, the
# per-process limit MPS enforces, and the task total the agent holds.
GPU0=${GPU0:-$($G gpus --json | python3 -c 'import json,sys;print(json.load(sys.stdin)[0]["uuid"])')}
if [[ " ${GPUCTL_HW_SKIP:-} " == *" mps "* ]]; then
  skip mps "skipped: GPUCTL_HW_SKIP"
elif ! command -v nvidia-cuda-mps-control >/dev/null; then
  skip mps "no nvidia-cuda-mps-control on this host"
elif [ "$CUDA" != 1 ]; then
  skip mps "no nvcc: cudacheck not built"
else
  $G gpus share "$GPU0" --mode mps 2>&1 | tee "$OUT/mps-share.txt"
  IMG=(); CC=$R/bin/cudacheck
  [ "$DOCKER" = 1 ] && { IMG=(--image gpuctl-hw:1); CC=cudacheck; }
  run mps-one --gpu-mem 2GiB --gpu-compute 50 "${IMG[@]}" -- sh -c \
    "env | grep CUDA_MPS; ls \$CUDA_MPS_PIPE_DIRECTORY; $CC alloc 1024 5"
  check mps.enforcement "a fraction on an mps GPU says enforcement mps" grep -q 'Enforcement of .*: mps' "$OUT/job-mps-one.txt"
  check mps.env "the task's MPS limits are in its environment" has 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M'
  check mps.alloc "1 GiB under a 2 GiB fraction is allocated" has 'alloc want=1024 got=1024 err=no error'
  ls -la "$W/agent/mps/$GPU0"/*/ 2>&1; cat "$W/agent/mps/$GPU0"/*/log/control.log 2>&1 | tail -20
  run mps-over --gpu-mem 2GiB "${IMG[@]}" -- sh -c "$CC alloc 3072 2"
  check mps.process_limit "one process past its 2 GiB is refused by MPS ($(grep -o 'alloc .*' <<<"$LOG"))" \
    python3 -c "import re,sys; m=re.search(r'got=(\d+)', sys.argv[1]); sys.exit(not (m and int(m.group(1)) <= 2048))" "$LOG"
  # Two processes each under the limit, together over it: MPS lets both
  # (its limits are per process); the agent stops the task.
  run mps-two --gpu-mem 2GiB "${IMG[@]}" -- sh -c "$CC alloc 1536 60 & $CC alloc 1536 60; wait"
  check mps.total "two processes of 1.5 GiB in a 2 GiB fraction: GPU_MEMORY_LIMIT" \
    sh -c "$G jobs get $J --json | grep -q GPU_MEMORY_LIMIT"
  $G gpus share "$GPU0" --off 2>&1 | tail -1
fi

sec "gpuctl demo"
# The README's main command, installed binaries on a real GPU host: it asks
# gpuctl-agent check, starts its own master and agent (free loopback
# ports), runs a 1-GPU and a second job and stops them. The check's own
# daemons and its v1 devices hierarchy go first, so the demo sees the host
# as a user would.
for p in ${AGENT_PID:-} ${MASTER_PID:-}; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
AGENT_PID= MASTER_PID=
umount "$W/cg1/devices" 2>/dev/null
echo "/bin/busybox: $(ls -l /bin/busybox 2>&1)"
DEMO_T0=$(date +%s)
# SIGINT: the demo's Ctrl-C path, which stops its agent and master.
(cd "$W" && timeout -s INT -k 20 180 "$BIN/gpuctl" demo) >"$OUT/demo.txt" 2>&1
DEMO_RC=$?
DEMO_S=$(( $(date +%s) - DEMO_T0 ))
cat "$OUT/demo.txt"
check demo.exit "gpuctl demo exits 0 (rc $DEMO_RC, ${DEMO_S}s)" [ "$DEMO_RC" = 0 ]
check demo.real "it uses the $NGPU real GPU(s): $(grep -o 'Found .*' "$OUT/demo.txt" | head -1)" \
  sh -c "grep -q 'Found $NGPU real GPU' '$OUT/demo.txt' && grep -q 'registered with $NGPU GPU' '$OUT/demo.txt'"
if [ "$DOCKER" = 1 ]; then
  check demo.docker "its jobs run in Docker: $(grep -E '^==> (Jobs run|Docker |The demo image)' "$OUT/demo.txt" | head -1 | cut -c5-160)" \
    grep -q 'Jobs run in Docker containers' "$OUT/demo.txt"
else
  skip demo.docker "dockerd does not answer: the demo runs host processes"
fi
check demo.succeeded "both jobs SUCCEEDED: $(grep -oE '^==> demo-[12]gpu: [A-Z]+' "$OUT/demo.txt" | cut -c5- | paste -sd,)" \
  sh -c "grep -q '^==> demo-1gpu: SUCCEEDED' '$OUT/demo.txt' && grep -q '^==> demo-2gpu: SUCCEEDED' '$OUT/demo.txt' && grep -q 'Both jobs SUCCEEDED' '$OUT/demo.txt'"
check demo.uuid "both jobs' NVIDIA_VISIBLE_DEVICES name GPUs nvidia-smi lists: $(grep -o '^\[demo-[12]gpu\] job .*' "$OUT/demo.txt" | sed 's/ job .*GPUs / /' | tr '\n' ' ')" \
  python3 -c '
import re, sys
smi = {l.split(",")[0].strip() for l in open(sys.argv[2]) if l.strip()}
seen = dict(re.findall(r"^\[(demo-[12]gpu)\] job .*GPUs (\S+)$", open(sys.argv[1]).read(), re.M))
sys.exit(not (len(seen) == 2 and all(u in smi for v in seen.values() for u in v.split(","))))' "$OUT/demo.txt" "$W/smi-uuid-name.txt"

sec logs
tail -40 "$OUT/agent.log"; tail -20 "$OUT/master.log"
echo
cat "$OUT/summary.txt"
! grep -q '^FAIL' "$OUT/summary.txt"
