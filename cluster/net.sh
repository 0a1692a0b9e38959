# The emulated nodes' network: a bridge on the host side and one network namespace per node,
# joined by a veth pair; plus the /etc/hosts block that names the nodes. Sourced after lib.sh,
# never run. Every function is idempotent. Nothing here routes outside $NET_PREFIX.0/$NET_BITS:
# the namespaces get no default route, and the host's forwarding setting is left as it is.
# shellcheck shell=bash

# net_probe: true when this machine can make network namespaces, bridges and veth pairs;
# otherwise prints why in one line.
net_probe() {
  local probe=hpprobe$$ err # interface names: 15 characters at most
  for cmd in ip nsenter unshare; do
    command -v "$cmd" >/dev/null || { echo "$cmd is not installed"; return 1; }
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && return 0 # made by an earlier run
  if ! err=$(ip link add "$probe" type bridge 2>&1); then
    echo "cannot create a bridge (ip link add type bridge: ${err//$'\n'/ })"
    return 1
  fi
  ip link del "$probe" 2>/dev/null || true
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "cannot create a network namespace (ip netns add: ${err//$'\n'/ })"
    return 1
  fi
  ip netns del "$probe" 2>/dev/null || true
}

# net_up: the bridge, one namespace per node with loopback and its veth up. A veth that lost its
# peer is rebuilt; a rate limit left by a test that died is removed.
net_up() {
  local n ns veth addr
  ip link show "$BRIDGE" >/dev/null 2>&1 || { log "creating bridge $BRIDGE"; ip link add "$BRIDGE" type bridge; }
  ip addr replace "$HOST_ADDR/$NET_BITS" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for n in "${NODES[@]}"; do
    ns=$(node_netns "$n") veth=$(node_veth "$n") addr=$(node_addr "$n")
    [[ -e /run/netns/$ns ]] || { log "creating network namespace $ns for $n ($addr)"; ip netns add "$ns"; }
    if ! ip link show "$veth" >/dev/null 2>&1 || ! in_netns "$n" ip link show "$NODE_IFNAME" >/dev/null 2>&1; then
      ip link del "$veth" 2>/dev/null || true
      in_netns "$n" ip link del "$NODE_IFNAME" 2>/dev/null || true
      ip link add "$veth" type veth peer name "hpp-$n"
      ip link set "hpp-$n" netns "$ns"
      in_netns "$n" ip link set "hpp-$n" name "$NODE_IFNAME"
    fi
    ip link set "$veth" master "$BRIDGE"
    tc qdisc del dev "$veth" root 2>/dev/null || true
    in_netns "$n" tc qdisc del dev "$NODE_IFNAME" root 2>/dev/null || true
    ip link set "$veth" up
    in_netns "$n" ip link set lo up
    in_netns "$n" ip addr replace "$addr/$NET_BITS" dev "$NODE_IFNAME"
    in_netns "$n" ip link set "$NODE_IFNAME" up
  done
}

# net_node_down NODE: remove the node's veth and namespace.
net_node_down() {
  local ns veth
  ns=$(node_netns "$1") veth=$(node_veth "$1")
  ip link del "$veth" 2>/dev/null && log "removed veth $veth" || true
  [[ -e /run/netns/$ns ]] && ip netns del "$ns" && log "removed network namespace $ns" || true
}

# net_down: remove every namespace, veth and the bridge that net_up made (for any node count).
net_down() {
  local n
  for n in $(known_nodes); do net_node_down "$n"; done
  ip link del "$BRIDGE" 2>/dev/null && log "removed bridge $BRIDGE" || true
}

# net_down_extra: remove the namespaces of nodes no longer configured (HPCDIST_NODES went down).
net_down_extra() {
  local n
  for n in $(known_nodes); do is_node "$n" || net_node_down "$n"; done
}

# netns_matches PID NODE: true when PID runs in NODE's network namespace.
netns_matches() {
  local want
  want=$(stat -L -c %i "/run/netns/$(node_netns "$2")" 2>/dev/null) || return 1
  [[ $(readlink "/proc/$1/ns/net" 2>/dev/null) == "net:[$want]" ]]
}

# hosts_set LINE...: make the marked block in /etc/hosts hold exactly these lines (none: remove
# it). Rewritten in place, not renamed, as /etc/hosts is often a bind mount.
hosts_set() {
  local old new
  old=$(cat "$HOSTS_FILE")
  new=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' <<<"$old")
  if (($#)); then
    new+=$'\n'"$HOSTS_BEGIN"
    for line in "$@"; do new+=$'\n'"$line"; done
    new+=$'\n'"$HOSTS_END"
  fi
  [[ $new == "$old" ]] && return 0
  printf '%s\n' "$new" >"$HOSTS_FILE"
  (($#)) && log "wrote the node names into $HOSTS_FILE" || log "removed the node names from $HOSTS_FILE"
}
