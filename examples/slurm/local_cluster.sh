#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for trying the sbatch without a cluster
# (tests/test_slurm_cluster.py). Needs root and Debian's slurm-wlm, munge and iproute2.
#
#   examples/slurm/local_cluster.sh start   # munged, slurmctld, and node1/node2: each a network
#                                           # namespace with its own address and host name, running slurmd
#   export SLURM_CONF=/tmp/megatron-async-slurm/slurm.conf   # then sbatch, squeue, scontrol as usual
#   examples/slurm/local_cluster.sh stop    # stops everything it started and removes the namespaces
#   examples/slurm/local_cluster.sh kill-node node2    # a node lost: its slurmd and every process on it, kill -9
#   examples/slurm/local_cluster.sh start-node node2   # the node back (its slurmd again)
#
# BASE (default /tmp/megatron-async-slurm) holds the configuration, state, spool and logs.
set -euo pipefail

BASE=${BASE:-/tmp/megatron-async-slurm}
NODES=(node1 node2)
SUBNET=10.77.0
BRIDGE=mas-br0
CONF=$BASE/slurm.conf

address() { echo "$SUBNET.$((11 + $1))"; }

write_conf() {
  mkdir -p "$BASE/state" "$BASE/log" "$BASE/run"
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
  cat > "$CONF" <<CONF
ClusterName=megatron-async-local
SlurmctldHost=$(hostname -s)($SUBNET.1)
AuthType=auth/munge
# job credentials live 10 s (default 120): also how long a requeued job waits before it starts again
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.%n.log
SlurmctldPort=6817
SlurmdPort=6818
ReturnToService=2
SlurmdTimeout=10
JobRequeue=1
KillWait=10
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=node1 NodeAddr=$(address 0) CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=node2 NodeAddr=$(address 1) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

start_munge() {
  mkdir -p /run/munge /etc/munge
  chown munge:munge /run/munge 2>/dev/null || true
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  if ! pgrep -x munged > /dev/null; then
    runuser -u munge -- /usr/sbin/munged --force
    pgrep -x -n munged > "$BASE/munged.ours"  # started here, so stopped here too (by this pid)
  fi
}

start_network() {
  ip link add "$BRIDGE" type bridge 2>/dev/null || true
  ip addr add "$SUBNET.1/24" dev "$BRIDGE" 2>/dev/null || true
  ip link set "$BRIDGE" up
  local i=0 node
  for node in "${NODES[@]}"; do
    ip netns add "mas-$node" 2>/dev/null || true
    ip link add "mas-$node-h" type veth peer name eth0 netns "mas-$node" 2>/dev/null || true
    ip link set "mas-$node-h" master "$BRIDGE" up
    ip -n "mas-$node" addr add "$(address $i)/24" dev eth0 2>/dev/null || true
    ip -n "mas-$node" link set eth0 up
    ip -n "mas-$node" link set lo up
    # bind-mounted over /etc/hosts for the node's slurmd (and so for its jobs)
    mkdir -p "/etc/netns/mas-$node"
    {
      echo "127.0.0.1 localhost"
      echo "$SUBNET.1 $(hostname -s)"
      local j=0 other
      for other in "${NODES[@]}"; do echo "$(address $j) $other"; j=$((j + 1)); done
    } > "/etc/netns/mas-$node/hosts"
    i=$((i + 1))
  done
}

start_node() {
  local node=$1
  mkdir -p "$BASE/spool/$node"
  # the node's network namespace only (`ip netns exec` would remount /sys, hiding the cgroup
  # file system slurmd reads), plus its own host name and /etc/hosts
  nsenter --net="/run/netns/mas-$node" unshare --mount --uts sh -c \
    "mount --bind /etc/netns/mas-$node/hosts /etc/hosts && hostname $node && exec /usr/sbin/slurmd -f $CONF -N $node"
}

kill_node() {  # every process in the node's network namespace: its slurmd, slurmstepds and ranks
  ip netns pids "mas-$1" | xargs -r kill -9
}

start() {
  write_conf
  start_munge
  start_network
  export SLURM_CONF=$CONF
  /usr/sbin/slurmctld -f "$CONF"
  for node in "${NODES[@]}"; do
    start_node "$node"
  done
  local deadline=$((SECONDS + 60))
  until [[ "$(sinfo -h -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')" == "idle " ]]; do
    if (( SECONDS > deadline )); then
      echo "local_cluster: the nodes did not come up within 60 s:" >&2
      sinfo -N -l >&2 || true
      tail -n 20 "$BASE"/log/*.log >&2 || true
      stop
      exit 1
    fi
    sleep 1
  done
  echo "local_cluster: up; export SLURM_CONF=$CONF"
  sinfo -N
}

stop() {
  export SLURM_CONF=$CONF
  scancel --quiet --full --signal=KILL --partition=local 2>/dev/null || true
  local pidfile
  for pidfile in "$BASE"/run/slurmd.*.pid "$BASE/run/slurmctld.pid"; do
    [[ -f "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  pkill -9 -f "slurmd -f $CONF" 2>/dev/null || true  # only daemons of this cluster's configuration
  pkill -9 -f "slurmctld -f $CONF" 2>/dev/null || true
  local node  # the nodes' slurmstepds and ranks live in their network namespaces: ended below, by pid
  for node in "${NODES[@]}"; do
    ip netns pids "mas-$node" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "mas-$node" 2>/dev/null || true
    ip link del "mas-$node-h" 2>/dev/null || true
    rm -rf "/etc/netns/mas-$node"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if [[ -f "$BASE/munged.ours" ]]; then
    [[ -s "$BASE/munged.ours" ]] && kill "$(cat "$BASE/munged.ours")" 2>/dev/null || true
    rm -f "$BASE/munged.ours"
  fi
  rm -rf "$BASE/state" "$BASE/run"
  echo "local_cluster: stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  kill-node) kill_node "${2:?which node}" ;;
  start-node) export SLURM_CONF=$CONF; start_node "${2:?which node}" ;;
  *) echo "usage: $0 start|stop|kill-node NODE|start-node NODE" >&2; exit 2 ;;
esac
