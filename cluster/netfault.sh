#!/usr/bin/env bash
# Network faults on one emulated node's link, for tests (tests/netfault.py wraps this):
#   netfault.sh slow NODE RATE   rate-limit the node's link both ways (tc tbf; RATE as tc takes
#                                it: 8mbit, 500kbit); netem is not in every kernel, tbf is
#   netfault.sh cut NODE         take the link down: nothing reaches the node or leaves it
#   netfault.sh restore NODE     no rate limit, link up (always safe to run)
#   netfault.sh show NODE        the link's state and queueing discipline, both ends
#   netfault.sh exec NODE CMD... run CMD in the node's network namespace (for measuring)
#   netfault.sh controller NODE off|on   the Slurm controller's port refused from the node (a TCP
#                                reset, as while slurmctld restarts or fails over), or open again;
#                                restore also opens it
# Needs the cluster up in netns mode (cluster/up.sh); says so in one line otherwise.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$HERE/lib.sh"

usage() { echo "usage: $0 slow NODE RATE | cut NODE | restore NODE | show NODE | exec NODE CMD... | controller NODE off|on" >&2; exit 2; }
(($# >= 2)) || usage
action=$1 node=$2
shift 2
mode=$(cat "$MODE_FILE" 2>/dev/null || echo "down")
[[ $mode == netns ]] || { echo "netfault: the cluster is not in netns mode ($mode); run cluster/up.sh" >&2; exit 1; }
[[ " ${NODES[*]} " == *" $node "* ]] || { echo "netfault: no node '$node'; nodes are ${NODES[*]}" >&2; exit 2; }
veth=$(node_veth "$node")
ctld_rule=(OUTPUT -p tcp -d "$HOST_ADDR" --dport 6817 -j REJECT --reject-with tcp-reset)

case $action in
  slow)
    (($# == 1)) || usage
    # burst: what may pass at line speed before the limit holds; latency: how long a packet may
    # queue before it is dropped (long enough that TCP slows down rather than stalls).
    tc qdisc replace dev "$veth" root tbf rate "$1" burst 16kb latency 500ms
    in_netns "$node" tc qdisc replace dev "$NODE_IFNAME" root tbf rate "$1" burst 16kb latency 500ms
    log "netfault: $node's link limited to $1 both ways"
    ;;
  cut)
    ip link set "$veth" down
    log "netfault: $node's link cut"
    ;;
  restore)
    tc qdisc del dev "$veth" root 2>/dev/null || true
    in_netns "$node" tc qdisc del dev "$NODE_IFNAME" root 2>/dev/null || true
    ip link set "$veth" up
    # Back only once it carries traffic: the node's end has its carrier again (that follows the
    # host end's "up" asynchronously), and the neighbour entries made while it was cut (still
    # resolving, or failed) are forgotten: a connection made at once would otherwise get
    # "No route to host" when the resolution started during the cut gives up.
    for _ in $(seq 50); do
      in_netns "$node" ip -br link show dev "$NODE_IFNAME" | grep -q LOWER_UP && break
      sleep 0.1
    done
    in_netns "$node" ip neigh flush dev "$NODE_IFNAME" 2>/dev/null || true
    ip neigh flush dev "$BRIDGE" nud failed nud incomplete 2>/dev/null || true
    while in_netns "$node" iptables -D "${ctld_rule[@]}" 2>/dev/null; do :; done
    ;;
  controller)
    (($# == 1)) || usage
    case $1 in
      off) in_netns "$node" iptables -A "${ctld_rule[@]}"; log "netfault: the controller refused from $node" ;;
      on) while in_netns "$node" iptables -D "${ctld_rule[@]}" 2>/dev/null; do :; done ;;
      *) usage ;;
    esac
    ;;
  show)
    ip -br link show "$veth"
    tc qdisc show dev "$veth"
    in_netns "$node" tc qdisc show dev "$NODE_IFNAME"
    ;;
  exec)
    (($# >= 1)) || usage
    exec nsenter --net="/run/netns/$(node_netns "$node")" "$@"
    ;;
  *) usage ;;
esac
